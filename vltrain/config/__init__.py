"""Typed configuration: schema, loading, validation."""

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config, dump_config, load_config

__all__ = ["Config", "ConfigError", "dump_config", "load_config"]
