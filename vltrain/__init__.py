"""vltrain: train vision-language models (contrastive embedders and generative VLMs)."""

__version__ = "0.1.0"
