"""`vltrain export --format speculators|dflash`: the files, the refusals, the consumers' logits.

The speculators check (its own ``DFlashDraftModel.from_pretrained`` and forward) runs where
`speculators` is importable and is skipped otherwise (bench/drafter_export_parity.py runs it in
the bench venv; bench/RESULTS.md records it). The DFlash check reads the export with a loader
written from z-lab's modelling facts (bench/dflash_reference.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.models.drafter import config_sha256
from vltrain.tools import export_drafter

REPO = Path(__file__).resolve().parents[2]


def _bench():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(
        "drafter_export_parity", REPO / "bench" / "drafter_export_parity.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


bench = _bench()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return bench.make_case("qwen3", 0, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def llama48(tmp_path_factory):
    return bench.make_case("llama", 48, tmp_path_factory.mktemp("llama"))


def test_speculators_config_fields_and_weight_names(llama48, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = bench.export(llama48, tmp_path / "spec", "speculators")
    c = json.loads((out / "config.json").read_text())
    d = llama48.drafter.cfg
    assert c["speculators_model_type"] == "dflash"
    assert c["architectures"] == ["DFlashSpeculator"]
    assert c["draft_vocab_size"] == 48 and c["block_size"] == d.block_size
    assert c["aux_hidden_state_layer_ids"] == [i + 1 for i in d.target_layer_ids]
    assert c["mask_token_id"] == d.mask_token_id and c["sample_from_anchor"] is False
    tl = c["transformer_layer_config"]
    assert (tl["model_type"], tl["hidden_size"], tl["num_hidden_layers"]) == ("qwen3", 64, 2)
    assert tl["rms_norm_eps"] == 1e-6 and tl["vocab_size"] == bench.V
    spec = c["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == d.block_size - 1
    verifier = spec["verifier"]
    assert verifier["architectures"] == ["LlamaForCausalLM"]
    assert not Path(verifier["name_or_path"]).is_absolute()  # self-contained
    assert (out / verifier["name_or_path"]).resolve() == llama48.target_dir.resolve()
    sha = config_sha256(json.loads((llama48.target_dir / "config.json").read_text()))
    assert c["vltrain"]["target"]["config_sha256"] == sha
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        ids = torch.arange(48) + f.get_tensor("d2t")
        t2d = f.get_tensor("t2d")
    assert torch.equal(ids, llama48.drafter.vocab_ids) and int(t2d.sum()) == 48
    assert "layers.1.self_attn.k_norm.weight" in keys and "mlp.gate_proj" in str(sorted(keys))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"} <= keys
    assert not any(k.startswith("embed_tokens") or "verifier" in k for k in keys)


def test_dflash_export_gives_zlab_logits_and_the_offset_control_fails(qwen3, tmp_path) -> None:
    out = bench.export(qwen3, tmp_path / "dflash", "dflash")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"]["target_layer_ids"] == qwen3.drafter.cfg.target_layer_ids
    diff, problems = bench.dflash_diff(qwen3, out)
    assert not problems and diff <= bench.TOL
    assert bench.dflash_diff(qwen3, out, offset=2)[0] > bench.DETECT  # negative control


def test_plain_transformers_loads_the_dflash_export_with_its_modelling_file(
    qwen3, tmp_path
) -> None:
    """`AutoModel.from_pretrained(EXPORT, trust_remote_code=True)`: the modelling file the
    export carries, read by plain transformers, gives vltrain's logits (<= 1e-5, fp32) with no
    missing or unexpected key; the offset control still fails."""
    out = bench.export(qwen3, tmp_path / "dflash", "dflash")
    c = json.loads((out / "config.json").read_text())
    assert c["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (out / export_drafter.MODELING_FILE).is_file()
    model, problems = bench.transformers_load(out)
    assert type(model).__name__ == "DFlashDraftModel" and "vltrain" not in type(model).__module__
    diff, problems = bench.dflash_diff(qwen3, out, loader=bench.transformers_load)
    assert not problems and diff <= bench.TOL, (diff, problems)
    assert bench.dflash_diff(qwen3, out, 2, loader=bench.transformers_load)[0] > bench.DETECT


def test_speculators_loads_the_export_and_reproduces_the_logits(llama48, tmp_path) -> None:
    pytest.importorskip("speculators")
    out = bench.export(llama48, tmp_path / "spec", "speculators")
    diff, missing, unexpected, same_ids = bench.speculators_diff(llama48, out)
    assert not missing and not unexpected and same_ids and diff <= bench.TOL
    off = bench.export(llama48, tmp_path / "off", "speculators", layer_offset=0)
    assert bench.speculators_diff(llama48, off)[0] > bench.DETECT
    flip = bench.export(llama48, tmp_path / "flip", "speculators", sample_from_anchor=True)
    assert bench.speculators_diff(llama48, flip)[0] > bench.DETECT


def _vltrain_arch_checkpoint(case, folder: Path) -> Path:
    """The case's drafter rebuilt with vltrain's own layers (learned mask, no q/k norm)."""
    from vltrain.models.drafter import Drafter, DrafterConfig

    cfg = DrafterConfig(
        **{**case.drafter.cfg.to_dict(), "qk_norm": False, "learned_mask": True, "norm_eps": None}
    )
    twin = type(case)(case.name, case.target_dir, case.model, Drafter(cfg), case.ids)
    if cfg.draft_vocab:
        twin.drafter.set_vocab(case.drafter.vocab_ids)
    return bench.save_checkpoint(twin, folder)


def test_refusals_name_what_differs_and_write_nothing(qwen3, llama48, tmp_path, capsys) -> None:
    ckpt = _vltrain_arch_checkpoint(qwen3, tmp_path / "vl")
    out = tmp_path / "out"
    assert main(["export", str(ckpt), "--out", str(out), "--format", "speculators"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vltrain: error: this drafter cannot be written as speculators")
    assert "learned mask embedding" in err and "no q/k norm" in err and "\n" not in err
    assert not out.exists()
    # the dflash format has no draft vocabulary map
    ckpt48 = bench.save_checkpoint(llama48, tmp_path / "c48")
    with pytest.raises(ConfigError, match="reduced draft vocabulary"):
        export_drafter.export_drafter(ckpt48, out, "dflash")
    assert not out.exists()
    # the last target layer is read after the final norm by both formats
    last = bench.make_case("qwen3", 0, tmp_path / "last")
    last.drafter.cfg.target_layer_ids = [1, 3, bench.LAYERS - 1]
    with pytest.raises(ConfigError, match="last layer"):
        export_drafter.export_drafter(bench.save_checkpoint(last, tmp_path / "cl"), out, "dflash")


def test_an_unsupported_target_and_a_too_large_vocabulary_are_refused(tmp_path, capsys) -> None:
    import transformers

    case = bench.make_case("qwen3", 0, tmp_path / "q")
    qwen2 = tmp_path / "qwen2"
    transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=bench.V,
            hidden_size=bench.WIDTH,
            intermediate_size=64,
            num_hidden_layers=bench.LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(qwen2)
    ckpt = bench.save_checkpoint(case, tmp_path / "c")
    args = ["export", str(ckpt), "--out", str(tmp_path / "o"), "--format", "speculators"]
    capsys.readouterr()  # the setup's progress bars
    assert main([*args, "--target", str(qwen2)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vltrain: error:") and "'qwen2' model" in err and "\n" not in err
    info, _ = export_drafter.load_target(str(case.target_dir), "", tmp_path / "o")
    info.vocab_size = 40  # a target with fewer tokens than the drafter's draft vocabulary
    case.drafter.cfg.draft_vocab = 48
    with pytest.raises(ConfigError, match=r"draft vocabulary \(48\) is larger than the target"):
        export_drafter.check_convertible(case.drafter, info, "speculators")
    assert not (tmp_path / "o").exists()


def test_an_output_folder_holding_an_export_is_refused_unless_forced(qwen3, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "drafter.json").write_text("{}")  # another export (vltrain's own)
    (out / "config.yaml").write_text("stage: drafter\n")
    (out / "notes.txt").write_text("mine")
    ckpt = bench.save_checkpoint(qwen3, tmp_path / "c")
    with pytest.raises(ConfigError, match="already holds an export"):
        export_drafter.export_drafter(ckpt, out, "speculators")
    assert (out / "drafter.json").read_text() == "{}"
    assert main(["export", str(ckpt), "--out", str(out), "--format", "dflash", "--force"]) == 0
    assert not (out / "drafter.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_a_model_folder_is_never_replaced_even_forced(qwen3, tmp_path, capsys) -> None:
    """--out naming the drafter's own target (an HF model folder: config.json and weights, no
    export of vltrain's) is refused with --force too; it was overwritten (found by a reviewer)."""
    ckpt = bench.save_checkpoint(qwen3, tmp_path / "c")
    target = qwen3.target_dir
    before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    capsys.readouterr()
    for force in ([], ["--force"]):
        args = ["export", str(ckpt), "--out", str(target), "--format", "speculators", *force]
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "no vltrain export" in err and "even with --force" in err and "\n" not in err
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
    out = tmp_path / "spec"  # an export of the formats is one: --force replaces it
    assert main(["export", str(ckpt), "--out", str(out), "--format", "speculators"]) == 0
    assert main(["export", str(ckpt), "--out", str(out), "--format", "dflash", "--force"]) == 0


def test_an_exported_drafter_imports_and_decodes_like_the_original(tmp_path, capsys) -> None:
    """Train a drafter of an HF LM with the stage's default architecture (auto: dflash) and a
    reduced vocabulary, export it, decode with `generate --draft EXPORT`: the same lines and tau
    as `--draft RUN`; the imported drafter's logits equal the original's, and an export with the
    layer offset off by one does not."""
    from tests.stages.drafter_fixtures import TEXTS, tiny_lm
    from vltrain.models.drafter import SharedParts
    from vltrain.models.drafter_checkpoint import load_drafter

    lm = tiny_lm(tmp_path / "lm", layers=6)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "completion": t}) + "\n" for t in TEXTS))
    run = tmp_path / "run"
    from tests.stages.test_drafter_stage import _train_args

    args = _train_args(lm, tmp_path, run, "drafter.draft_vocab=64")  # drafter.arch: auto
    args = [a.replace(f"{tmp_path}/answers.jsonl", str(data)) for a in args]
    args += ["drafter.layer_ids=[1,3]", "drafter.eval_prompts=0"]
    assert main(args) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--format", "speculators"]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS[:4]))
    lines, taus = [], []
    for draft in (run, out):
        stats = tmp_path / f"{draft.name}.json"
        base = ["generate", "--model", str(lm), "--prompts", str(prompts)]
        cmd = [*base, "--max-new-tokens", "16", "--draft", str(draft), "--stats", str(stats)]
        capsys.readouterr()
        assert main(cmd) == 0
        lines.append(capsys.readouterr().out)
        st = json.loads(stats.read_text())
        taus.append((st["tau"], st["row_tau"]))
    assert lines[0] == lines[1] and taus[0] == taus[1]

    original, _ = load_drafter(run)
    assert original.cfg.qk_norm and not original.cfg.learned_mask  # auto: the engines' layers
    imported, target = load_drafter(out)
    assert target["format"] == "speculators" and imported.cfg.draft_vocab == 64
    assert torch.equal(imported.vocab_ids, original.vocab_ids)
    model = export_drafter.load_target(str(lm), "", out)[1]
    head = model.get_output_embeddings()
    parts = SharedParts(model.get_input_embeddings(), head, lambda: (head.weight, None))
    feats = torch.randn(1, 12, len(original.cfg.target_layer_ids) * 32)  # (B, S, F)
    pos, ok = torch.arange(12)[None], torch.ones(1, 12, dtype=torch.bool)
    a_ids, a_pos = torch.tensor([[5, 9]]), torch.tensor([[4, 7]])
    with torch.no_grad():
        want = original.share(parts).logits(original(feats, pos, ok, a_ids, a_pos))
        got = imported.share(parts).logits(imported(feats, pos, ok, a_ids, a_pos))
    assert torch.equal(want, got)
    info, _ = export_drafter.load_target(str(lm), "", tmp_path / "off")
    export_drafter.write_export(original, info, tmp_path / "off", "speculators", layer_offset=0)
    off, _ = load_drafter(tmp_path / "off")
    assert off.cfg.target_layer_ids != original.cfg.target_layer_ids  # the control differs


def test_a_vltrain_drafter_export_travels_with_its_target_and_checks_its_config(
    tmp_path, capsys
) -> None:
    """`vltrain export RUN` (vltrain's format): drafter.json names the target by its path
    relative to the export (or --target-id) with its config hash; moved together, the export
    decodes; a target whose config differs is refused in one line; a re-saved config.json
    (another transformers version) is the same target."""
    import shutil

    from tests.stages.drafter_fixtures import TEXTS, tiny_lm
    from tests.stages.test_drafter_stage import _train_args
    from vltrain.models.drafter_checkpoint import load_drafter

    home = tmp_path / "home"
    lm = tiny_lm(home / "lm", layers=4)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "completion": t}) + "\n" for t in TEXTS))
    run = tmp_path / "run"
    args = _train_args(lm, tmp_path, run, "train.max_steps=2", "drafter.eval_prompts=0")
    args.append("drafter.draft_vocab=100000")  # not below the target's: the whole vocabulary
    capsys.readouterr()
    assert main([a.replace(f"{tmp_path}/answers.jsonl", str(data)) for a in args]) == 0
    notice = "'drafter.draft_vocab' 100000 is not below the target's vocabulary"
    assert notice in capsys.readouterr().err  # said when the run trains ...
    assert main(["export", str(run), "--out", str(home / "export")]) == 0
    assert notice not in capsys.readouterr().err  # ... not again when its checkpoint loads
    target = json.loads((home / "export" / "drafter.json").read_text())["target"]
    cfg = json.loads((lm / "config.json").read_text())
    assert target == {"kind": "hf_lm", "path": "../lm", "config_sha256": config_sha256(cfg)}
    out = tmp_path / "by-id"  # named by its HF id instead of a path
    assert main(["export", str(run), "--out", str(out), "--target-id", "org/tiny-lm"]) == 0
    target = json.loads((out / "drafter.json").read_text())["target"]
    assert target["id"] == "org/tiny-lm" and "path" not in target

    moved = tmp_path / "moved"
    shutil.move(home, moved)
    assert load_drafter(moved / "export")[1]["path"] == str((moved / "lm").resolve())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS[:2]))
    gen = ["generate", "--prompts", str(prompts), "--max-new-tokens", "8"]
    gen += ["--draft", str(moved / "export")]
    capsys.readouterr()
    assert main([*gen, "--model", str(moved / "lm")]) == 0
    resaved = tmp_path / "resaved"
    shutil.copytree(moved / "lm", resaved)
    (resaved / "config.json").write_text(json.dumps({**cfg, "transformers_version": "0.0.1"}))
    assert main([*gen, "--model", str(resaved)]) == 0
    other = tmp_path / "other"
    shutil.copytree(moved / "lm", other)
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    capsys.readouterr()
    assert main([*gen, "--model", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bar
    assert err.startswith("vltrain: error: the drafter") and "another target" in err, err
    assert "config sha256" in err and str(moved / "lm") in err


def test_auto_arch_is_dflash_for_an_hf_lm_target_and_vltrain_for_the_others() -> None:
    """`drafter.arch: auto` (the default) trains what the serving engines load where they can
    load it (an HF causal LM's drafter), vltrain's layers for a captioner's or an HF VLM's; an
    explicit choice stands."""
    from vltrain.config.schema import Config
    from vltrain.models.drafter import drafter_arch

    def arch(kind: str, chosen: str = "") -> str:
        return drafter_arch(chosen or Config().drafter.arch, kind)

    assert Config().drafter.arch == "auto"
    assert arch("hf_lm") == "dflash"
    assert arch("captioner") == arch("hf_vlm") == "vltrain"
    assert arch("hf_lm", "vltrain") == "vltrain" and arch("captioner", "dflash") == "dflash"


def test_the_measured_tau_travels_in_both_formats(qwen3, tmp_path) -> None:
    """A run's measured decoding (what `generate --spec auto` predicts from) is in its
    speculators and DFlash exports and back on import; an export of a run without one has
    none (the message then says a published checkpoint records none)."""
    from vltrain.models.drafter_checkpoint import load_drafter

    ckpt = bench.save_checkpoint(qwen3, tmp_path / "c")
    meta = json.loads((ckpt / "drafter.json").read_text())
    assert "eval" not in meta
    for fmt in ("speculators", "dflash"):
        out = tmp_path / f"bare_{fmt}"
        assert main(["export", str(ckpt), "--out", str(out), "--format", fmt]) == 0
        assert "eval" not in load_drafter(out)[1]
    measured = {"tau_decode": 2.5, "tau_decode_tree": 3.25, "tree_budget": 16}
    (ckpt / "drafter.json").write_text(json.dumps({**meta, "eval": measured}))
    for fmt in ("speculators", "dflash"):
        out = tmp_path / fmt
        assert main(["export", str(ckpt), "--out", str(out), "--format", fmt]) == 0
        assert load_drafter(out)[1]["eval"] == measured
