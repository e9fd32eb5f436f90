"""Caption and chat records: JSONL, COCO json, HF datasets folders, parquet; chat template."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
import torch

from tests.conftest import hardlink_tree
from vltrain.data import chat
from vltrain.data.caption_data import CaptionDataset, read_caption_source
from vltrain.data.readers import DataError, read_jsonl
from vltrain.data.samplers import TAIL_BUCKET, LengthBucketBatchSampler
from vltrain.data.tokenizer import train_bpe_tokenizer
from vltrain.models.captioner import IGNORE_INDEX


@pytest.fixture(scope="module")
def tok(shapes_dir: Path):
    texts = [t for r in read_jsonl(shapes_dir / "train.jsonl") for t in r["text"]]
    return train_bpe_tokenizer(texts + [chat.USER, chat.ASSISTANT] * 50, vocab_size=400)


def _dataset(path: Path, tok, **kw) -> CaptionDataset:
    src = read_caption_source(path, kw.pop("image_column", "image"), kw.pop("text_column", "text"))
    return CaptionDataset(src, tok, image_size=64, max_len=40, seed=0, **kw)


def test_ignore_index_matches_the_captioner() -> None:
    assert chat.IGNORE_INDEX == IGNORE_INDEX


def test_sft_labels_cover_exactly_the_assistant_tokens(tok) -> None:
    msgs = [
        {"role": "user", "content": "what is shown?"},
        {"role": "assistant", "content": "a red circle"},
        {"role": "user", "content": "and the colour of the circle?"},
        {"role": "assistant", "content": "red"},
    ]
    ids, labels = chat.encode_segments(tok, chat.chat_segments(msgs), max_len=64)
    labelled = [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]
    expected = tok.encode("a red circle") + [tok.eos_id] + tok.encode("red") + [tok.eos_id]
    assert labelled == expected
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels, strict=True))
    # the user turns and markers are in the ids but unlabelled (negative control of the mask)
    assert len(ids) > len(expected) + 10 and ids[0] == tok.bos_id
    prompt, ref = chat.chat_prompt_and_reference(msgs)
    assert ref == "red" and prompt[-1] == (chat.ASSISTANT, False)
    assert chat.encode_prompt(tok, prompt) == ids[: len(chat.encode_prompt(tok, prompt))]


def test_truncation_keeps_eos_inside_a_target(tok) -> None:
    ids, labels = chat.encode_segments(tok, chat.caption_segments("a red circle " * 20), max_len=10)
    assert len(ids) == 10 and ids[-1] == labels[-1] == tok.eos_id


def test_train_caption_choice_depends_on_seed_epoch_index_only(shapes_dir: Path, tok) -> None:
    ds = _dataset(shapes_dir / "train.jsonl", tok)
    a = [ds[(e, 0, 3)]["input_ids"] for e in range(6)]
    b = [ds[(e, 5, 3)]["input_ids"] for e in range(6)]
    assert a == b  # the batch position does not matter
    assert len({tuple(x) for x in a}) > 1  # but the epoch does: captions vary
    ev = _dataset(shapes_dir / "val.jsonl", tok, train=False)[0]
    assert len(ev["refs"]) >= 3 and ev["prompt_ids"] == [tok.bos_id]


def _multi_caption_data(shapes_dir: Path, tmp_path: Path) -> Path:
    """The shapes records, each with three captions of very different lengths (short, medium,
    long) in a per-record random order, so the first caption says little about the drawn one."""
    rng = random.Random(0)
    rows = read_jsonl(shapes_dir / "train.jsonl")
    for r in rows:
        base = r["text"][0]
        caps = [base, f"{base} , {base}", f"{base} , {base} , {base}"]
        rng.shuffle(caps)
        r["text"] = caps
        r.pop("caption_negatives", None)  # one list per caption: no longer aligned
    hardlink_tree(shapes_dir / "images", tmp_path / "images")
    (tmp_path / "multi.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "multi.jsonl"


def test_length_buckets_follow_the_caption_training_draws(
    shapes_dir: Path, tok, tmp_path: Path
) -> None:
    ds = _dataset(_multi_caption_data(shapes_dir, tmp_path), tok)
    drawn = LengthBucketBatchSampler(ds.epoch_token_lengths, 8, seed=0, n_buckets=6)
    first = LengthBucketBatchSampler(  # the old rule: each record's first caption
        [ds.token_length(i) for i in range(len(ds))], 8, seed=0, n_buckets=6
    )

    def within_over_total(sampler: LengthBucketBatchSampler, epoch: int) -> float:
        """Within-batch share of the variance of the lengths training actually sees."""
        batches = [b for g, b in sampler.epoch_schedule(epoch) if g != TAIL_BUCKET]
        lens = [[len(ds[(epoch, 0, i)]["input_ids"]) for i in b] for b in batches]
        flat = [x for b in lens for x in b]
        return statistics.fmean(statistics.pvariance(b) for b in lens) / statistics.pvariance(flat)

    for epoch in (0, 1):
        assert within_over_total(drawn, epoch) < 0.03  # measured 0.016-0.018
        assert within_over_total(first, epoch) > 0.5  # measured 0.73-0.76
    # the draw the buckets assume is the one __getitem__ makes
    lens = ds.epoch_token_lengths(1)
    assert [len(ds[(1, 0, i)]["input_ids"]) for i in range(8)] == lens[:8]


@pytest.mark.parametrize("prompt", ["", "describe:"])
def test_batched_caption_lengths_equal_one_encode_each(
    shapes_dir: Path, tok, tmp_path: Path, prompt: str
) -> None:
    """epoch_token_lengths encodes every caption in one batch call; each length is the one a
    caption encoded on its own (with the prompt, and with captions too long for max_len)."""
    path = _multi_caption_data(shapes_dir, tmp_path)
    ds = _dataset(path, tok, prompt=prompt)
    lens = ds.epoch_token_lengths(0)
    alone = [
        ds.token_length(i, ds.source.records[i]["text"][c]) if c is not None else ds.token_length(i)
        for i, c in ((i, ds.caption_choice(r, 0, i)) for i, r in enumerate(ds.source.records))
    ]
    assert lens == alone and max(lens) == 40 and min(lens) < 20


def test_coco_json_reader(shapes_dir: Path, tok, tmp_path: Path) -> None:
    recs = read_jsonl(shapes_dir / "val.jsonl")[:3]
    images = [{"id": i, "file_name": Path(r["image"]).name} for i, r in enumerate(recs)]
    anns = [{"image_id": i, "caption": t} for i, r in enumerate(recs) for t in r["text"]]
    hardlink_tree(shapes_dir / "images", tmp_path / "images")
    (tmp_path / "caps.json").write_text(json.dumps({"images": images, "annotations": anns}))
    ds = _dataset(tmp_path / "caps.json", tok, train=False)
    assert len(ds) == 3
    s = ds[1]
    assert s["refs"] == recs[1]["text"] and s["image"].shape == (3, 64, 64)


def _hf_dataset(shapes_dir: Path, n: int = 4):
    datasets = pytest.importorskip("datasets")
    recs = read_jsonl(shapes_dir / "val.jsonl")[:n]
    data = {
        "img": [str(shapes_dir / r["image"]) for r in recs],
        "caption": [r["text"] for r in recs],
    }
    ds = datasets.Dataset.from_dict(data).cast_column("img", datasets.Image())
    return ds, recs


def test_hf_load_from_disk_and_parquet(shapes_dir: Path, tok, tmp_path: Path) -> None:
    ds, recs = _hf_dataset(shapes_dir)
    ds.save_to_disk(str(tmp_path / "hf"))
    ds.to_parquet(str(tmp_path / "caps.parquet"))
    ref = _dataset(shapes_dir / "val.jsonl", tok, train=False)
    for path in (tmp_path / "hf", tmp_path / "caps.parquet"):
        hf = _dataset(path, tok, train=False, image_column="img", text_column="caption")
        assert len(hf) == 4
        for i in range(4):
            s = hf[i]
            assert s["refs"] == recs[i]["text"]
            assert torch.equal(s["image"], ref[i]["image"])  # same pixels as the PNG file
    with pytest.raises(DataError, match="data.image_column"):
        _dataset(tmp_path / "hf", tok, image_column="picture", text_column="caption")


def test_hf_bad_image_bytes_become_a_marker(shapes_dir: Path, tok, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    good = (shapes_dir / read_jsonl(shapes_dir / "val.jsonl")[0]["image"]).read_bytes()
    data = {"image": [good, b"not an image at all", b""], "text": ["a cat", "a dog", "a cow"]}
    feats = datasets.Features({"image": datasets.Value("binary"), "text": datasets.Value("string")})
    datasets.Dataset.from_dict(data, features=feats).save_to_disk(str(tmp_path / "hf"))
    ds = _dataset(tmp_path / "hf", tok)
    assert "bad" not in ds[0]
    assert ds[1]["bad"] == "not_image" and ds[2]["bad"] == "empty_file"


def test_chat_jsonl_structure_errors_and_mode_check(shapes_dir: Path, tok, tmp_path: Path) -> None:
    img = read_jsonl(shapes_dir / "val.jsonl")[0]["image"]
    hardlink_tree(shapes_dir / "images", tmp_path / "images")
    good = {
        "image": img,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a cat"}],
    }
    (tmp_path / "chat.jsonl").write_text(json.dumps(good) + "\n")
    ds = _dataset(tmp_path / "chat.jsonl", tok, mode="sft")
    assert [t for t in ds[0]["labels"] if t != IGNORE_INDEX] == tok.encode("a cat") + [tok.eos_id]
    with pytest.raises(DataError, match="caption.mode=sft"):
        _dataset(tmp_path / "chat.jsonl", tok, mode="pretrain")
    bad = {"image": img, "messages": [{"role": "user", "content": "hi"}]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1: the chat has no assistant turn"):
        read_caption_source(tmp_path / "bad.jsonl")
    empty = {"image": img, "messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "  "}]}  # fmt: skip
    (tmp_path / "empty.jsonl").write_text(json.dumps(empty) + "\n")
    assert _dataset(tmp_path / "empty.jsonl", tok, mode="sft")[0]["bad"] == "bad_text"


def test_llava_conversations_and_image_placeholders(tmp_path: Path) -> None:
    """LLaVA's records: "conversations" of human/gpt turns, "<image>" marking the image in the
    first user turn. They read as messages without the placeholder (the stages place the
    image); a placeholder in another turn, or two, and an unknown speaker are refused."""

    def read(rec: dict) -> list[dict]:
        (tmp_path / "d.jsonl").write_text(json.dumps({"image": "a.png", **rec}) + "\n")
        return read_caption_source(tmp_path / "d.jsonl").records[0]["messages"]

    turns = [
        {"from": "human", "value": "<image>\nWhat is in the image?"},
        {"from": "gpt", "value": "A red circle."},
        {"from": "human", "value": "Is it big?"},
        {"from": "gpt", "value": "No."},
    ]
    want = [
        {"role": "user", "content": "What is in the image?"},
        {"role": "assistant", "content": "A red circle."},
        {"role": "user", "content": "Is it big?"},
        {"role": "assistant", "content": "No."},
    ]
    assert read({"conversations": turns}) == want
    tail = [{"role": "user", "content": "What is in the image?\n<image>"}, want[1]]
    assert read({"messages": tail}) == want[:2]  # at the end of the text too
    with pytest.raises(DataError, match=r"'<image>' in messages\[2\]: a record has one image"):
        read({"conversations": [*turns[:2], {"from": "human", "value": "<image> and?"}]})
    with pytest.raises(DataError, match="one image"):
        read({"messages": [{"role": "user", "content": "<image><image>hi"}, want[1]]})
    with pytest.raises(DataError, match=r"conversations\[0\] must be \{'from': 'human' or"):
        read({"conversations": [{"from": "system", "value": "be brief"}, *turns]})
    with pytest.raises(DataError, match="no 'text' key .* A chat record has \"messages\""):
        read({"dialogue": turns})
