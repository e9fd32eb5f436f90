"""sentence-transformers export parity, proven by the consumer (STYLE rule 20).

A tiny random Qwen3-VL run (the qwen3vl_embed_pages preset: instructions, LoRA r=4, GradCache,
2 image hard negatives, Matryoshka dims 8/16) trained 2 steps through `vltrain train`, exported
with `vltrain export RUN --format sentence-transformers`, then loaded by
``SentenceTransformer(out)``: its ``encode_query`` of 8 query texts and ``encode_document`` of 8
page images against `load_run`'s ``embed_texts(role="query")`` / ``embed_images(role="doc")``,
and ``truncate_dim`` against vltrain's re-normalised Matryoshka prefix. Two negative controls show
the comparison can fail (another instruction in vltrain; no prompt in sentence-transformers).

Run in a venv with sentence-transformers >= 5.4 (no torchvision needed; see
`tests.tools.test_export_st.qwen_processor_without_video`), from the repository root:

    PYTHONPATH=. python bench/st_export_parity.py
"""

from __future__ import annotations

import datetime
import platform
import tempfile
from pathlib import Path

import sentence_transformers
import torch
import transformers

from tests.tools.test_export_st import TOL, st_parity, train_tiny_run
from vltrain.cli import main

# (label, extra training overrides): the preset as the test runs it, mean pooling, and a
# visual-token budget below the pages' natural 16 tokens (square pages: both resize rules agree)
CONFIGS = (
    ("eos pooling (preset)", {}),
    ("mean pooling", {"model.pooling": "mean"}),
    ("data.max_visual_tokens=4", {"data.max_visual_tokens": 4}),
)


def run() -> None:
    results = []
    for label, extra in CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            trained = train_tiny_run(root, extra=extra)
            out = root / "st"
            cmd = ["export", str(trained), "--out", str(out), "--format", "sentence-transformers"]
            assert main(cmd) == 0
            results.append((label, st_parity(trained, out, root)))
    print(
        f"\nmachine: {platform.machine()} {platform.processor() or ''} CPU, "
        f"{torch.get_num_threads()} threads; {datetime.date.today()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, "
        f"sentence-transformers {sentence_transformers.__version__}"
    )
    print("command: PYTHONPATH=. python bench/st_export_parity.py\n")
    print(f"| run | inputs (8 each) | max abs diff | <= {TOL} |")
    print("|---|---|---|---|")
    for label, res in results:
        for name, diff in res["rows"].items():
            print(f"| {label} | {name} | {diff:.2e} | {'yes' if diff <= TOL else 'NO'} |")
        other, none = res["control_other_instruction"], res["control_st_no_prompt"]
        print(f"| {label} | control: vltrain, another instruction | {other:.2e} | - |")
        print(f"| {label} | control: sentence-transformers, no prompt | {none:.2e} | - |")


if __name__ == "__main__":
    run()
