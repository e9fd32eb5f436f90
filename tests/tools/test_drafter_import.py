"""Published drafters in: `vltrain generate --draft` reads a z-lab DFlash checkpoint (as
`--format dflash` writes it) and decodes exactly as the original, `model.init_from` continues
training a speculators checkpoint from its weights, and bad imports are refused in one line
with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.stages.drafter_fixtures import TEXTS, tiny_lm
from vltrain.cli import main
from vltrain.config.core import ConfigError

SHAPE = ["drafter.arch=dflash", "drafter.layer_ids=[1,3]", "drafter.draft_vocab=0"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A dflash-arch drafter of a tiny Llama, trained 6 steps, exported in both formats."""
    from tests.stages.test_drafter_stage import _train_args

    d = tmp_path_factory.mktemp("import")
    lm = tiny_lm(d / "lm", layers=6)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    data = d / "answers.jsonl"  # the target's own answers: the drafter learns to be accepted
    regen = ["data", "regenerate", "--model", str(lm), "--data", str(d / "prompts.jsonl")]
    assert main([*regen, "--out", str(data), "--max-new-tokens", "24"]) == 0
    args = _train_args(lm, d, d / "run", *SHAPE, "optim.lr=3e-3", "drafter.eval_prompts=0")
    assert main(args) == 0
    paths = {"lm": lm, "data": data, "run": d / "run", "root": d}
    for fmt in ("speculators", "dflash"):
        assert main(["export", str(d / "run"), "--out", str(d / fmt), "--format", fmt]) == 0
        paths[fmt] = d / fmt
    return paths


def _generate(setup, draft: Path, capsys, model: Path | None = None) -> tuple[int, str, dict]:
    stats = setup["root"] / "stats.json"
    stats.unlink(missing_ok=True)
    cmd = ["generate", "--model", str(model or setup["lm"])]
    cmd += ["--prompts", str(setup["root"] / "prompts.jsonl"), "--max-new-tokens", "16"]
    capsys.readouterr()
    rc = main([*cmd, "--draft", str(draft), "--stats", str(stats)])
    got = capsys.readouterr()
    st = json.loads(stats.read_text()) if stats.is_file() else {}
    return rc, got.out if rc == 0 else got.err.strip(), st


def _logits(drafter, model) -> torch.Tensor:
    """The drafter's logits (fp32) on the target's own features of a fixed token sequence:
    block i's output, ``hidden_states[i + 1]``, for each of the drafter's layer ids."""
    from vltrain.models.drafter import SharedParts

    head = model.get_output_embeddings()
    drafter.share(SharedParts(model.get_input_embeddings(), head, lambda: (head.weight, None)))
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in drafter.cfg.target_layer_ids], -1)  # (1, 12, F)
        pos, ok = torch.arange(12)[None], torch.ones(1, 12, dtype=torch.bool)
        a_ids, a_pos = ids[:, [4, 7]], torch.tensor([[4, 7]])
        return drafter.logits(drafter(feats, pos, ok, a_ids, a_pos))


def test_a_dflash_checkpoint_decodes_like_the_original(setup, capsys) -> None:
    """`--draft DFLASH_EXPORT`: the same lines, tau and per-row tau as `--draft RUN`. Negative
    control: the same checkpoint with its target layer ids shifted by one (the z-lab
    `hidden_states[id + 1]` offset applied twice) gives other logits."""
    from vltrain.models.drafter_checkpoint import load_drafter
    from vltrain.tools import export_drafter

    rc0, want, st0 = _generate(setup, setup["run"], capsys)
    rc1, got, st1 = _generate(setup, setup["dflash"], capsys)
    assert rc0 == rc1 == 0 and got == want and st0["tau"] > 0  # some drafts accepted
    assert (st1["tau"], st1["row_tau"]) == (st0["tau"], st0["row_tau"])
    imported, target = load_drafter(setup["dflash"])
    assert target["format"] == "dflash" and target["verifier"]["layers"] == 6
    model = export_drafter.load_target(str(setup["lm"]), "", setup["dflash"])[1]
    original, _ = load_drafter(setup["run"])
    assert torch.equal(_logits(imported, model), _logits(original, model))
    shifted = setup["root"] / "shifted"
    shutil.copytree(setup["dflash"], shifted)
    c = json.loads((shifted / "config.json").read_text())
    c["dflash_config"]["target_layer_ids"] = [i + 1 for i in c["dflash_config"]["target_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(c))
    off, _ = load_drafter(shifted)
    assert (_logits(off, model) - _logits(original, model)).abs().max() > 1e-3


def _stage(setup, *extra: str):
    """A drafter stage of `setup`'s shape, prepared (its target loaded), on CPU."""
    from tests.config.test_config import PRESETS
    from vltrain.config.schema import load_config
    from vltrain.engine.runtime import RunContext
    from vltrain.stages.drafter import DrafterStage

    preset = next(p for p in PRESETS if p.name == "drafter_smollm2.yaml")
    over = [f"model.target={setup['lm']}", f"data.train={setup['data']}", "drafter.block_size=4"]
    cfg = load_config(preset, [*over, *SHAPE, *extra])
    DrafterStage.check_config(cfg)
    ctx = RunContext(torch.device("cpu"), 0, 1, "fp32", cfg.run.seed)
    stage = DrafterStage(cfg, setup["root"] / "stage", ctx)
    stage.prepare()
    return stage


def test_init_from_takes_the_imports_draft_vocabulary_without_a_notice(setup, capsys) -> None:
    """The config's drafter.draft_vocab (the preset's 16,384 here, above this target's
    vocabulary) is not the run's when it continues an import: no notice about it (it printed
    one, found by a reviewer); the import's vocabulary (the whole one) is used."""
    capsys.readouterr()
    stage = _stage(setup, f"model.init_from={setup['speculators']}", "drafter.draft_vocab=16384")
    loss = stage.build_model()
    assert "draft_vocab" not in capsys.readouterr().err and loss.drafter.cfg.draft_vocab == 0
    _stage(setup, "drafter.draft_vocab=16384").build_model()  # control: without an import
    assert "'drafter.draft_vocab' 16384 is not below" in capsys.readouterr().err


def test_init_from_a_speculators_checkpoint_starts_from_its_weights(setup) -> None:
    """Step 0's drafter (built, its loader built: the draft vocabulary is not re-chosen) gives
    the imported drafter's logits; a config of another shape is refused with what differs."""
    from vltrain.models.drafter_checkpoint import load_drafter

    stage = _stage(setup, f"model.init_from={setup['speculators']}")
    loss = stage.build_model()
    stage.build_loader()
    model = stage.target.model.model
    imported, _ = load_drafter(setup["speculators"])
    assert torch.equal(_logits(loss.drafter.eval(), model), _logits(imported, model))
    fresh = _stage(setup).build_model()  # the control: without init_from, other logits
    assert not torch.equal(_logits(fresh.drafter.eval(), model), _logits(imported, model))
    with pytest.raises(ConfigError, match=r"block_size 4 \(this config: 8; set drafter.block"):
        _stage(
            setup, f"model.init_from={setup['speculators']}", "drafter.block_size=8"
        ).build_model()

    def qwen3_verifier(c: dict) -> None:
        c["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]

    def other_config(c: dict) -> None:
        c["vltrain"]["target"]["config_sha256"] = "0" * 64

    # made for another target: refused as `generate --draft` refuses it (it trained before)
    for edit, words in (
        (qwen3_verifier, r"another verifier: architecture \['Qwen3ForCausalLM'\].*model\.target"),
        (other_config, r"trained for another target: its config sha256 000000000000"),
    ):
        bad = _edited(setup, "speculators", edit.__name__, edit)
        with pytest.raises(ConfigError, match=words):
            _stage(setup, f"model.init_from={bad}").build_model()


def _edited(setup, fmt: str, name: str, edit) -> Path:
    """A copy of the `fmt` export with its config.json edited by `edit(config)`."""
    out = setup["root"] / f"{fmt}-{name}"
    shutil.copytree(setup[fmt], out, dirs_exist_ok=True)
    c = json.loads((out / "config.json").read_text())
    edit(c)
    (out / "config.json").write_text(json.dumps(c))
    return out


def _spec_block(c: dict) -> None:
    c["block_size"] = 5  # speculative_tokens stays 3


def _dflash_block(c: dict) -> None:
    c["dflash_config"]["block_size"] = 5


def _spec_mask(c: dict) -> None:
    c["mask_token_id"] = c["transformer_layer_config"]["vocab_size"]


def _dflash_mask(c: dict) -> None:
    c["dflash_config"]["mask_token_id"] = -1


def _spec_vocab(c: dict) -> None:
    c["transformer_layer_config"]["vocab_size"] -= 1
    c["draft_vocab_size"] -= 1


def _dflash_vocab(c: dict) -> None:
    c["vocab_size"] -= 1


@pytest.mark.parametrize(
    ("fmt", "edit", "words"),
    [
        ("speculators", _spec_block, "speculative_tokens 3 with block_size 5"),
        ("dflash", _dflash_block, "block_size 4 and dflash_config.block_size 5 disagree"),
        ("speculators", _spec_mask, "mask_token_id"),
        ("dflash", _dflash_mask, "mask_token_id -1 is not a token"),
        ("speculators", _spec_vocab, "made for another verifier: a vocabulary of"),
        ("dflash", _dflash_vocab, "made for another verifier: a vocabulary of"),
    ],
)
def test_bad_imports_are_refused_in_one_line(setup, capsys, fmt, edit, words) -> None:
    bad = _edited(setup, fmt, edit.__name__, edit)
    out = setup["root"] / "out.jsonl"
    capsys.readouterr()
    cmd = [
        "generate",
        "--model",
        str(setup["lm"]),
        "--prompts",
        str(setup["root"] / "prompts.jsonl"),
    ]
    assert main([*cmd, "--draft", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after HF's loading bar
    assert err.startswith("vltrain: error:") and words in err, err
    assert not out.exists()


def test_a_verifier_of_another_architecture_is_refused(setup, capsys) -> None:
    qwen2 = tiny_lm(setup["root"] / "qwen2", "qwen2", layers=6)
    rc, err, _ = _generate(setup, setup["speculators"], capsys, model=qwen2)
    err = err.splitlines()[-1]  # after HF's loading bar
    assert rc == 2 and err.startswith("vltrain: error:"), err
    assert "architecture ['LlamaForCausalLM'] (the model is ['Qwen2ForCausalLM'])" in err


def _damage(folder: Path, how: str) -> None:
    weights = folder / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    elif how == "no weights":
        weights.unlink()
    elif how == "a key missing":
        from safetensors.torch import load_file, save_file

        state = load_file(str(weights))
        del state["fc.weight"]
        save_file(state, str(weights), metadata={"format": "pt"})
    else:  # a config.json cut short
        (folder / "config.json").write_text((folder / "config.json").read_text()[:40])


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("truncated", "model.safetensors cannot be read as safetensors"),
        ("no weights", "holds no *.safetensors: the drafter's weights are missing"),
        ("a key missing", "weights do not match its config.json: missing 1 (fc.weight)"),
        ("cut config", "config.json is not valid JSON"),
    ],
)
def test_a_damaged_export_is_one_line_naming_what_is_wrong(setup, capsys, how, words) -> None:
    """Damaged files of an export (found by a reviewer: tracebacks of 29 lines, a message
    that ended at its colon, 'holds no drafter.json' for a broken config.json)."""
    bad = setup["root"] / f"damaged-{how.replace(' ', '_')}"
    shutil.copytree(setup["speculators"], bad, dirs_exist_ok=True)
    _damage(bad, how)
    rc, err, _ = _generate(setup, bad, capsys)
    assert rc == 2 and err.splitlines()[-1].startswith("vltrain: error:"), err
    assert words in err.splitlines()[-1] and "Traceback" not in err, err


def test_an_export_given_as_the_model_says_to_pass_it_as_draft(setup, capsys) -> None:
    """An export as --model: one line (it was transformers' 19-line ValueError); --model and
    --draft swapped: the model named as no drafter."""
    prompts = ["--prompts", str(setup["root"] / "prompts.jsonl")]
    capsys.readouterr()
    assert main(["generate", "--model", str(setup["speculators"]), *prompts]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("vltrain: error:"), err
    assert "is a drafter (a speculators or DFlash export): pass it as --draft" in err
    rc, err, _ = _generate(setup, setup["lm"], capsys, model=setup["speculators"])
    assert rc == 2 and "Traceback" not in err, err
    assert "holds a transformers model ('llama'), not a drafter" in err.splitlines()[-1]
