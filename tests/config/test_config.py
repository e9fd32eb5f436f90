from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vltrain.config import ConfigError, dump_config, load_config
from vltrain.config.core import all_keys, describe
from vltrain.config.schema import Config

REPO = Path(__file__).resolve().parents[2]
# every shipped preset (configs/ at the root links to the package's preset folder)
PRESETS = sorted((REPO / "configs").glob("*.yaml"))


def test_defaults_yaml_and_overrides_merge_in_order(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 1.0e-3\ndata:\n  batch_size: 8\n")
    cfg = load_config(f, ["optim.lr=3e-4"])
    assert cfg.optim.lr == pytest.approx(3e-4)  # override beats YAML
    assert cfg.data.batch_size == 8  # YAML beats default
    assert cfg.optim.weight_decay == Config().optim.weight_decay  # default kept


def test_an_empty_mapping_override_clears_a_presets_options(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  text_options: {layers: 0, pool: mean}\n")
    assert load_config(f, ["model.text_options={pool: last}"]).model.text_options == {
        "layers": 0,
        "pool": "last",
    }  # a mapping merges into the preset's
    assert load_config(f, ["model.text_options={}"]).model.text_options == {}  # {} clears


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lrr=1e-3", "unknown config key 'optim.lrr'; did you mean optim.lr?"),
        ("trian.max_steps=3", "did you mean train?"),
        ("data.batch_sise=3", "did you mean data.batch_size?"),
    ],
)
def test_unknown_key_names_closest_valid_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("?", r"\?").replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override, key, what",
    [
        ("data.batch_size=abc", "data.batch_size", "expects int"),
        ("data.batch_size=2.5", "data.batch_size", "expects int"),
        ("run.deterministic=3", "run.deterministic", "expects bool"),
        ("optim.betas=0.9", "optim.betas", "expects a list"),
        ("data.batch_size=0", "data.batch_size", "must be >= 1"),
        ("optim.lr=-1", "optim.lr", "must be > 0"),
        ("run.precision=bf61", "run.precision", "did you mean 'bf16'"),
    ],
)
def test_wrong_type_or_range_names_key_and_expectation(override: str, key: str, what: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in str(e.value) and what in str(e.value)


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(None, ["train.max_steps=10", "optim.warmup_steps=20"])


def test_allow_changes_entries_are_config_keys() -> None:
    """An entry that is no key allowed nothing, silently (the resume then said only that the
    misspelt key's value differed)."""
    for entry, hint in (("optim.lrr", "optim.lr"), ("train.max_step", "train.max_steps")):
        with pytest.raises(
            ConfigError, match=rf"entry '{entry}' is neither.*did you mean {hint}\?"
        ):
            load_config(None, [f"train.allow_changes=[{entry}]"])
    with pytest.raises(ConfigError, match="entry 'optim' is neither a config key"):
        load_config(None, ["train.allow_changes=[optim]"])  # a section, not a key
    # negative control: keys, a mapping's sub-keys (how a resume names their changes) and
    # global_batch are accepted
    ok = "[train.max_steps, model.vision_options, optim.lr_scale.vision, global_batch]"
    assert len(load_config(None, [f"train.allow_changes={ok}"]).train.allow_changes) == 4


def test_yaml_scientific_notation_without_dot_is_a_float() -> None:
    assert load_config(None, ["optim.lr=5e-4"]).optim.lr == pytest.approx(5e-4)


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["optim.lr=3e-4", "optim.lr_scale={vision: 0.1}"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["optim"]["lr_scale"] == {
        "vision": 0.1
    }


def test_unsafe_yaml_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "evil.yaml"
    f.write_text("run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)


def test_every_field_is_documented() -> None:
    rows = describe(Config)
    assert len(rows) > 30
    assert all(doc.strip() for _, _, _, doc in rows)
    assert "optim.lr" in all_keys(Config)


def test_the_preset_list_is_every_shipped_file() -> None:
    """The parametrized preset tests cover each file of the preset folder (and not zero)."""
    folder = (REPO / "configs").resolve()
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    assert len(files) > 0, f"no presets in {folder}"
    assert [p.name for p in PRESETS] == files  # a .yml or stray file would be skipped silently
    assert len(PRESETS) == 23  # the presets shipped today; update when adding one


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_loads(preset: Path) -> None:
    if preset.name == "pipeline.yaml":  # a list of stage configs, not a config
        from vltrain.runs.pipeline import load_pipeline

        assert [s.name for s in load_pipeline(preset)] == ["pretrain", "finetune", "rl"]
        return
    if preset.name in (
        "pipeline_hf_vlm.yaml",
        "pipeline_llava.yaml",
        "pipeline_smollm2_llava.yaml",
    ):
        # their stages need model parts: loaded and run with tiny ones in
        # tests/stages/test_caption_hf.py and tests/runs/test_llava_recipe.py
        return
    if preset.name == "quickstart_pipeline.yaml":  # the quickstart's chain
        from vltrain.runs.pipeline import load_pipeline

        names = [s.name for s in load_pipeline(preset)]
        assert names == ["clip", "caption_pretrain", "caption_finetune", "caption_rl"]
        return
    cfg = load_config(preset)
    assert cfg.train.max_steps >= 1


def test_config_reference_doc_is_current() -> None:
    """docs/config.md is generated from the schema; regenerate with `vltrain config-docs`."""
    import io
    from contextlib import redirect_stdout

    from vltrain.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        main(["config-docs"])
    assert buf.getvalue().strip() == (REPO / "docs" / "config.md").read_text().strip(), (
        "docs/config.md is stale: run `vltrain config-docs --out docs/config.md`"
    )


def test_configs_name_outside_a_checkout_reads_the_shipped_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vltrain train configs/drafter.yaml` where vltrain was only pip-installed: the shipped
    preset, said on stderr; a configs/ file in the working directory wins; other names fail."""
    from vltrain.config.core import load_yaml

    monkeypatch.chdir(tmp_path)  # no configs/ here
    shipped = yaml.safe_load((REPO / "vltrain" / "configs" / "drafter.yaml").read_text())
    assert load_yaml("configs/drafter.yaml") == shipped
    assert "using the shipped preset" in capsys.readouterr().err
    assert load_config("configs/drafter.yaml").stage == "drafter"
    from vltrain.runs.pipeline import load_pipeline  # stage configs resolved the same way

    assert [s.name for s in load_pipeline("configs/pipeline.yaml")] == [
        "pretrain",
        "finetune",
        "rl",
    ]
    assert "shipped preset" in capsys.readouterr().err
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "drafter.yaml").write_text("train:\n  max_steps: 7\n")
    assert load_yaml("configs/drafter.yaml") == {"train": {"max_steps": 7}}
    assert "shipped" not in capsys.readouterr().err
    for missing in ("configs/no_such_preset.yaml", "drafter.yaml", "other/drafter.yaml"):
        with pytest.raises(ConfigError, match="config file not found"):
            load_yaml(missing)
