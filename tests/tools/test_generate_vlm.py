"""`vltrain generate` with an HF image-text-to-text model directory (`--model DIR --images`),
the sampling flags (`--temperature`, `--top-k`, `--top-p`) on every path, and their refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.inference import vlm_helpers  # noqa: E402
from vltrain.cli import main  # noqa: E402
from vltrain.data.hf_collate import HFCollate  # noqa: E402
from vltrain.inference.captioning import decode_captions  # noqa: E402
from vltrain.inference.vlm_target import is_hf_vlm, load_hf_vlm, vlm_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> tuple[str, list[str]]:
    """A tiny Qwen2-VL directory and three PNG files of other sizes."""
    root = tmp_path_factory.mktemp("vlm")
    path = vlm_helpers.make_tiny_qwen2vl(root / "model")
    files = vlm_helpers.image_files(root)
    return path, files


def _lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines()]


def test_generate_captions_images_with_an_hf_vlm(vlm, tmp_path: Path, capsys) -> None:
    """Captions equal HF generate's on the same left-padded chat prompts; an unreadable image
    is an error row; the output file is the stdout lines."""
    path, files = vlm
    assert is_hf_vlm(path)
    args = ["generate", "--model", path, "--images", files[0], "missing.png", *files[1:]]
    assert main([*args, "--max-new-tokens", "6", "--prompt", "What is it?"]) == 0
    rows = _lines(capsys.readouterr().out)
    assert [r["image"] for r in rows] == [files[0], "missing.png", *files[1:]]
    assert rows[1]["error"] == "missing"
    model = load_hf_vlm(path)
    from PIL import Image

    inputs = vlm_inputs(HFCollate(path, "vlm"), [Image.open(f) for f in files], "What is it?")
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 1  # other prompt lengths
    ref = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = tok.batch_decode(ref[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert [r["caption"] for r in rows if "caption" in r] == [w.strip() for w in want]
    assert all(r["caption"] for r in rows if "caption" in r)  # not vacuous: real text
    out = tmp_path / "caps.jsonl"
    more = ["--max-new-tokens", "6", "--prompt", "What is it?", "--out", str(out)]
    assert main([*args, *more]) == 0
    assert _lines(out.read_text()) == rows


def test_sampling_flags_drive_the_hf_vlm(vlm, capsys) -> None:
    path, files = vlm
    base = ["generate", "--model", path, "--images", *files, "--max-new-tokens", "8"]

    def caps(*more: str) -> list[str]:
        assert main([*base, *more]) == 0
        return [r["caption"] for r in _lines(capsys.readouterr().out)]

    sample = ["--strategy", "sample", "--temperature", "1.5", "--top-p", "0.95"]
    a, b = caps(*sample, "--seed", "1"), caps(*sample, "--seed", "1")
    assert a == b and a != caps(*sample, "--seed", "2")
    greedy = caps()
    assert caps("--strategy", "sample", "--top-k", "1", "--seed", "3") == greedy
    assert caps("--strategy", "beam", "--beams", "3") != a


def test_generate_hf_vlm_with_a_drafter_equals_greedy(vlm, tmp_path: Path, capsys) -> None:
    """`--draft` with a (random) drafter of the VLM: the same captions as plain greedy."""
    from safetensors.torch import save_file

    from vltrain.models.drafter import Drafter, DrafterConfig, save_drafter_meta

    path, files = vlm
    torch.manual_seed(0)
    cfg = DrafterConfig(width=32, vocab_size=320, target_layer_ids=[0, 1], heads=2, block_size=4)
    ckpt = tmp_path / "drafter"
    ckpt.mkdir()
    save_file(
        {f"drafter.{k}": v for k, v in Drafter(cfg).state_dict().items()},
        ckpt / "model.safetensors",
    )
    save_drafter_meta(ckpt, cfg, {"kind": "hf_vlm", "path": path})
    base = ["generate", "--model", path, "--images", *files, "--max-new-tokens", "10"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    stats = tmp_path / "stats.json"
    assert main([*base, "--draft", str(ckpt), "--tree-budget", "4", "--stats", str(stats)]) == 0
    assert capsys.readouterr().out == plain
    assert json.loads(stats.read_text())["rounds"] > 0


def test_hf_vlm_and_sampling_mistakes_are_one_line_errors(vlm, tmp_path: Path, capsys) -> None:
    path, files = vlm
    base = ["generate", "--model", path, "--images", files[0]]
    cases = [
        ([*base, "--max-new-tokens", "100000"], "max_position_embeddings"),
        ([*base, "--temperature", "0.5"], "--strategy sample"),
        ([*base, "--strategy", "beam", "--top-k", "3", "--top-p", "0.5"], "--top-k, --top-p"),
        (["generate", "--model", path, "--prompts", files[0]], "--images"),
        (["generate", "--model", path], "--images"),
        (["generate", "--model", str(tmp_path), "--images", files[0]], "is none (a folder whose"),
    ]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("vltrain: error: ") and words in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for flag, value in (("--top-p", "0"), ("--temperature", "0"), ("--top-k", "-1")):
        with pytest.raises(SystemExit) as e:
            main([*base, "--strategy", "sample", flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_lm_prompts_follow_strategy_and_sampling_flags(tmp_path: Path, capsys) -> None:
    """`--model LM --prompts`: --strategy and the sampling flags are used (it was greedy only)."""
    from tests.stages.drafter_fixtures import tiny_lm

    lm = tiny_lm(tmp_path / "lm")
    assert not is_hf_vlm(lm) and not is_hf_vlm(tmp_path / "none")  # the LM path is taken
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red circle"}\n{"prompt": "two blue squares left"}\n')
    base = ["generate", "--model", str(lm), "--prompts", str(prompts), "--max-new-tokens", "8"]

    def completions(*more: str) -> list[str]:
        assert main([*base, *more]) == 0
        return [r["completion"] for r in _lines(capsys.readouterr().out)]

    greedy = completions()
    assert completions("--strategy", "sample", "--top-k", "1") == greedy
    hot = ["--strategy", "sample", "--temperature", "2.0"]
    assert completions(*hot, "--seed", "4") == completions(*hot, "--seed", "4") != greedy


class _Tokens:
    """The two things `decode_captions` asks of a tokenizer."""

    pad_id = 0

    def decode_batch(self, rows: list[list[int]]) -> list[str]:
        return [" ".join(map(str, r)) for r in rows]


def test_captioner_decoding_takes_the_sampling_options() -> None:
    from vltrain.models.captioner import Captioner

    torch.manual_seed(0)
    model = Captioner.from_config(
        vocab_size=64, connector="projector", connector_options={"pool": 2}, max_text_len=24
    ).eval()
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts = [[1], [1, 5], [1]]
    greedy = decode_captions(model, _Tokens(), images, prompts, max_new_tokens=8)
    kw = dict(strategy="sample", max_new_tokens=8)
    g = torch.Generator().manual_seed(0)
    assert decode_captions(model, _Tokens(), images, prompts, top_k=1, generator=g, **kw) == greedy
    hot = [
        decode_captions(
            model,
            _Tokens(),
            images,
            prompts,
            temperature=3.0,
            top_p=0.99,
            **kw,
            generator=torch.Generator().manual_seed(s),
        )  # fmt: skip
        for s in (0, 0, 1)
    ]
    assert hot[0] == hot[1] != hot[2] and hot[0] != greedy
