"""`vltrain export`: consolidate a checkpoint (sharded fsdp ones too) to safetensors + HF."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "export",
        help="consolidate a checkpoint to model.safetensors (+ hf_model/ for HF backbones)",
        description="Load CHECKPOINT (a run dir, its checkpoints/ folder or a step folder; "
        "sharded train.parallel=fsdp checkpoints are resharded into one process) and write "
        "OUT/model.safetensors with the keys a single-process run saves, plus hf_model/ "
        "(save_pretrained) for HF backbones, the tokenizer and the run's config.yaml.",
    )
    e.add_argument("checkpoint", help="run dir, checkpoints/ folder or checkpoints/step_<N>")
    e.add_argument("--out", required=True, help="folder to write")
    e.add_argument(
        "--format",
        default="vltrain",
        choices=("vltrain", "hf", "speculators", "dflash", "sentence-transformers"),
        help="vltrain (default): the checkpoint as above; speculators: a drafter vLLM serves "
        "(vllm serve OUT); hf: a caption run of model.kind hf_vlm or llava as a transformers "
        "folder (AutoModelForImageTextToText + AutoProcessor, LoRA merged); dflash: z-lab's "
        "DFlash format (SGLang --speculative-algorithm DFLASH); "
        "sentence-transformers: a model.kind=vlm embedder SentenceTransformer(OUT) loads",
    )
    e.add_argument(
        "--target-id",
        default="",
        help="a drafter: name its target by this HF id (default: its path relative to OUT; "
        "speculators/dflash: required for a GGUF target)",
    )
    e.add_argument(
        "--target", default="", help="speculators/dflash: the target's path, if it moved"
    )
    e.add_argument("--force", action="store_true", help="replace the export OUT already holds")
    e.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.tools.export import export_command

    return export_command(
        args.checkpoint, args.out, args.format, args.force, args.target, args.target_id
    )
