"""`model.init_from` in the contrastive stage: weights and tokenizer come from the source run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_overrides
from vltrain.config import ConfigError, load_config
from vltrain.runs import train

SRC = {"train.max_steps": 2, "train.save_every": 2, "optim.warmup_steps": 0}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "step_1" / "model.safetensors"))


def test_init_from_loads_weights_and_tokenizer(shapes_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    train(load_config(None, tiny_overrides(shapes_dir, src, **SRC)))
    # One step at lr 1e-9 moves no weight by more than ~1e-9: the new run starts from the source.
    opts = {
        "model.init_from": src,
        "train.max_steps": 1,
        "train.save_every": 1,
        "optim.lr": 1e-9,
        "optim.warmup_steps": 0,
        "data.tokenizer_vocab": 300,  # ignored: the source's tokenizer is reused
        "objective.hard_negatives": 2,  # the usual second round: mined negatives, same model
    }
    dst = tmp_path / "dst"
    train(load_config(None, tiny_overrides(shapes_dir, dst, **opts)))
    start = load_file(str(src / "checkpoints" / "step_2" / "model.safetensors"))
    after = _weights(dst)
    assert start.keys() == after.keys()
    assert all(torch.allclose(start[k], after[k], rtol=0, atol=1e-6) for k in start)
    tok = "tokenizer/tokenizer.json"
    assert (src / tok).read_bytes() == (dst / tok).read_bytes()

    # Negative control: without init_from the same run starts from a random init.
    fresh = tmp_path / "fresh"
    opts.pop("model.init_from")
    train(load_config(None, tiny_overrides(shapes_dir, fresh, **opts)))
    assert not torch.equal(
        start["encoder.text_proj.weight"], _weights(fresh)["encoder.text_proj.weight"]
    )


def test_init_from_mismatch_and_missing_are_explained(shapes_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    train(load_config(None, tiny_overrides(shapes_dir, src, **SRC)))
    bad = tiny_overrides(
        shapes_dir, tmp_path / "bad", **{"model.init_from": src, "model.embed_dim": 48}
    )
    with pytest.raises(ConfigError, match="do not fit the model: encoder"):
        train(load_config(None, bad))
    gone = tiny_overrides(shapes_dir, tmp_path / "gone", **{"model.init_from": tmp_path / "nope"})
    with pytest.raises(ConfigError, match="model.init_from"):
        train(load_config(None, gone))
