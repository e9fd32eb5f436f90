"""The caption stage's assistant-only SFT labels against TRL's VLM collator
(bench/trl_sft_label_parity.py) on a few shape chats, one- and two-turn: the same input ids for
a tiny Qwen2-VL and a tiny LLaVA (byte-level and SentencePiece-style tokenizers); the same labels
under Qwen2-VL's template; under LLaVA-NeXT's, exactly the documented difference (the space the
template writes after ``</s>``: vltrain labels it, TRL's training template does not). Skipped
where trl is not installed (it is a bench dependency, not vltrain's)."""

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
    assert res["qwen2_vl"]["label_mismatch"] == 0, res["qwen2_vl"]["examples"]
    assert res["qwen2_vl"]["labelled_vltrain"] == res["qwen2_vl"]["labelled_trl"]
    llava = res["llava"]
    assert llava["label_mismatch"] == turns
    assert llava["labelled_vltrain"] - llava["labelled_trl"] == turns
    assert all(
        e["token"] == "\u0120" and e["vltrain_labels"] and not e["trl_labels"]
        for e in llava["examples"]
    )
    # SentencePiece-style: the space joins the next "[INST]" (no target); only the chat's last
    # "</s> " leaves a lone "▁"
    sp = res["llava_metaspace"]
    assert sp["label_mismatch"] == n and sp["labelled_vltrain"] - sp["labelled_trl"] == n
    assert all(e["token"] == "\u2581" and not e["trl_labels"] for e in sp["examples"])
