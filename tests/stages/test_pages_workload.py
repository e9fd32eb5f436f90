"""The page-retrieval workload end to end on the built-in towers: synthetic pages, pair records
with image hard negatives through GradCache, corpus evaluation in training and `vltrain eval`,
mining document ids and a second round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.data.contrastive_data import ContrastiveData
from vltrain.data.reading import load_reading_tokens
from vltrain.data.synth_pages import held_out_title, pages_command
from vltrain.engine.runtime import RunContext
from vltrain.models.contrastive import embed_pairs
from vltrain.objectives.grad_cache import pair_grad_cache
from vltrain.stages import check_config

PRESET = Path(__file__).resolve().parents[2] / "vltrain" / "configs" / "pages.yaml"


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pages")
    pages_command(
        str(out), n_train=24, n_val=6, n_test=6, seed=3, image_size=32, negatives=2, distractors=6
    )
    return out


def _overrides(pages: Path, out: Path, **extra: object) -> list[str]:
    base = {
        "data.eval": pages / "val",
        "data.test": "",
        "data.image_size": 32,
        "data.batch_size": 8,
        "train.max_steps": 3,
        "train.save_every": 3,
        "optim.warmup_steps": 0,
        "objective.hard_negatives": 2,
        "model.vision_width": 64,
        # GroupNorm: no batch statistics, so GradCache's chunks equal the plain step; the
        # pooled head (the preset's word-pair head needs the reading loss)
        "model.vision_options": "{stem_norm: group, pool: max}",
        "model.head": "pooled",
        "model.pair_code": "add",  # the default: the preset's product code is the pair head's
        "model.embed_dim": 128,
        "objective.reading": 0,
        "run.threads": 1,
    }
    return tiny_overrides(pages, out, **{**base, **extra})


def test_synth_pages_contract_and_determinism(pages: Path, tmp_path: Path) -> None:
    for split in ("val", "test"):
        for name in ("queries.jsonl", "corpus.jsonl", "qrels.tsv"):
            assert (pages / split / name).is_file()
    assert (pages / "val" / "qrels.tsv").read_text().startswith("query-id\tcorpus-id\tscore\n")
    rec = json.loads((pages / "train.jsonl").read_text().splitlines()[0])
    assert set(rec) >= {"query", "positive", "negatives"} and len(rec["negatives"]) == 2
    again = tmp_path / "again"
    pages_command(
        str(again), n_train=24, n_val=6, n_test=6, seed=3, image_size=32, negatives=2, distractors=6
    )
    assert (again / "train.jsonl").read_text() == (pages / "train.jsonl").read_text()
    img = "pages/train/000005_n1.png"
    assert (again / img).read_bytes() == (pages / img).read_bytes()
    other = tmp_path / "other"
    pages_command(str(other), n_train=24, n_val=1, n_test=1, seed=4, image_size=32, distractors=1)
    assert (other / "train.jsonl").read_text() != (pages / "train.jsonl").read_text()  # control
    # held-out: no title query of val/test names a training title
    train_q = {
        json.loads(x)["query"]["text"] for x in (pages / "train.jsonl").read_text().split("\n") if x
    }
    for split in ("val", "test"):
        for line in (pages / split / "queries.jsonl").read_text().splitlines():
            words = json.loads(line)["text"].split()
            assert held_out_title(words) or json.loads(line)["text"] not in train_q


def test_image_hard_negatives_through_grad_cache_match_the_plain_step(
    pages: Path, tmp_path: Path
) -> None:
    cfg = load_config(PRESET, _overrides(pages, tmp_path / "run"))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, tmp_path / "run", ctx)
    stage.prepare()
    model = stage.build_model()
    loader = stage.build_loader()
    batch = next(iter(loader)).data
    assert batch["negatives"]["modality"] == "image" and batch["negatives"]["inputs"].shape[0] == 16
    loss, _ = model(batch)
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    cached, _ = pair_grad_cache(model, batch, 3, 1.0)
    assert float(cached) == pytest.approx(float(loss.detach()), abs=1e-6)
    for n, p in model.named_parameters():
        if n in plain:
            torch.testing.assert_close(p.grad, plain[n], atol=2e-5, rtol=1e-4)
    # negative control: without the negatives side the loss is another number
    no_neg = {k: v for k, v in batch.items() if k != "negatives"}
    assert float(model(no_neg)[0].detach()) != pytest.approx(float(loss.detach()), abs=1e-4)


def test_pages_train_eval_mine_second_round(pages: Path, tmp_path: Path) -> None:
    run = tmp_path / "r1"
    over = _overrides(pages, run, **{"objective.grad_cache_chunk": 4})
    assert main(["train", str(PRESET), *over]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "eval_R@1" in r][-1]
    assert {"eval_R@5", "eval_MRR@10", "eval_nDCG@10", "eval_hardneg_acc"} <= set(ev)
    assert ev["eval_n_docs"] == 6 * 3 + 6 and ev["eval_n_queries"] == 6
    # the synthetic queries name their group (title or body phrase): metrics per group
    groups = [k for k in ev if k.startswith("eval_n_queries_")]
    assert groups and sum(ev[k] for k in groups) == 6
    for k in groups:
        assert f"eval_R@1_{k.removeprefix('eval_n_queries_')}" in ev
    assert len((run / "eval_ranks_val.jsonl").read_text().splitlines()) == 6
    # `vltrain eval` gives the in-training numbers for the same checkpoint
    v = pages / "val"
    res = tmp_path / "m.json"
    assert (
        main(
            [
                "eval",
                str(run),
                "--queries",
                str(v / "queries.jsonl"),
                "--corpus",
                str(v / "corpus.jsonl"),
                "--qrels",
                str(v / "qrels.tsv"),
                "--out",
                str(res),
            ]
        )
        == 0
    )
    got = json.loads(res.read_text())
    for k in ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10", *(g[5:] for g in groups)):
        assert got[k] == pytest.approx(ev[f"eval_{k}"], abs=1e-9), k
    # mining: document ids, never the record's own page
    mined = pages / "mined.jsonl"
    assert (
        main(
            [
                "mine",
                "--checkpoint",
                str(run),
                "--data",
                str(pages / "train.jsonl"),
                "--corpus",
                str(pages / "train_corpus.jsonl"),
                "--out",
                str(mined),
                "--k",
                "2",
                "--margin",
                "10",
            ]
        )
        == 0
    )
    recs = [json.loads(x) for x in mined.read_text().splitlines()]
    corpus = {
        json.loads(x)["_id"]: json.loads(x)["image"]
        for x in (pages / "train_corpus.jsonl").read_text().splitlines()
    }
    for r in recs:
        assert len(r["negatives"]) == 2
        assert all(corpus[n["doc"]] != r["positive"]["image"] for n in r["negatives"])
    r2 = tmp_path / "r2"
    over2 = _overrides(
        pages,
        r2,
        **{
            "data.train": mined,
            "model.init_from": run,
            "data.train_corpus": pages / "train_corpus.jsonl",
            "train.max_steps": 1,
            "train.save_every": 1,
        },
    )
    assert main(["train", str(PRESET), *over2]) == 0


def test_image_text_sides_need_a_vlm(pages: Path, tmp_path: Path) -> None:
    rows = [{"query": "q", "positive": {"image": "pages/train/000000.png", "text": "caption"}}]
    path = pages / "mixed_side.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(PRESET, _overrides(pages, tmp_path / "r", **{"data.train": path}))
    with pytest.raises(ConfigError, match="image\\+text.*model.kind=vlm"):
        ContrastiveData(cfg, native=False).pair_dataset(path, True, 0)
    with pytest.raises(ConfigError, match="best_metric"):
        check_config(
            load_config(PRESET, _overrides(pages, tmp_path / "r", **{"train.best_metric": ""}))
        )


def test_image_cache_is_refused_where_it_would_do_nothing(pages: Path, tmp_path: Path) -> None:
    """data.image_cache_mb keeps image-caption pixels at data.image_size: a query/positive
    run (and an HF backbone, which reads native sizes) refuses it at load."""
    over = _overrides(pages, tmp_path / "r", **{"data.image_cache_mb": 64})
    with pytest.raises(ConfigError, match="image_cache_mb.*query/positive"):
        check_config(load_config(PRESET, over))
    check_config(load_config(PRESET, _overrides(pages, tmp_path / "r")))  # control: 0 is fine


def test_render_word_boxes_cover_the_drawn_words() -> None:
    """`render(..., boxes)` reports every word of the page once, in drawing order, and each box
    holds ink while the page outside all boxes is background: the supervision a reading
    objective takes from the renderer is where the words really are."""
    import random

    import numpy as np

    from vltrain.data.synth_pages import make_page, render, vocabulary

    rng = random.Random(3)
    vocab = vocabulary()
    for _ in range(20):
        page = make_page(rng, vocab, 96, held_out=False)
        page.style["rule"] = False  # the rule is ink outside any word box
        boxes: list = []
        img = np.asarray(render(page, 96, boxes).convert("L")).astype(int)
        assert [b[0] for b in boxes] == page.words()
        bg = page.style["bg"]
        inked = np.zeros_like(img, dtype=bool)
        for _, x0, y0, x1, y1 in boxes:
            assert x1 > x0 and y1 > y0
            crop = img[max(0, y0) : y1 + 2, max(0, x0) : x1 + 1]
            if x0 < 96 and y0 < 96:  # a word drawn inside the canvas leaves ink in its box
                assert (crop < bg - 40).any()
            inked[max(0, y0) : y1 + 3, max(0, x0 - 1) : x1 + 2] = True
        assert not (img[~inked] < bg - 40).any()  # no ink outside the boxes


def _reading_overrides(pages: Path, out: Path, **extra: object) -> list[str]:
    """The reading loss on a max-head CNN and a blockless query tower (round 6's preset)."""
    return _overrides(
        pages,
        out,
        **{
            "model.vision_options": "{stem_channels: [16, 32, 32], stem_norm: batch, pool: max}",
            "model.text_options": "{layers: 0, pool: mean}",
            "objective.reading": 1.0,
            **extra,
        },
    )


def test_reading_loss_trains_the_preset_towers(pages: Path, tmp_path: Path) -> None:
    """objective.reading: the collate turns the records' word boxes into a token per grid cell,
    the model adds the reading loss to InfoNCE, and the tower learns to read (its loss falls
    over a few steps); records without words give no reading targets (control)."""
    cfg = load_config(PRESET, _reading_overrides(pages, tmp_path / "s"))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, tmp_path / "s", ctx)
    stage.prepare()
    model = stage.build_model()
    assert len(model.encoder.text.blocks) == 0 and model.encoder.text.cfg.pool == "mean"
    batch = next(iter(stage.build_loader())).data
    # (B + M, 4 * 4): a 32-px page in 8-px cells; the 8 positives, then their 2 x 8 negatives
    targets = batch["reading"]
    classes = stage.reading_tokens  # the reading vocabulary: a target is an index in it
    background = len(classes)
    assert targets.shape == (8 + 16, 16)
    for rows in (targets[:8], targets[8:]):  # the hard-negative pages are read too
        assert ((rows >= 0) & (rows < background)).any(1).all()
    loss, metrics = model(batch)
    plain, _ = model.loss(*embed_pairs(model.encoder, batch))
    want = float((plain + metrics["reading_loss"]).detach())
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    # the cell under the centre of the page's last word (drawn last: nothing covers it) holds
    # one of that word's tokens
    rec = json.loads((pages / "train.jsonl").read_text().splitlines()[int(batch["index"][0])])
    word, x0, y0, x1, y1 = rec["positive"]["words"][-1]
    cell = min(3, int((y0 + y1) / 2 * 4)) * 4 + min(3, int((x0 + x1) / 2 * 4))
    assert int(targets[0, cell]) in {classes.index(i) for i, _, _ in stage.tokenizer.pieces(word)}
    # control: records without their words give no reading targets; when no record lists
    # any, the run is refused (nothing to read), and a record without them reads nothing
    rows = [json.loads(x) for x in (pages / "train.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        for side in (r["positive"], *r["negatives"]):
            del side["words"]
    for name, recs in (("bare.jsonl", rows[1:]), ("one.jsonl", rows)):
        (pages / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    over = _reading_overrides(pages, tmp_path / "b", **{"data.train": pages / "bare.jsonl"})
    cfg = load_config(PRESET, over)
    with pytest.raises(ConfigError, match="lists the 'words'"):
        check_config(cfg)(cfg, tmp_path / "b", ctx).prepare()
    over = _reading_overrides(pages, tmp_path / "o", **{"data.train": pages / "one.jsonl"})
    cfg = load_config(PRESET, [*over, "data.batch_size=23"])
    other = check_config(cfg)(cfg, tmp_path / "o", ctx)
    other.prepare()
    got = next(iter(other.build_loader())).data
    index = got["index"].tolist()
    assert len(index) == 23
    for i, k in enumerate(index):  # the positive pages' rows come first
        assert bool((got["reading"][i] >= 0).any()) == (k == 0), (i, k)
    # a short run logs the reading metrics, and the reading loss falls
    run = tmp_path / "run"
    over = _reading_overrides(pages, run, **{"train.max_steps": 40, "train.save_every": 0})
    assert main(["train", str(PRESET), *over]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    read = [r["train_reading_loss"] for r in rows if "train_reading_loss" in r]
    assert len(read) == 40 and "train_reading_acc" in rows[0]
    assert sum(read[-5:]) < 0.9 * sum(read[:5]), read  # 4.1 -> 3.5 here
    acc = [r["train_reading_acc"] for r in rows if "train_reading_acc" in r]
    # 0.039 over the first 10 steps, 0.123 over the last 10 here (a token among the ~60 the
    # fixture's pages show; positive and negative pages)
    assert sum(acc[-10:]) / 10 > 2 * sum(acc[:10]) / 10 + 0.02, acc


def test_reading_loss_is_refused_where_it_cannot_read(pages: Path, tmp_path: Path) -> None:
    over = _reading_overrides(pages, tmp_path / "r", **{"objective.grad_cache_chunk": 4})
    with pytest.raises(ConfigError, match="grad_cache_chunk=0"):
        check_config(load_config(PRESET, over))
    caption_records = tmp_path / "captions.jsonl"
    caption_records.write_text(json.dumps({"image": "a.png", "text": "a page"}) + "\n")
    over = _reading_overrides(pages, tmp_path / "r", **{"data.train": caption_records})
    with pytest.raises(ConfigError, match="objective.reading=0"):
        check_config(load_config(PRESET, over))
    texts = pages / "text_positives.jsonl"
    texts.write_text(json.dumps({"query": "q", "positive": "a text", "id": "1"}) + "\n")
    cfg = load_config(PRESET, _reading_overrides(pages, tmp_path / "r", **{"data.train": texts}))
    with pytest.raises(ConfigError, match="positives of .* are text sides"):
        ContrastiveData(cfg, native=False).pair_dataset(texts, True, 0)
    with pytest.raises(ConfigError, match="objective.reading"):  # not an HF backbone's key
        check_config(
            load_config(
                PRESET,
                [
                    *_reading_overrides(pages, tmp_path / "r"),
                    "model.kind=hf_clip",
                    "model.path=/nowhere",
                ],
            )
        )


def _pair_overrides(pages: Path, out: Path, **extra: object) -> list[str]:
    """The preset's word-pair head over a stem-only tower, small."""
    return _overrides(
        pages,
        out,
        **{
            "model.head": "word_pairs",
            "model.pair_code": "product",  # the preset's
            "model.embed_dim": 64,
            "model.vision_options": "{stem_channels: [16, 32, 32], pool: none}",
            "objective.reading": 1.0,
            **extra,
        },
    )


def test_word_pair_head_trains_evaluates_and_mines(pages: Path, tmp_path: Path) -> None:
    """model.head=word_pairs: the collate adds next-token targets, the run logs the next-token
    reading, corpus evaluation and `vltrain eval` agree, and mining runs on its embeddings."""
    cfg = load_config(PRESET, _pair_overrides(pages, tmp_path / "s"))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, tmp_path / "s", ctx)
    stage.prepare()
    model = stage.build_model()
    assert model.encoder.pairs is not None and not hasattr(model.encoder, "text")
    # the reading vocabulary: the token ids of the training pages' words, saved beside the
    # tokenizer (checkpoints carry it); the readers tell those apart, not every BPE id
    saved = load_reading_tokens(tmp_path / "s" / "tokenizer")
    words = {
        w[0]
        for x in (pages / "train.jsonl").read_text().splitlines()
        for side in (json.loads(x)["positive"], *json.loads(x)["negatives"])
        for w in side["words"]
    }
    want = sorted({i for w in words for i, _, _ in stage.tokenizer.pieces(w)})
    assert saved == want == stage.reading_tokens and len(want) < stage.tokenizer.vocab_size
    assert model.encoder.pairs.read.out_features == len(want) + 1

    batch = next(iter(stage.build_loader())).data
    assert batch["reading"].shape == (8 + 16, 2, 16)  # tokens and next tokens of 4x4 cells
    following = batch["reading"][:, 1]
    assert ((following >= 0) & (following <= len(want))).any()
    assert bool(((following >= 0) == (batch["reading"][:, 0] < len(want))).all())
    run = tmp_path / "run"
    over = _pair_overrides(pages, run, **{"train.max_steps": 6, "train.save_every": 6})
    assert main(["train", str(PRESET), *over]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("train_reading_next_acc" in r for r in rows if "train_reading_loss" in r)
    ev = [r for r in rows if "eval_R@1" in r][-1]
    v, res = pages / "val", tmp_path / "m.json"
    args = ["--queries", str(v / "queries.jsonl"), "--corpus", str(v / "corpus.jsonl")]
    args += ["--qrels", str(v / "qrels.tsv"), "--out", str(res)]
    assert main(["eval", str(run), *args]) == 0
    got = json.loads(res.read_text())
    for k in ("R@1", "R@5", "MRR@10", "nDCG@10"):
        assert got[k] == pytest.approx(ev[f"eval_{k}"], abs=1e-9), k
    mined = pages / "mined_pairs.jsonl"  # beside the records (their image paths stay valid)
    mine = ["mine", "--checkpoint", str(run), "--data", str(pages / "train.jsonl")]
    mine += ["--corpus", str(pages / "train_corpus.jsonl"), "--out", str(mined), "--k", "1"]
    assert main([*mine, "--margin", "10"]) == 0
    assert len(mined.read_text().splitlines()) == 24


def test_word_pair_head_is_refused_where_it_cannot_read(pages: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    with pytest.raises(ConfigError, match="objective.reading > 0"):
        check_config(load_config(PRESET, _pair_overrides(pages, out, **{"objective.reading": 0})))
    pooled = {"model.vision_options": "{pool: max}"}
    with pytest.raises(ConfigError, match="pool: none"):
        check_config(load_config(PRESET, _pair_overrides(pages, out, **pooled)))
    stem_only = {"model.head": "pooled", "model.pair_code": "add"}
    with pytest.raises(ConfigError, match="only model.head=word_pairs"):
        check_config(load_config(PRESET, _pair_overrides(pages, out, **stem_only)))
    with pytest.raises(ConfigError, match="word_pairs has no text tower"):
        check_config(load_config(PRESET, [*_pair_overrides(pages, out), "model.text_layers=2"]))
    check_config(load_config(PRESET, _pair_overrides(pages, out)))  # control
    # how pairs are coded means nothing to a pooled head
    pooled_code = {"model.head": "pooled", "model.pair_code": "product"}
    with pytest.raises(ConfigError, match="model.pair_code"):
        check_config(load_config(PRESET, _overrides(pages, out, **pooled_code)))
    # a FLOP budget does not count pair records yet (it would miscount the page sides)
    from vltrain.scaling.budget import config_flops

    with pytest.raises(ConfigError, match="query/positive records"):
        config_flops(load_config(PRESET, [*_pair_overrides(pages, out), "train.max_flops=1e12"]))
    # a captioner has no use for a tower that pools nothing
    caption = Path(PRESET).parent / "caption_pretrain.yaml"
    with pytest.raises(ConfigError, match="pool: none"):
        check_config(load_config(caption, ["model.vision_options={pool: none}"]))


def test_reading_vocabulary_is_kept_for_trained_runs_and_old_readers_load(
    pages: Path, tmp_path: Path
) -> None:
    """A run folder that already holds weights but no reading vocabulary (saved before reading
    vocabularies existed) reads every id as its own class, and its reader, saved inside the
    loss as ``reading.head.*``, loads into the encoder's ``encoder.reader.*``."""
    from safetensors.torch import save_file

    out = tmp_path / "old"
    cfg = load_config(PRESET, _reading_overrides(pages, out))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    new = check_config(cfg)(cfg, out, ctx)
    new.prepare()
    assert new.reading_tokens is not None and len(new.reading_tokens) < new.tokenizer.vocab_size
    # the older layout: no reading_tokens.json, a complete checkpoint, the reader in the loss
    (out / "tokenizer" / "reading_tokens.json").unlink()
    ckpt = out / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    old = check_config(cfg)(cfg, out, ctx)
    (ckpt / "COMPLETE").write_text("")
    save_file({"x": torch.zeros(1)}, str(ckpt / "model.safetensors"))
    old.prepare()
    vocab = old.tokenizer.vocab_size
    assert old.reading_tokens is None  # every id its own class, as the old weights read
    model = old.build_model()
    assert model.encoder.reader.out_features == vocab + 1
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = state.pop("encoder.reader.weight") + 1.0
    state["reading.head.weight"] = weight
    state["reading.head.bias"] = state.pop("encoder.reader.bias")
    model.load_state_dict(state)
    assert torch.equal(model.encoder.reader.weight, weight)
