"""train.epochs -> train.max_steps (and the warmup) through the budget hook, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from vltrain.config import ConfigError, load_config
from vltrain.data.shards import INDEX_NAME, write_shards
from vltrain.scaling.budget import resolve_budget


def _load(shapes_dir: Path, out: Path, **extra: object):
    overrides = [o for o in tiny_overrides(shapes_dir, out, **extra) if "max_steps" not in o]
    return load_config(None, overrides)


def test_epochs_derive_steps_and_warmup(shapes_dir: Path, tmp_path: Path, capsys) -> None:
    cfg = _load(shapes_dir, tmp_path, **{"train.epochs": 5, "optim.warmup_epochs": 0.5})
    got = resolve_budget(cfg, world_size=2)  # global batch 32: 128 // 32 = 4 steps per epoch
    assert got.train.max_steps == 20 and got.optim.warmup_steps == 2
    line = "128 samples, global batch 32, accum 1 -> 4 steps per epoch, 5 epochs = 20 steps"
    assert line in capsys.readouterr().out
    capped = _load(shapes_dir, tmp_path, **{"train.epochs": 1, "data.max_train_samples": 64})
    assert resolve_budget(capped).train.max_steps == 64 // 16  # the records the stage uses
    plain = _load(shapes_dir, tmp_path)  # negative control: no epochs, nothing derived
    assert resolve_budget(plain) is plain


def test_epochs_with_max_steps_is_refused(shapes_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'train.epochs' and 'train.max_steps' are both set"):
        load_config(None, tiny_overrides(shapes_dir, tmp_path, **{"train.epochs": 2}))
    with pytest.raises(ConfigError, match="save_every_epoch' needs 'train.epochs'"):
        load_config(None, tiny_overrides(shapes_dir, tmp_path, **{"train.save_every_epoch": True}))
    with pytest.raises(ConfigError, match="warmup_epochs' needs 'train.epochs'"):
        load_config(None, tiny_overrides(shapes_dir, tmp_path, **{"optim.warmup_epochs": 1}))
    with pytest.raises(ConfigError, match="pick one"):
        _load(shapes_dir, tmp_path, **{"train.epochs": 2, "train.max_samples": 64})


def test_warmup_longer_than_the_epochs_is_refused(shapes_dir: Path, tmp_path: Path) -> None:
    cfg = _load(shapes_dir, tmp_path, **{"train.epochs": 1, "optim.warmup_steps": 100})
    with pytest.raises(ConfigError, match="warmup .100 steps. exceeds the 8 steps"):
        resolve_budget(cfg)


def test_streaming_epochs_need_the_shard_index(shapes_dir: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    write_shards(shapes_dir / "train.jsonl", shards, 40)  # 128 samples: 40, 40, 40, 8
    cfg = _load(shapes_dir, tmp_path / "run", **{"train.epochs": 2, "data.train": shards})
    assert resolve_budget(cfg).train.max_steps == 2 * (128 // 16)
    (shards / INDEX_NAME).unlink()
    with pytest.raises(ConfigError, match=f"without a {INDEX_NAME}"):
        resolve_budget(cfg)


def test_epochs_count_pair_records(tmp_path: Path) -> None:
    """Query/positive records (the pages workload) count one sample per record."""
    from vltrain.data.synth_pages import pages_command

    data = tmp_path / "pages"
    pages_command(str(data), n_train=48, n_val=4, n_test=0, negatives=1, distractors=4)
    over = [f"run.out_dir={tmp_path / 'run'}", f"data.train={data / 'train.jsonl'}"]
    over += ["data.batch_size=8", "train.epochs=2", "optim.warmup_steps=0"]
    cfg = load_config(REPO / "configs" / "pages.yaml", over)
    assert resolve_budget(cfg).train.max_steps == 2 * (48 // 8)


def test_an_override_of_the_length_replaces_the_presets(tmp_path: Path) -> None:
    """`vltrain train configs/clip.yaml train.epochs=3`: the preset's max_steps gives way (and
    the other way round); both in one layer stays an error."""
    preset, out = REPO / "configs" / "clip.yaml", f"run.out_dir={tmp_path}"
    assert load_config(preset, [out, "train.epochs=3"]).train.epochs == 3
    epochs_file = tmp_path / "epochs.yaml"
    epochs_file.write_text("train:\n  epochs: 3\n  save_every_epoch: false\n")
    cfg = load_config(epochs_file, [out, "train.max_steps=7", "optim.warmup_steps=0"])
    assert (cfg.train.epochs, cfg.train.max_steps) == (0, 7)
    with pytest.raises(ConfigError, match="both set"):
        load_config(preset, [out, "train.epochs=3", "train.max_steps=7"])
    both_file = tmp_path / "both.yaml"
    both_file.write_text("train:\n  epochs: 3\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match="both set"):
        load_config(both_file, [out])
    load_config(both_file, [out, "train.resume=true"])  # a run's own config.yaml, resumed
