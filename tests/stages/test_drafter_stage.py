"""The drafter stage end to end on a tiny random HF Llama: regenerate -> train -> generate.

Also: training-time tau equals the decoding loop's tau on the same blocks; the loss mask
covers exactly the target's answer after the chat template; the hidden-state taps are block
outputs; the configured gamma reaches the loss; non-target labels are flagged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import hardlink_tree
from tests.stages.drafter_fixtures import TEXTS, tiny_lm
from vltrain.cli import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    return tiny_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def answers(lm, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    args = [
        "data",
        "regenerate",
        "--model",
        str(lm),
        "--data",
        str(d / "prompts.jsonl"),
        "--out",
        str(d / "answers.jsonl"),
        "--max-new-tokens",
        "24",
        "--batch-size",
        "4",
    ]
    assert main(args) == 0
    assert main(args) == 0  # resumed: nothing new
    assert len((d / "answers.jsonl").read_text().splitlines()) == len(TEXTS)
    return d


def _train_args(lm, answers, out, *extra) -> list[str]:
    from tests.config.test_config import PRESETS

    preset = next(p for p in PRESETS if p.name == "drafter_smollm2.yaml")
    return [
        "train",
        str(preset),
        f"run.out_dir={out}",
        f"model.target={lm}",
        f"data.train={answers}/answers.jsonl",
        f"data.eval={answers}/answers.jsonl",
        "data.batch_size=4",
        "train.max_steps=6",
        "train.eval_every=0",
        "train.save_every=0",
        "optim.warmup_steps=1",
        "log.progress=false",
        "log.tensorboard=false",
        "drafter.block_size=4",
        "drafter.eval_prompts=4",
        "drafter.eval_max_new_tokens=16",
        "data.length_buckets=0",
        *extra,
    ]


def _train(lm, answers, out, *extra) -> dict:
    assert main(_train_args(lm, answers, out, *extra)) == 0
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(rows) if "eval_tau" in r)


@pytest.fixture(scope="module")
def trained(lm, answers, tmp_path_factory) -> tuple[Path, dict]:
    """One short drafter run shared by the tests below (6 steps, lr 3e-3)."""
    run = tmp_path_factory.mktemp("drafter") / "run"
    return run, _train(lm, answers, run, "optim.lr=3e-3")


def test_regenerate_device_flag(lm, answers, monkeypatch) -> None:
    """`--device cpu` answers exactly as `auto` does on a machine without CUDA; `auto` picks
    cuda:LOCAL_RANK only when CUDA is available."""
    from vltrain.engine.runtime import resolve_device

    out = answers / "answers_cpu.jsonl"
    args = ["data", "regenerate", "--model", str(lm), "--data", str(answers / "prompts.jsonl")]
    args += ["--out", str(out), "--max-new-tokens", "24", "--batch-size", "4", "--device", "cpu"]
    assert main(args) == 0
    assert out.read_text() == (answers / "answers.jsonl").read_text()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)


def test_regenerate_resumed_after_a_kill_writes_what_an_uninterrupted_run_does(
    lm, answers, tmp_path
) -> None:
    """Sampled answers: a kill that left one batch and part of the next in the output, then a
    resume, writes every answer the uninterrupted run does (the cut batch is decoded whole
    again: its rows' draws are the batch's)."""
    args = ["data", "regenerate", "--model", str(lm), "--data", str(answers / "prompts.jsonl")]
    args += ["--max-new-tokens", "12", "--batch-size", "4", "--strategy", "sample", "--seed", "3"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, "--out", str(whole)]) == 0
    lines = whole.read_text().splitlines()
    assert len(lines) == len(TEXTS) > 6
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # the kill: a line half written
    assert main([*args, "--out", str(cut)]) == 0

    def answers_by_id(path: Path) -> dict:
        rows = []
        for x in path.read_text().splitlines():
            try:
                rows.append(json.loads(x))
            except json.JSONDecodeError:
                continue  # the half line
        return {r["id"]: r["completion_ids"] for r in rows}

    assert answers_by_id(cut) == answers_by_id(whole)
    greedy = answers_by_id(answers / "answers.jsonl")
    assert any(greedy[k][:12] != v for k, v in answers_by_id(whole).items())  # it did sample


def test_regenerate_with_hf_modules_writes_the_same_answers(lm, answers, tmp_path) -> None:
    """The default (native) forward and HF's modules answer every prompt with the same ids."""
    out = tmp_path / "hf.jsonl"
    args = ["data", "regenerate", "--model", str(lm), "--data", str(answers / "prompts.jsonl")]
    args += ["--out", str(out), "--max-new-tokens", "24", "--batch-size", "4", "--forward", "hf"]
    assert main(args) == 0

    def ids(path: Path) -> dict:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return {r["id"]: r["completion_ids"] for r in rows}

    assert ids(out) == ids(answers / "answers.jsonl")


def test_train_and_generate_with_the_drafter(lm, answers, trained, tmp_path, capsys) -> None:
    run, m = trained
    for key in (
        "eval_tau",
        "eval_tau_target",
        "eval_tau_marginal",
        "eval_tau_decode",
        "eval_top4",
        "eval_streak8",
        "eval_acc_1",
        "eval_label_agreement",
    ):
        assert key in m
    assert m["eval_label_agreement"] > 0.95 and m["eval_labels_not_target"] == 0.0
    prompts = answers / "prompts.jsonl"
    capsys.readouterr()
    assert (
        main(["generate", "--model", str(lm), "--prompts", str(prompts), "--max-new-tokens", "16"])
        == 0
    )
    plain = capsys.readouterr().out
    stats = tmp_path / "stats.json"
    for budget in ("0", "6"):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(lm),
                    "--prompts",
                    str(prompts),
                    "--max-new-tokens",
                    "16",
                    "--draft",
                    str(run),
                    "--tree-budget",
                    budget,
                    "--spec",
                    "tree" if int(budget) else "chain",
                    "--stats",
                    str(stats),
                ]
            )
            == 0
        )
        assert capsys.readouterr().out == plain  # lossless, line for line
        assert json.loads(stats.read_text())["tau"] >= 1.0
    # the default forward of this Llama is the native one; HF's modules give the same lines
    base = ["generate", "--model", str(lm), "--prompts", str(prompts), "--max-new-tokens", "16"]
    assert main([*base, "--forward", "hf"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*base, "--forward", "hf", "--draft", str(run), "--tree-budget", "6"]) == 0
    assert capsys.readouterr().out == plain
    best = ["--draft", str(run), "--tree-budget", "6", "--tree-shape", "best-first"]
    assert main([*base, *best]) == 0
    assert capsys.readouterr().out == plain


def test_training_tau_equals_decoding_tau_on_the_same_blocks(lm, trained) -> None:
    from vltrain.inference.hf_target import HFTarget, load_hf_causal_lm
    from vltrain.inference.speculative import speculative_generate
    from vltrain.models.drafter_checkpoint import load_drafter
    from vltrain.objectives.drafter import block_labels, block_metrics
    from vltrain.tools.speculate import attach

    model, tok = load_hf_causal_lm(lm)
    drafter, _ = load_drafter(trained[0])
    target = HFTarget(model, drafter.cfg.target_layer_ids)
    attach(drafter, target)
    from vltrain.data.draft_data import chat_prompt_ids

    for prompt in TEXTS[:4]:
        ids = torch.tensor([chat_prompt_ids(tok, prompt)])
        rows, stats = speculative_generate(target, drafter, {"input_ids": ids}, 24)
        full = torch.cat([ids, torch.tensor([rows[0]])], 1)
        ctx, tlogits, _ = target.features(full, torch.ones_like(full))
        greedy = torch.cat([torch.full((1, 1), -100), tlogits.argmax(-1)[:, :-1]], 1)
        anchors = torch.tensor([stats.anchors[0]])
        k = drafter.cfg.block_size
        keep = anchors + k <= full.shape[1]  # blocks whose labels lie inside the output
        a = anchors[keep][None]
        lab, ok = block_labels(greedy, a, torch.ones_like(a, dtype=torch.bool), k)
        with torch.no_grad():
            h = drafter(ctx.features, ctx.positions, ctx.valid, full.gather(1, a), a)
            m = block_metrics(drafter.logits(h), lab, ok)
        want = [acc for acc, kept in zip(stats.accepted[0], keep[0].tolist(), strict=True) if kept]
        assert float(m["accept"]) == sum(want) and float(m["blocks"]) == len(want)


def test_decoding_tau_in_training_runs_native_and_equals_hf_decoding(
    lm, answers, tmp_path, monkeypatch
) -> None:
    """The eval's tau_decode (chain and tree) decodes through the native forward, as
    `vltrain generate` does, and equals decoding the same prompts through HF's modules with
    the saved drafter."""
    from vltrain.data.draft_data import chat_prompt_ids
    from vltrain.inference.captioning import left_pad
    from vltrain.inference.hf_target import HFTarget, load_hf_causal_lm
    from vltrain.inference.native_llama import NativeTarget
    from vltrain.inference.speculative import speculative_generate
    from vltrain.models.drafter_checkpoint import load_drafter
    from vltrain.tools.speculate import attach

    verifies, released = [], []
    real, real_release = NativeTarget.verify, NativeTarget.release
    monkeypatch.setattr(
        NativeTarget, "verify", lambda self, *a, **k: verifies.append(self) or real(self, *a, **k)
    )
    monkeypatch.setattr(
        NativeTarget,
        "release",
        lambda self: released.append(len(self.native.packed._packs)) or real_release(self),
    )
    run = tmp_path / "run"
    m = _train(lm, answers, run, "optim.lr=3e-3", "drafter.eval_tree_budget=5")
    assert verifies, "the eval decoded through HF's modules, not the native forward"
    # the verify's packed weight copies do not outlive an eval (one per row count)
    assert released and (max(released) > 0 or not torch.backends.mkl.is_available())
    assert all(not t.native.packed._packs for t in verifies)
    model, tok = load_hf_causal_lm(lm)
    drafter, _ = load_drafter(run)
    target = HFTarget(model, drafter.cfg.target_layer_ids)
    attach(drafter, target)
    records = [json.loads(x) for x in (answers / "answers.jsonl").read_text().splitlines()]
    ids, mask = left_pad(
        [chat_prompt_ids(tok, r["prompt"]) for r in records[:4]], target.pad_token_id
    )
    for name, budget in (("", 0), ("_tree", 5)):
        _, stats = speculative_generate(
            target, drafter, {"input_ids": ids, "attention_mask": mask}, 16, tree_budget=budget
        )
        tau = sum(map(sum, stats.accepted)) / stats.rounds
        assert m[f"eval_tau_decode{name}"] == pytest.approx(tau, abs=1e-9), name
        assert m[f"eval_kept_decode{name}"] == pytest.approx(stats.tokens_per_round, abs=1e-9)


def test_loss_mask_matches_the_chat_template(lm) -> None:
    from transformers import AutoTokenizer

    from vltrain.data import draft_data

    tok = AutoTokenizer.from_pretrained(lm)
    comp = tok("one two three", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def check(example) -> None:
        ids, labels = example(tok, "count to five", comp)
        sup = [i for i, lab in zip(ids, labels, strict=True) if lab != -100]
        assert sup == comp
        text = tok.decode(ids[: len(ids) - len(comp)])
        assert text.endswith("<|im_start|>assistant\n")

    check(draft_data.chat_example)

    def misaligned(tok, prompt, comp):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False)
        p = tok(text, add_special_tokens=False)["input_ids"]
        full = draft_data.chat_prompt_ids(tok, prompt) + comp
        return full, [-100] * len(p) + full[len(p) :]

    with pytest.raises(AssertionError):
        check(misaligned)


def test_features_are_block_outputs(lm) -> None:
    from vltrain.inference.hf_target import HFTarget, load_hf_causal_lm

    model, _ = load_hf_causal_lm(lm)
    seen = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, n=n: seen.__setitem__(n, o[0] if isinstance(o, tuple) else o)
        )
        for n, layer in enumerate(model.model.layers)
    ]
    ids = torch.tensor([[1, 5, 9, 12, 7]])

    def check(target) -> None:
        ctx, _, _ = target.features(ids, torch.ones_like(ids))
        want = torch.cat([seen[i] for i in target.layer_ids], -1)
        torch.testing.assert_close(ctx.features, want, atol=1e-5, rtol=0)

    check(HFTarget(model, [1, 2]))
    # the last block (3 of 4): HF's last hidden state has the final norm applied, so the
    # target reads the block's own output, in training features, prefill and verify alike
    last = HFTarget(model, [1, 3])
    check(last)
    _, cache, ctx = last.prefill(ids)
    torch.testing.assert_close(ctx.features, torch.cat([seen[1], seen[3]], -1), atol=1e-5, rtol=0)
    _, _, ctx = last.verify(torch.tensor([[4, 6, 8]]), torch.tensor([[-1, 0, 0]]), cache)
    torch.testing.assert_close(ctx.features, torch.cat([seen[1], seen[3]], -1), atol=1e-5, rtol=0)
    # the hook lives for one of the target's forwards: none left on the model (only this
    # test's own), and a forward of the model by someone else leaves nothing in the target
    left = model.model.layers[3]._forward_hooks.values()
    assert not [h for h in left if getattr(h, "__self__", None) is last]
    model(input_ids=ids)
    assert last._last is None
    normed = HFTarget(model, [1, 3])
    normed.reads_last = False  # what it read before: hidden_states[-1]
    with pytest.raises(AssertionError):
        check(normed)
    buggy = HFTarget(model, [1, 2])
    import vltrain.inference.hf_target as T

    orig = T._concat
    T._concat = lambda taps, ids_, offset: orig(taps, ids_, 0)  # hidden_states[i]: off by one
    try:
        with pytest.raises(AssertionError):
            check(buggy)
    finally:
        T._concat = orig
    for h in hooks:
        h.remove()


def test_configured_gamma_reaches_the_loss(lm, tmp_path) -> None:
    from tests.config.test_config import PRESETS
    from tests.stages.test_shipped_presets import build_preset_model
    from vltrain.config import load_config

    preset = next(p for p in PRESETS if p.name == "drafter_smollm2.yaml")

    def gamma_used(extra: list[str], build=build_preset_model) -> float:
        cfg = load_config(preset, [f"model.target={lm}", *extra])
        w = build(cfg, tmp_path).weights
        return float(-1.0 / torch.log(w[2] / w[1]))

    assert abs(gamma_used(["drafter.block_size=16"]) - 7.0) < 1e-4
    assert abs(gamma_used(["drafter.block_size=8"]) - 4.0) < 1e-4
    assert abs(gamma_used(["drafter.block_size=16", "drafter.gamma=10"]) - 10.0) < 1e-4

    def hard_coded(cfg, out):
        from vltrain.objectives.drafter import position_weights

        model = build_preset_model(cfg, out)
        model.weights = position_weights(cfg.drafter.block_size, 4.0)
        return model

    with pytest.raises(AssertionError):
        assert abs(gamma_used(["drafter.block_size=16"], hard_coded) - 7.0) < 1e-4


def test_labels_that_are_not_the_target_are_flagged(lm, answers, tmp_path, capsys) -> None:
    bad = tmp_path / "data"
    bad.mkdir()
    rows = [json.loads(x) for x in (answers / "answers.jsonl").read_text().splitlines()]
    for r in rows:  # dataset text instead of the target's answers
        r["completion_ids"] = list(reversed(r["completion_ids"]))
    (bad / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = _train(lm, bad, tmp_path / "run")
    assert m["eval_labels_not_target"] == 1.0 and m["eval_label_agreement"] < 0.5
    assert "not deployment tau" in capsys.readouterr().err


from tests.stages.test_shipped_presets import caption_run  # noqa: E402, F401  (a fixture)


def test_a_reduced_draft_vocabulary_trains_saves_and_decodes_losslessly(
    lm,
    answers,
    tmp_path,
    capsys,
) -> None:
    """``drafter.draft_vocab``: the ids are the most frequent answer tokens (EOS kept), saved
    in the checkpoint; eval reports the coverage; `generate --draft` prints the plain lines."""
    from vltrain.models.drafter_checkpoint import load_drafter

    run = tmp_path / "run"
    m = _train(lm, answers, run, "optim.lr=3e-3", "drafter.draft_vocab=24")
    assert "draft vocabulary of 24" in capsys.readouterr().err
    recs = [json.loads(x) for x in (answers / "answers.jsonl").read_text().splitlines()]
    counts = torch.bincount(
        torch.tensor([t for r in recs for t in r["completion_ids"]]), minlength=400
    )
    drafter, _ = load_drafter(run)
    ids = drafter.vocab_ids.tolist()
    assert len(ids) == 24 and drafter.cfg.draft_vocab == 24
    eos = int(json.loads((Path(lm) / "config.json").read_text())["eos_token_id"])
    assert eos in ids
    # every kept token is at least as frequent as every dropped one (EOS aside)
    dropped = [t for t in range(len(counts)) if t not in ids]
    assert min(int(counts[t]) for t in ids if t != eos) >= max(int(counts[t]) for t in dropped)
    kept = float(counts[ids].sum() / counts.sum())
    # eval = the training answers: the share of slot labels inside ~ the share of tokens
    assert kept < 1 and m["eval_vocab_coverage"] < 1
    assert abs(m["eval_vocab_coverage"] - kept) < 0.05, (m["eval_vocab_coverage"], kept)
    # loading the trained run needs no training data: the ids come from the checkpoint
    from vltrain.tools.loading import load_trained

    _, _, model = load_trained(run, [f"data.train={tmp_path}/absent.jsonl"])
    assert model.drafter.vocab_ids.tolist() == ids
    prompts = answers / "prompts.jsonl"
    base = ["generate", "--model", str(lm), "--prompts", str(prompts), "--max-new-tokens", "16"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    for budget in ("0", "6"):
        assert main([*base, "--draft", str(run), "--tree-budget", budget]) == 0
        assert capsys.readouterr().out == plain


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_captioner_drafter_end_to_end(
    caption_run,  # noqa: F811
    shapes_dir,
    tmp_path,
    capsys,
    draft_vocab: int,
) -> None:
    from tests.config.test_config import PRESETS

    data = tmp_path / "data"
    data.mkdir()
    hardlink_tree(shapes_dir / "images", data / "images")
    lines = (shapes_dir / "train.jsonl").read_text().splitlines()[:24]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    assert (
        main(
            [
                "data",
                "regenerate",
                "--checkpoint",
                str(caption_run),
                "--data",
                str(data / "train.jsonl"),
                "--out",
                str(data / "regen.jsonl"),
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    assert len((data / "regen.jsonl").read_text().splitlines()) == 24
    preset = next(p for p in PRESETS if p.name == "drafter.yaml")
    run = tmp_path / "drafter"
    over = [
        f"run.out_dir={run}",
        f"model.target={caption_run}",
        f"data.train={data}/regen.jsonl",
        f"data.eval={data}/regen.jsonl",
        "data.batch_size=8",
        "train.max_steps=3",
        "train.eval_every=0",
        "train.save_every=0",
        "optim.warmup_steps=1",
        "log.progress=false",
        "log.tensorboard=false",
        "drafter.block_size=4",
        "drafter.eval_prompts=4",
        "drafter.eval_max_new_tokens=8",
        "drafter.eval_tree_budget=6",
        "data.length_buckets=0",
        f"drafter.draft_vocab={draft_vocab}",
    ]
    assert main(["train", str(preset), *over]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in reversed(rows) if "eval_tau" in r)
    # captions re-tokenized from text get an <eos> where the barely trained target hit the
    # length limit instead: a few labels differ from its greedy tokens (reported, not hidden)
    assert m["eval_label_agreement"] > 0.85 and "eval_tau_decode_tree" in m
    images = [str(shapes_dir / json.loads(x)["image"]) for x in lines[:5]]
    capsys.readouterr()
    base = [
        "generate",
        "--checkpoint",
        str(caption_run),
        "--images",
        *images,
        "--max-new-tokens",
        "12",
        "--batch-size",
        "3",
    ]
    assert main(base) == 0
    plain = capsys.readouterr().out
    for budget in ("0", "6"):
        assert main([*base, "--draft", str(run), "--tree-budget", budget]) == 0
        got = capsys.readouterr()
        assert got.out == plain  # the same JSON lines, batched
        assert json.loads(got.err.strip().splitlines()[-1])["rounds"] > 0
    # the default export of a captioner's drafter (it once failed on the drafter checkpoint's
    # absent tokenizer/: the tokenizer is the target's) decodes as the run does
    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    assert (export / "drafter.json").is_file() and not (export / "tokenizer").exists()
    capsys.readouterr()
    assert main([*base, "--draft", str(export), "--tree-budget", "6"]) == 0
    assert capsys.readouterr().out == plain
    # the engines' formats describe drafters of HF causal LMs: refused, nothing written
    for fmt in ("speculators", "dflash"):
        assert main(["export", str(run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("vltrain: error:") and "captioner" in err, err
        assert len(err.splitlines()) == 1 and not (tmp_path / fmt).exists()


def _draft_batch(lm, answers, n: int = 4):
    """(target, a right-padded batch of the first n answers, its records' true lengths)."""
    from vltrain.data.draft_data import ChatRecords, DraftCollate, DraftDataset
    from vltrain.inference.hf_target import HFTarget, load_hf_causal_lm

    model, tok = load_hf_causal_lm(lm)
    target = HFTarget(model, [0, 1])
    data = DraftDataset(ChatRecords(str(answers / "answers.jsonl"), tok, 256), 8, 0)
    samples = [data[(0, 0, i)] for i in range(n)]
    return target, DraftCollate(target.pad_token_id)(samples)


def test_cached_target_features_equal_the_online_ones(lm, answers) -> None:
    from vltrain.inference.feature_cache import FeatureCache, greedy_tokens

    target, batch = _draft_batch(lm, answers)
    mask = batch["attention_mask"].bool()
    assert (~mask).any(), "the batch must hold padded rows for this test to mean anything"
    ctx, logits, _ = target.features(batch["input_ids"], batch["attention_mask"])
    cache = FeatureCache(target)
    cctx, greedy, p, top = cache.features(batch)
    assert p == 0 and top is None and cache.computed == len(batch["index"])
    torch.testing.assert_close(cctx.features[mask], ctx.features[mask], atol=1e-5, rtol=0)
    assert torch.equal(cctx.valid, ctx.valid) and torch.equal(
        cctx.positions[mask], ctx.positions[mask]
    )
    assert torch.equal(greedy, greedy_tokens(logits, mask))
    assert (greedy[~mask] == -100).all() and (cctx.features[~mask] == 0).all()
    # a later epoch: same records, reordered, assembled from memory without a forward
    order = torch.tensor([2, 0, 3, 1])
    again = {k: v[order] for k, v in batch.items()}
    actx, agreedy, _, _ = cache.features(again)
    assert cache.computed == 4 and torch.equal(actx.features, cctx.features[order])
    assert torch.equal(agreedy, greedy[order])
    # a record that trains on other content in another epoch (a captioner record drawing
    # another caption) keeps its index: the cache is keyed by content, so it gets the new
    # content's features, not its first epoch's (keyed by index it got stale ones)
    swapped = {k: (v if k != "index" else batch["index"]) for k, v in again.items()}
    sctx, sgreedy, _, _ = cache.features(swapped)
    assert cache.computed == 4 and torch.equal(sctx.features, cctx.features[order])
    assert torch.equal(sgreedy, greedy[order])
    stale = {k: v for k, v in zip(batch["index"].tolist(), cctx.features, strict=True)}
    by_index = torch.stack([stale[k] for k in swapped["index"].tolist()])
    assert not torch.allclose(by_index, sctx.features)  # what an index-keyed cache returned


def test_features_on_disk_are_read_back_by_a_later_run(lm, answers, tmp_path) -> None:
    from vltrain.inference.feature_cache import FeatureCache, target_fingerprint
    from vltrain.inference.hf_target import HFTarget

    target, batch = _draft_batch(lm, answers)
    first = FeatureCache(target, tmp_path)
    ctx, greedy, _, _ = first.features(batch)
    assert (first.computed, first.loaded) == (4, 0)
    assert not first.rows  # with a store nothing stays in memory: the next batch reads it back
    again, _, _, _ = first.features(batch)
    assert (first.computed, first.loaded) == (4, 4) and torch.equal(again.features, ctx.features)
    (folder,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(list(folder.glob("*.safetensors"))) == 4
    assert json.loads((folder / "target.json").read_text())["layers"] == [0, 1]
    later = FeatureCache(target, tmp_path)  # a later run: reads, runs no target forward
    lctx, lgreedy, _, _ = later.features(batch)
    assert (later.computed, later.loaded) == (0, 4)
    assert torch.equal(lctx.features, ctx.features) and torch.equal(lgreedy, greedy)
    assert torch.equal(lctx.positions, ctx.positions) and torch.equal(lctx.valid, ctx.valid)
    # other layers or other weights: another folder, features computed again, never mixed
    other = FeatureCache(HFTarget(target.model, [1]), tmp_path)
    other.features(batch)
    assert other.computed == 4 and other.store != first.store
    fp = target_fingerprint(target)
    with torch.no_grad():
        next(target.model.parameters()).view(-1)[0] += 1e-3
    try:
        assert target_fingerprint(target) != fp
        moved = FeatureCache(target, tmp_path)
        moved.features(batch)
        assert moved.computed == 4 and moved.loaded == 0
    finally:
        with torch.no_grad():
            next(target.model.parameters()).view(-1)[0] -= 1e-3
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave nothing behind


def test_soft_labels_are_the_targets_distribution_before_each_slot(lm, answers) -> None:
    """Slot k of an anchor gets the target's distribution read after token anchor + k - 1 (its
    argmax is the target's greedy token at the slot, exactly); its top-k (online or cached)
    is that distribution cut to k tokens and renormalised, and k = V gives it back whole."""
    from vltrain.inference.feature_cache import FeatureCache, greedy_tokens, top_logprobs
    from vltrain.objectives.drafter import block_labels, block_soft_labels

    target, batch = _draft_batch(lm, answers)
    mask, anchors = batch["attention_mask"], batch["anchors"]
    valid, block, vocab = batch["anchor_valid"], 6, target.vocab_size
    _, logits, p = target.features(batch["input_ids"], mask)
    assert p == 0
    greedy = greedy_tokens(logits, mask)
    shifted = torch.cat([torch.full_like(greedy[:, :1], -100), greedy[:, :-1]], 1)
    lab, ok = block_labels(shifted, anchors, valid, block)
    assert ok.sum() > 40
    full = block_soft_labels(logits, anchors, block)
    assert full.shape[-1] == vocab
    assert torch.allclose(full.sum(-1), torch.ones(()), atol=1e-5)
    assert torch.equal(full.argmax(-1)[ok], lab[ok])
    late = block_soft_labels(logits, anchors + 1, block)  # one position late: the bug
    assert (late.argmax(-1)[ok] != lab[ok]).float().mean() > 0.5

    def dense(sparse):
        ids, probs = sparse
        return probs.new_zeros(*ids.shape[:-1], vocab).scatter_(-1, ids, probs)

    whole = dense(block_soft_labels(top_logprobs(logits, mask, vocab), anchors, block))
    torch.testing.assert_close(whole[ok], full[ok], atol=1e-6, rtol=0)  # (padding: id 0)
    five = dense(block_soft_labels(top_logprobs(logits, mask, 5), anchors, block))
    assert ((five[ok] > 0).sum(-1) == 5).all()
    cut = full.topk(5, -1)
    torch.testing.assert_close(
        five.gather(-1, cut.indices)[ok],
        (cut.values / cut.values.sum(-1, keepdim=True))[ok],
        atol=1e-5,
        rtol=0,
    )
    # the cache keeps, per sequence computed alone, what the padded batch's logits give
    _, _, _, top = FeatureCache(target, top_k=5).features(batch)
    real = mask.bool()
    want = top_logprobs(logits, mask, 5)
    assert torch.equal(top.ids[real], want.ids[real])
    torch.testing.assert_close(top.logp[real], want.logp[real], atol=1e-5, rtol=0)
    assert (top.ids[~real] == 0).all() and (top.logp[~real] == 0).all()


def test_a_store_gains_soft_labels_when_a_run_asks_for_them(lm, answers, tmp_path) -> None:
    """Rows stored without top-k log-probabilities are computed again and rewritten with them
    the first time a run asks; a run asking for fewer than stored cuts them, more recomputes."""
    from safetensors.torch import load_file, save_file

    from vltrain.inference.feature_cache import FeatureCache

    target, batch = _draft_batch(lm, answers)
    plain = FeatureCache(target, tmp_path)
    ctx, greedy, _, none = plain.features(batch)
    assert none is None and plain.computed == 4
    # row 0's stored features differ from what the target computes now (as when another
    # device or thread count wrote them): adding soft labels must keep what runs have read
    row0 = plain.store / f"{FeatureCache.key(batch, 0)}.safetensors"
    stored = load_file(str(row0))
    save_file({**stored, "features": stored["features"] + 1.0}, str(row0))
    five = FeatureCache(target, tmp_path, top_k=5)
    fctx, fgreedy, _, top5 = five.features(batch)
    assert (five.computed, five.loaded) == (4, 0)  # no soft labels on disk: computed again
    assert torch.equal(fctx.features[1:], ctx.features[1:]) and torch.equal(fgreedy, greedy)
    n0 = len(stored["features"])
    assert torch.equal(fctx.features[0, :n0], ctx.features[0, :n0] + 1.0)  # kept, not replaced
    ctx.features[0, :n0] += 1.0  # what the store holds from now on
    three = FeatureCache(target, tmp_path, top_k=3)
    _, _, _, top3 = three.features(batch)
    assert (three.computed, three.loaded) == (0, 4)
    assert torch.equal(top3.ids, top5.ids[..., :3]) and torch.equal(top3.logp, top5.logp[..., :3])
    again = FeatureCache(target, tmp_path)  # a run without soft labels reads the same rows
    actx, _, _, _ = again.features(batch)
    assert (again.computed, again.loaded) == (0, 4) and torch.equal(actx.features, ctx.features)
    more = FeatureCache(target, tmp_path, top_k=8)
    _, _, _, top8 = more.features(batch)
    assert (more.computed, more.loaded) == (4, 0) and top8.ids.shape[-1] == 8
    assert torch.equal(top8.ids[..., :5], top5.ids)
    assert not list(tmp_path.rglob("*.tmp"))


def test_soft_labels_on_cached_features_train_like_online_ones(lm, answers, tmp_path) -> None:
    """drafter.soft_labels on features from the disk store trains like soft labels from the
    target's logits in every step: with soft_top_k covering the tiny vocabulary, like the whole
    distribution; cut to 5 tokens, like the same cut online."""
    soft = ("train.log_every=1", "drafter.soft_labels=true")
    store = f"drafter.cache_dir={tmp_path}/store"
    runs = {
        "whole": _train(lm, answers, tmp_path / "whole", *soft),
        "top": _train(lm, answers, tmp_path / "top", *soft, "drafter.soft_top_k=1024"),
        "cached": _train(lm, answers, tmp_path / "cached", *soft, "drafter.soft_top_k=1024", store),
        "five": _train(lm, answers, tmp_path / "five", *soft, "drafter.soft_top_k=5"),
        "five_cached": _train(
            lm, answers, tmp_path / "five_cached", *soft, "drafter.soft_top_k=5", store
        ),
        "hard": _train(lm, answers, tmp_path / "hard", "train.log_every=1"),
    }

    def losses(run: str) -> list[float]:
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r and "eval_tau" not in r]

    for a, b in (("whole", "top"), ("whole", "cached"), ("five", "five_cached")):
        la, lb = losses(a), losses(b)
        assert (
            len(la) == len(lb) == 6 and max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4
        )
        for key in ("eval_loss", "eval_tau"):
            assert abs(runs[a][key] - runs[b][key]) < 1e-4, (a, b, key)
    # each does change the loss: the cut from the whole distribution, soft labels from hard ones
    assert abs(runs["whole"]["eval_loss"] - runs["five"]["eval_loss"]) > 1e-3
    assert abs(runs["whole"]["eval_loss"] - runs["hard"]["eval_loss"]) > 1e-3


def test_a_run_on_cached_features_from_disk_trains_like_one_that_computed_them(
    lm,
    answers,
    tmp_path,
    monkeypatch,
) -> None:
    from vltrain.inference.feature_cache import FeatureCache

    store = tmp_path / "features"
    memory = _train(lm, answers, tmp_path / "memory", "drafter.cache_target=true")
    writes = _train(lm, answers, tmp_path / "writes", f"drafter.cache_dir={store}")
    assert len(list(store.rglob("*.safetensors"))) == len(TEXTS)

    def no_forward(self, batch, i):
        raise AssertionError("the target ran although its features were on disk")

    monkeypatch.setattr(FeatureCache, "_compute", no_forward)
    reads = _train(lm, answers, tmp_path / "reads", f"drafter.cache_dir={store}")
    for key in ("eval_loss", "eval_tau", "eval_tau_target", "eval_label_agreement"):
        assert memory[key] == writes[key] == reads[key], key


def test_cached_features_train_like_online_ones(lm, answers, tmp_path) -> None:
    """Same run with and without drafter.cache_target: the same losses (to float noise)."""
    online = _train(lm, answers, tmp_path / "online", "train.log_every=1")
    cached = _train(
        lm, answers, tmp_path / "cached", "train.log_every=1", "drafter.cache_target=true"
    )
    for key in ("eval_loss", "eval_tau", "eval_tau_target", "eval_label_agreement"):
        assert abs(online[key] - cached[key]) < 1e-4, key

    def losses(run: Path) -> list[float]:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r and "eval_tau" not in r]

    a, b = losses(tmp_path / "online"), losses(tmp_path / "cached")
    assert len(a) == 6 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_a_run_killed_mid_first_epoch_resumes_on_its_half_filled_store_exactly(
    lm,
    answers,
    tmp_path,
    monkeypatch,
) -> None:
    """Killed after step 3 (checkpoint at 2), while its on-disk feature store holds only the
    rows met so far; resumed, it reads the rows the killed run wrote, computes the rest, and
    ends with the losses, eval and weights of the run that was never interrupted."""
    from safetensors.torch import load_file

    from vltrain.engine import loop

    over = ("data.batch_size=2", "train.max_steps=7", "train.save_every=2", "train.log_every=1")

    def losses(run: Path) -> dict[int, float]:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r and "eval_tau" not in r}

    full = _train(lm, answers, tmp_path / "full", f"drafter.cache_dir={tmp_path}/a", *over)
    store = tmp_path / "b"
    real = loop.Trainer._maybe_eval_and_save

    def killed_after_3(self, model, logger):
        real(self, model, logger)
        if self.state.step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", killed_after_3)
    # Ctrl-C: the CLI's exit code for an interrupt
    assert (
        main(_train_args(lm, answers, tmp_path / "part", f"drafter.cache_dir={store}", *over))
        == 130
    )
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    kept = len(list(store.rglob("*.safetensors")))
    assert 0 < kept < len(TEXTS)  # the store was half filled when the run died
    from vltrain.inference.feature_cache import FeatureCache

    read, row = [], FeatureCache._row

    def counted(self, *a):
        read.append(self)
        return row(self, *a)

    monkeypatch.setattr(FeatureCache, "_row", counted)
    part = _train(
        lm, answers, tmp_path / "part", f"drafter.cache_dir={store}", *over, "train.resume=true"
    )
    assert max(c.loaded for c in read) > 0  # it read rows the killed run had written
    assert len(list(store.rglob("*.safetensors"))) == len(TEXTS)
    assert losses(tmp_path / "full") == losses(tmp_path / "part")
    assert len(losses(tmp_path / "full")) == 7
    for key in ("eval_loss", "eval_tau", "eval_tau_decode"):
        assert full[key] == part[key], key
    a = load_file(str(tmp_path / "full" / "checkpoints" / "step_7" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "checkpoints" / "step_7" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cached_soft_labels_need_soft_top_k(lm) -> None:
    from tests.config.test_config import PRESETS
    from vltrain.config import load_config
    from vltrain.config.core import ConfigError
    from vltrain.stages import STAGES

    preset = next(p for p in PRESETS if p.name == "drafter_smollm2.yaml")

    def check(*over: str) -> None:
        STAGES["drafter"].check_config(load_config(preset, [f"model.target={lm}", *over]))

    check("drafter.cache_target=true")
    check("drafter.cache_dir=feats", "drafter.soft_labels=true", "drafter.soft_top_k=32")
    with pytest.raises(ConfigError, match="set 'drafter.soft_top_k'"):
        check("drafter.cache_target=true", "drafter.soft_labels=true")
    with pytest.raises(ConfigError, match="cache_dir' \\(it implies cache_target"):
        check("drafter.cache_dir=feats", "drafter.soft_labels=true")
    with pytest.raises(ConfigError, match="'drafter.soft_labels' is off"):
        check("drafter.soft_top_k=32")
    with pytest.raises(ConfigError, match="keep it <= 1024"):
        check("drafter.cache_target=true", "drafter.soft_labels=true", "drafter.soft_top_k=5000")
    check("drafter.soft_labels=true", "drafter.soft_top_k=5000")  # online: no store to fill
