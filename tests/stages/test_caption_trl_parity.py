"""The caption stage's assistant-only SFT labels against TRL's VLM collator
(bench/trl_sft_label_parity.py) on a few shape chats, one- and two-turn: the same input ids for
a tiny Qwen2-VL and a tiny LLaVA (byte-level and SentencePiece-style tokenizers) and the same
labels under both templates (Qwen2-VL's, whose ``\\n`` after ``<|im_end|>`` both label, and
LLaVA-NeXT's, whose space after ``</s>`` neither does). Skipped where trl is not installed (it is
a bench dependency, not vltrain's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

pytestmark = pytest.mark.usefixtures("one_thread")


def test_assistant_labels_match_trl(shapes_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    bench = load_bench("trl_sft_label_parity")
    n = 6
    res = bench.label_parity(shapes_dir, tmp_path, n)
    turns = sum(
        m["role"] == "assistant" for r in bench.chat_records(shapes_dir, n) for m in r["messages"]
    )
    assert turns == 10  # two-turn chats are in the sample
    for name in ("qwen2_vl", "llava", "llava_metaspace"):
        assert res[name]["rows"] == n and res[name]["ids_differ"] == 0, res[name]
        assert res[name]["labelled_trl"] > 0
        assert res[name]["label_mismatch"] == 0, (name, res[name]["examples"])
        assert res[name]["labelled_vltrain"] == res[name]["labelled_trl"]
