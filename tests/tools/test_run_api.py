"""`load_run`: embeddings equal to what `vltrain eval` and `vltrain mine` compute for the same
run, unit norm, in input order; captions equal to `vltrain generate`'s; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import hardlink_tree, tiny_overrides
from tests.models.test_hf_embedders import clip_dir, qwen2vl_dir  # noqa: F401
from tests.stages.test_caption_stage import caption_overrides
from vltrain import ConfigError, TrainedRun, evaluate_retrieval, load_run
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.data.readers import read_jsonl
from vltrain.eval.corpus import read_split_dir
from vltrain.runs import train
from vltrain.tools.eval import eval_command
from vltrain.tools.loading import load_trained
from vltrain.tools.mine import _embed as mine_embed

CAPTION_PRESET = Path(__file__).resolve().parents[2] / "configs" / "caption_pretrain.yaml"


@pytest.fixture(scope="module")
def clip_run(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CLIP run of 4 steps with checkpoints at steps 2 and 4 (evaluated at 4)."""
    run = tmp_path_factory.mktemp("api_clip") / "run"
    extra = {"train.max_steps": 4, "train.save_every": 2}
    summary = train(load_config(None, tiny_overrides(shapes_dir, run, **extra)))
    assert summary["step"] == summary["steps"] == 4  # the README reads summary["step"]
    return run


@pytest.fixture(scope="module")
def caption_run(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("api_caption") / "run"
    over = caption_overrides(shapes_dir, run, **{"train.max_steps": 2})
    train(load_config(CAPTION_PRESET, over))
    return run


@pytest.fixture(scope="module")
def val(shapes_dir: Path) -> tuple[list[str], list[str]]:
    """Image paths and first captions of the first 12 val records."""
    recs = read_jsonl(shapes_dir / "val.jsonl")[:12]
    return [str(shapes_dir / r["image"]) for r in recs], [r["text"][0] for r in recs]


def test_embeddings_are_unit_norm_rows_in_input_order(clip_run: Path, val) -> None:
    paths, texts = val
    run = load_run(clip_run)
    assert isinstance(run, TrainedRun) and run.cfg.stage == "contrastive"
    assert run.checkpoint == clip_run / "checkpoints" / "best" and not run.model.training
    img, txt = run.embed_images(paths[:5]), run.embed_texts(texts[:3])
    dim = run.cfg.model.embed_dim
    assert img.shape == (5, dim) and txt.shape == (3, dim) and img.dtype == torch.float32
    for emb in (img, txt):
        torch.testing.assert_close(emb.norm(dim=-1), torch.ones(len(emb)), atol=1e-5, rtol=0)
    # row i is input i, whatever the batch size (3 batches of 2, then one of 5)
    torch.testing.assert_close(run.embed_images(paths[:5], batch_size=2), img, atol=1e-5, rtol=0)
    torch.testing.assert_close(run.embed_texts(texts[2::-1]), txt.flip(0), atol=1e-5, rtol=0)
    assert not torch.allclose(img[0], img[1])  # control: different images differ
    # a PIL image is its pixels: a PNG opened with Pillow embeds as its file does
    with Image.open(paths[0]) as pil:
        torch.testing.assert_close(run.embed_images([pil, paths[1]]), img[:2], atol=0, rtol=0)


def test_embeddings_equal_what_mine_embeds(clip_run: Path, shapes_dir: Path) -> None:
    _, stage, model = load_trained(clip_run)
    records, img, owners, txt, texts, _ = mine_embed(stage, model, shapes_dir / "val.jsonl", 8)
    run = load_run(clip_run)
    paths = [str(shapes_dir / records[i]["image"]) for i in owners]
    torch.testing.assert_close(run.embed_images(paths, batch_size=8), img, atol=1e-6, rtol=0)
    torch.testing.assert_close(run.embed_texts(texts), txt, atol=1e-5, rtol=0)
    # negative control: the step-2 checkpoint of the same run embeds differently
    early = load_run(clip_run / "checkpoints" / "step_2")
    assert early.checkpoint.name == "step_2"
    assert not torch.allclose(early.embed_texts(texts), txt, atol=1e-3)


@pytest.fixture(scope="module")
def split(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BEIR split over val: each record's first caption is a query for its image."""
    out = tmp_path_factory.mktemp("api_split")
    hardlink_tree(shapes_dir / "images", out / "images")
    recs = read_jsonl(shapes_dir / "val.jsonl")
    rows = [{"_id": f"q{i}", "text": r["text"][0]} for i, r in enumerate(recs)]
    (out / "queries.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    docs = [{"_id": f"d{i}", "image": r["image"]} for i, r in enumerate(recs)]
    (out / "corpus.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    qrels = "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(len(recs)))
    (out / "qrels.tsv").write_text(qrels)
    return out


def test_embeddings_equal_what_eval_embeds(clip_run: Path, split: Path) -> None:
    sp = read_split_dir(split)
    _, stage, model = load_trained(clip_run)
    q_emb, q_rows, _ = stage.corpus.embed(model.encoder, sp.queries, "query")
    d_emb, d_rows, _ = stage.corpus.embed(model.encoder, sp.docs, "doc")
    assert q_rows.tolist() == list(range(len(sp.queries))) == d_rows.tolist()
    run = load_run(clip_run)
    queries = run.embed_texts([q["text"] for q in sp.queries], role="query")
    docs = run.embed_images([split / d["image"] for d in sp.docs], role="doc")
    torch.testing.assert_close(queries, q_emb, atol=1e-6, rtol=0)
    torch.testing.assert_close(docs, d_emb, atol=1e-6, rtol=0)
    # and the public metric over them reproduces `vltrain eval`'s numbers
    files = [str(split / f) for f in ("queries.jsonl", "corpus.jsonl", "qrels.tsv")]
    metrics = eval_command(str(clip_run), *files)
    ours = evaluate_retrieval(queries, docs, [[i] for i in range(len(sp.docs))])
    for key in ("R@1", "R@5", "MRR@10"):
        assert ours[key] == pytest.approx(metrics[key], abs=1e-9), key


def test_generate_equals_vltrain_generate(caption_run: Path, val, capsys) -> None:
    paths = val[0][:3]
    run = load_run(caption_run)
    assert run.cfg.stage == "caption" and run.checkpoint.name == "best"
    ours = {}
    for strategy in ("greedy", "beam"):
        ours[strategy] = run.generate(paths, strategy=strategy, num_beams=2, max_new_tokens=6)
        args = ["generate", "--checkpoint", str(caption_run), "--images", *paths]
        args += ["--strategy", strategy, "--beams", "2", "--max-new-tokens", "6"]
        assert main(args) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert ours[strategy] == [r["caption"] for r in rows]
    assert all(isinstance(c, str) and c for c in ours["greedy"])
    assert run.generate(paths, max_new_tokens=6) == ours["greedy"]  # greedy is the default
    with Image.open(paths[1]) as pil:  # a PIL image captions as its file does
        assert run.generate([pil], max_new_tokens=6) == ours["greedy"][1:2]


def test_a_method_that_does_not_fit_the_run_says_so(clip_run: Path, caption_run: Path, val):
    paths, texts = val
    caption, clip = load_run(caption_run), load_run(clip_run)
    with pytest.raises(ConfigError, match="embed_texts needs a contrastive run.*'caption' run"):
        caption.embed_texts(texts[:1])
    with pytest.raises(ConfigError, match="embed_images needs a contrastive run.*run.generate"):
        caption.embed_images(paths[:1])
    with pytest.raises(ConfigError, match="generate needs a caption or rl run.*embed_texts"):
        clip.generate(paths[:1])


def test_bad_inputs_fail_with_a_message(clip_run: Path, val, tmp_path: Path) -> None:
    paths, texts = val
    run = load_run(clip_run)
    with pytest.raises(TypeError, match="takes a list of texts"):
        run.embed_texts("a red circle")
    with pytest.raises(ValueError, match="no images given"):
        run.embed_images([])
    with pytest.raises(ValueError, match=r"texts\[1\].*empty"):
        run.embed_texts(["a red circle", "   "])
    with pytest.raises(ValueError, match=r"images\[1\] cannot be used: missing"):
        run.embed_images([paths[0], tmp_path / "nope.png"])
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"images\[0\] cannot be used: not_image"):
        run.embed_images([tmp_path / "text.png"])
    with pytest.raises(TypeError, match="pass file paths or PIL images"):
        run.embed_images([torch.zeros(3, 8, 8)])
    with pytest.raises(ValueError, match="role must be one of"):
        run.embed_texts(texts[:1], role="document")
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        load_run(tmp_path)


HF = {
    "hf_clip": ("clip_dir", {}),
    "vlm": (
        "qwen2vl_dir",
        {
            "data.max_visual_tokens": 4,
            "data.max_text_len": 24,
            "model.instruction_query": "Find the picture.",
            "model.instruction_doc": "Describe the picture.",
        },
    ),
}


@pytest.mark.parametrize("kind", sorted(HF))
def test_hf_backbones_embed_as_eval_does_with_roles_and_instructions(
    kind: str, shapes_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Native-size images through the processor; a VLM's prompt holds the role's configured
    instruction, or the one passed, exactly as corpus evaluation builds it."""
    fixture, extra = HF[kind]
    over = {"model.kind": kind, "model.path": request.getfixturevalue(fixture), **extra}
    over.update({"train.max_steps": 1, "data.batch_size": 4, "optim.warmup_steps": 0})
    run_dir = tmp_path / "run"
    train(load_config(None, tiny_overrides(shapes_dir, run_dir, **over, **{"data.eval": ""})))
    _, stage, model = load_trained(run_dir)
    recs = read_jsonl(shapes_dir / "val.jsonl")[:6]
    base = str(shapes_dir / "val.jsonl")
    texts = [r["text"][0] for r in recs]
    images = [{"text": None, "image": r["image"], "base": base} for r in recs]
    run = load_run(run_dir)
    for role in ("query", "doc"):
        sides = [{"text": t, "image": None, "base": base} for t in texts]
        want, _, _ = stage.corpus.embed(model.encoder, sides, role)
        torch.testing.assert_close(run.embed_texts(texts, role=role), want, atol=1e-6, rtol=0)
        want, _, _ = stage.corpus.embed(model.encoder, images, role)
        paths = [shapes_dir / r["image"] for r in recs]
        torch.testing.assert_close(run.embed_images(paths, role=role), want, atol=1e-6, rtol=0)
    asked = [{"text": t, "image": None, "base": base, "instruction": "Odd one."} for t in texts]
    want, _, _ = stage.corpus.embed(model.encoder, asked, "query")
    got = run.embed_texts(texts, instruction="Odd one.")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if kind == "vlm":  # control: the instruction is in the prompt, so it changes the embedding
        assert not torch.allclose(got, run.embed_texts(texts), atol=1e-4)
        assert not torch.allclose(run.embed_texts(texts, role="doc"), run.embed_texts(texts))
