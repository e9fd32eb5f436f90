"""The vltrain config schema: every key, its type, default and meaning, declared in one place.

`docs/config.md` is generated from these declarations (`vltrain config-docs`).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vltrain.config import hub_ids
from vltrain.config.core import (
    ConfigError,
    build,
    deep_merge,
    did_you_mean,
    load_yaml,
    option,
    parse_overrides,
    section,
    to_dict,
    value_keys,
)


@dataclass
class RunConfig:
    out_dir: str = option("runs/default", "Run directory: config, metrics, checkpoints, report.")
    seed: int = option(0, "Seed for model init, shuffling, sampling and augmentation.", ge=0)
    device: str = option(
        "auto", "'auto' (cuda if available), 'cpu' or 'cuda'.", choices=("auto", "cpu", "cuda")
    )
    precision: str = option(
        "fp32",
        "Compute precision: fp32, bf16 autocast (CPU and CUDA), or fp16 autocast with a dynamic "
        "loss scaler (CUDA; CPU for the built-in models).",
        choices=("fp32", "bf16", "fp16"),
    )
    deterministic: bool = option(
        False,
        "Deterministic kernels (torch.use_deterministic_algorithms, cuDNN deterministic, "
        "no TF32). Costs speed on GPU (often 10-30%); no effect on results on CPU fp32.",
    )
    threads: int = option(0, "torch intra-op threads per process (0: leave torch's default).", ge=0)


@dataclass
class DataConfig:
    train: str = option(
        "",
        "Training records: JSONL (image-caption or query/positive pairs), COCO captions .json, "
        "or webdataset tar shards (a folder of .tar, a brace pattern, an fsspec URL; contrastive "
        "stage, see docs/streaming.md), parquet, a save_to_disk folder, or a hub dataset "
        "hf://datasets/ORG/NAME (data.split).",
    )
    split: str = option(
        "train",
        "data.train=hf://datasets/ORG/NAME: the split it reads, e.g. train[:10%] (data.eval and "
        "data.test read validation and test unless the value names one: hf://datasets/ORG/NAME:"
        "SPLIT).",
    )
    train_corpus: str = option(
        "", "corpus.jsonl that {doc: id} sides of data.train refer to (e.g. mined negatives)."
    )
    eval: str = option(
        "",
        "Evaluation records (val split), or a folder with queries.jsonl, corpus.jsonl and "
        "qrels.tsv (corpus retrieval); empty disables evaluation.",
    )
    test: str = option(
        "", "Optional held-out test records (or corpus folder), evaluated at the end of training."
    )
    batch_size: int = option(32, "Batch size per process (global batch = this x world size).", ge=1)
    max_train_samples: int = option(
        0,
        "Use only the first N training records (0: all); e.g. a hyperparameter-search budget.",
        ge=0,
    )
    max_visual_tokens: int = option(
        0,
        "vlm / hf_vlm with a patch grid (Qwen2/2.5/3-VL): resize each image, aspect kept, to the "
        "largest size with at most this many visual tokens (0: the processor's own rule).",
        ge=0,
    )
    eval_batch_size: int = option(0, "Per-process eval batch size (0: same as batch_size).", ge=0)
    num_workers: int = option(2, "DataLoader worker processes per rank (0: load in-process).", ge=0)
    image_cache_mb: int = option(
        0,
        "Image-caption training records: keep decoded images (uint8, data.image_size) in memory "
        "up to this many MB per loader process, so later epochs skip decoding (stages run in "
        "one process, as a pipeline's, share one cache per record file); 0: off.",
        ge=0,
    )
    image_size: int = option(64, "Square image side fed to the built-in vision tower.", ge=8)
    max_text_len: int = option(32, "Max text tokens (incl. bos/eos); longer texts are cut.", ge=4)
    tokenizer_vocab: int = option(
        2000,
        "Vocabulary size of the BPE tokenizer trained on the "
        "training captions (built-in text towers).",
        ge=300,
    )
    max_bad_fraction: float = option(
        0.01, "Abort when more than this fraction of samples seen is undecodable.", ge=0.0, le=1.0
    )
    image_column: str = option(
        "image", "HF datasets / parquet records: column holding the image (bytes, path or PIL)."
    )
    text_column: str = option(
        "text", "HF datasets / parquet records: column holding the caption (str or list of str)."
    )
    length_buckets: int = option(
        0,
        "Caption stage: length buckets of the training batch sampler (each global batch from one "
        "bucket of similar token length); 0: plain shuffled batches.",
        ge=0,
    )
    max_same_bucket_run: int = option(
        3, "Length buckets: at most this many consecutive batches from one bucket.", ge=1
    )
    streams: int = option(
        4,
        "Tar shards (data.train = a folder of .tar, a brace pattern or an fsspec URL): virtual "
        "streams that define the sample order; a multiple of the world size, at most the global "
        "batch. Keep it fixed and any world size dividing it sees the same batches.",
        ge=1,
    )
    shuffle_buffer: int = option(
        1000, "Tar shards: samples in each stream's shuffle buffer (0: shard order only).", ge=0
    )


@dataclass
class ModelConfig:
    kind: str = option(
        "dual_encoder",
        "Model registry key: dual_encoder (built-in CLIP), hf_clip / hf_siglip (HF CLIPModel / "
        "SiglipModel from model.path), vlm (HF image-text-to-text embedder), captioner, hf_vlm "
        "(caption stage: an HF image-text-to-text model from model.path), llava (caption stage: "
        "model.vision_path's tower + model.path's LM + a projector; docs/captioning.md). "
        "Which kinds a stage trains comes from the stage (vltrain.stages.STAGES).",
    )
    path: str = option(
        "",
        "HF backbones: a local model directory, or a hub id ORG/NAME read from the HF cache "
        "(a local path that exists wins).",
    )
    local_files_only: bool = option(
        True, "HF backbones: never download; a hub id in model.path must be in the HF cache."
    )
    pooling: str = option(
        "eos",
        "vlm: embedding = hidden state at the last non-padding token "
        "(eos) or the masked mean (mean).",
        choices=("eos", "mean"),
    )
    instruction_query: str = option("", "vlm: instruction prefixed to the text side.")
    instruction_doc: str = option("", "vlm: instruction in the image-side prompt.")
    instruction_role: str = option(
        "user",
        "vlm: where the instruction goes: user (at the head of the user turn's text) or system "
        "(a system message before the user turn: Qwen3-VL-Embedding's own layout).",
        choices=("user", "system"),
    )
    matryoshka_dims: list[int] = option(
        [],
        "vlm: Matryoshka prefix sizes: the loss is the mean over the full embedding and each "
        "prefix (re-normalised), and evaluation also scores each prefix (eval_d<dim>_*).",
    )
    lora_r: int = option(0, "HF backbones: LoRA rank through peft (0: full fine-tuning).", ge=0)
    lora_alpha: float = option(16.0, "LoRA alpha.", gt=0.0)
    lora_dropout: float = option(0.0, "LoRA dropout.", ge=0.0, le=0.9)
    lora_targets: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "LoRA target module names."
    )
    vision_path: str = option(
        "",
        "model.kind=llava: the vision tower, an HF CLIP or SigLIP folder (or its vision model), "
        "or a contrastive run of model.kind hf_clip / hf_siglip (its checkpoint's hf_model/).",
    )
    vision: str = option(
        "tiny",
        "Vision tower preset (vltrain/models/presets.py): tiny, small, base (ViTs) or tiny_cnn "
        "(conv stem + flatten head, no blocks).",
        choices=("tiny", "tiny_cnn", "small", "base"),
    )
    text: str = option(
        "tiny", "Text tower size preset (tiny, small, base).", choices=("tiny", "small", "base")
    )
    embed_dim: int = option(128, "Shared embedding dimension of the dual encoder.", ge=8)
    head: str = option(
        "pooled",
        "Built-in dual encoder: pooled (each tower pools, a linear map projects to embed_dim) "
        "or word_pairs (both sides a shared code of adjacent token pairs, embed_dim wide: a "
        "text is its pairs, a page the pairs its tower reads at each cell; needs "
        "objective.reading and model.vision_options.pool: none; vltrain/models/word_pairs.py).",
        choices=("pooled", "word_pairs"),
    )
    pair_code: str = option(
        "add",
        "model.head=word_pairs: how a pair (token a, next token b) is coded. add: relu(F[a] + "
        "S[b] + c), a side the max over its pairs (a pair overlaps a pair sharing one token, "
        "cosine ~0.45); product: F[a] * S[b] elementwise (rows centred), a side the sum over its "
        "pairs (pairs sharing one token are near orthogonal; a page's score counts its cells "
        "that read the query's pair).",
        choices=("add", "product"),
    )
    vision_layers: int = option(0, "Override the vision preset's depth (0: preset).", ge=0)
    vision_width: int = option(0, "Override the vision preset's width (0: preset).", ge=0)
    vision_options: dict[str, Any] = option(
        {},
        "Built-in vision tower: VisionTowerConfig fields over the preset, e.g. "
        "{stem_channels: [16, 32, 64, 128], stem_norm: group} (vltrain/models/vit.py).",
    )
    text_options: dict[str, Any] = option(
        {},
        "Built-in dual encoder: TextTowerConfig fields over the text preset (vltrain/models/"
        "text.py), e.g. {causal: true, pool: mean}: causal attention (CLIP's), the embedding as "
        "the mean over the tokens instead of the last token's state, rel_pos: N for a learned "
        "relative-position attention bias.",
    )
    text_layers: int = option(0, "Override the text preset's depth (0: preset).", ge=0)
    text_width: int = option(0, "Override the text preset's width (0: preset).", ge=0)
    dropout: float = option(0.0, "Dropout in both towers.", ge=0.0, le=0.9)
    connector: str = option(
        "projector",
        "Captioner: connector registry key (vltrain.models.connectors.CONNECTORS), projector "
        "(LLaVA prefix) or gated_xattn (Flamingo).",
    )
    connector_options: dict[str, Any] = option(
        {},
        "Captioner: the connector's own options, e.g. {pool: 2, projector_layers: 2} or "
        "{n_latents: 16, resampler_layers: 1, xattn_every: 1}. llava: {feature_layer: -2 (the "
        "tower layer the projector reads), select_strategy: default (patch tokens) or full "
        "(CLIP's class token too)}.",
    )
    vision_init_from: str = option(
        "",
        "Captioner: load the vision tower from a contrastive (CLIP-stage) run or checkpoint "
        "(its encoder.vision.* weights); model.vision and data.image_size must match it.",
    )
    freeze: list[str] = option(
        [],
        "Captioner / hf_vlm / llava parts to freeze (no gradient, no optimizer state): vision, "
        "connector, decoder (the language model).",
    )
    target: str = option(
        "",
        "Drafter stage: the frozen target, a caption run / checkpoint (model.kind=captioner), "
        "a local HF causal-LM directory, .gguf file or hub id ORG/NAME in the HF cache "
        "(model.kind=hf_lm), or a local HF image-text-to-text directory (model.kind=hf_vlm).",
    )
    init_from: str = option(
        "",
        "Start from these weights (a run dir, its checkpoints/ or a checkpoint folder; the best "
        "checkpoint, else the newest) and reuse the tokenizer saved there (drafter stage: also a "
        "speculators or DFlash checkpoint). '' = random init.",
    )


@dataclass
class ObjectiveConfig:
    loss: str = option(
        "infonce",
        "Loss registry key (vltrain.objectives.contrastive.LOSSES): infonce (CLIP), siglip "
        "(sigmoid) or qwen3vl (Qwen3-VL-Embedding's masked multi-term InfoNCE, "
        "docs/retrieval.md).",
    )
    terms: str = option(
        "five",
        "objective.loss=qwen3vl: the terms each query's softmax runs over besides its positive. "
        "five (stage 1): its hard negatives and the in-batch query-query, doc-doc and "
        "query-doc terms; two (stage 2): its hard negatives and the query-doc terms.",
        choices=("five", "two"),
    )
    false_negative_margin: float = option(
        0.1,
        "objective.loss=qwen3vl: mask (leave out) a term scoring above the positive's score "
        "plus this margin; copies of the positive are masked too.",
        ge=0.0,
    )
    false_negative_mask: bool = option(
        True, "objective.loss=qwen3vl: apply the false-negative mask (false: every term counts)."
    )
    false_negative_duplicate_cosine: float = option(
        0.9999,
        "objective.loss=qwen3vl: a document at least this close (cosine) to the positive is a "
        "copy of it and masked (copies of one page differ by rounding only); above 1: off, "
        "for a model that still embeds distinct documents alike (train_masked_fraction near 1).",
        gt=0.0,
    )
    temperature: float = option(0.07, "Initial softmax temperature.", gt=0.0)
    learn_temperature: bool = option(True, "Learn the temperature (as a log logit scale).")
    max_logit_scale: float = option(100.0, "Clamp on 1/temperature (CLIP uses 100).", gt=0.0)
    symmetric: bool = option(True, "Average image->text and text->image InfoNCE.")
    label_smoothing: float = option(0.0, "Label smoothing of the InfoNCE targets.", ge=0.0, le=0.5)
    gather: bool = option(
        True,
        "Gather features across ranks (negatives from all ranks). "
        "Turning it off changes the loss with world size.",
    )
    hard_negatives: int = option(
        0,
        "Hard-negative texts per training record and epoch, drawn "
        "from its 'negatives' (fewer if it has fewer); they join the "
        "text side of the logits. objective.loss=qwen3vl gives each query its own and needs "
        "every training record to have at least this many.",
        ge=0,
    )
    caption_contrast: float = option(
        0.0,
        "Weight of a caption-caption InfoNCE added to the image-text loss (infonce, image-caption "
        "records): each training sample also draws a second caption of its image (another one "
        "when the record has several), and each caption must pick its image's other caption "
        "among the batch's second captions and the hard negatives (both ways, the loss's "
        "temperature, gathered across ranks, GradCache-chunked). Two wordings of one scene meet "
        "and a hard negative stays apart without waiting for the image tower. On the quickstart "
        "data 1.0 adds ~7 points of R@1, and 3.0 with each relation scene's caption inverted "
        "as its hard negative makes the text tower bind word order early enough for the image "
        "tower to learn relations (bench/RESULTS.md, 'Quickstart CLIP recipe, round 4'). Costs "
        "one more text forward per sample. 0: off.",
        ge=0.0,
    )
    grad_cache_chunk: int = option(
        0,
        "GradCache: encode the batch in chunks of this many rows "
        "(activation memory of one chunk; one extra forward). 0: off.",
        ge=0,
    )
    reading: float = option(
        0.0,
        "Weight of a dense reading loss on the positive and image-negative pages "
        "(vltrain.objectives.reading): "
        "each cell of the built-in vision tower's grid classifies the token drawn there, from "
        "the 'words' boxes the records list on their image sides (`vltrain data synth --kind "
        "pages` writes them). Contrastive training alone does not make a small tower read a "
        "page's words; with this loss it does (bench/RESULTS.md, 'Page retrieval'). Needs "
        "model.kind=dual_encoder, query/positive records with image positives and no "
        "GradCache. 0: off.",
        ge=0.0,
    )
    siglip_init_scale: float = option(
        10.0, "SigLIP: initial logit scale t (learned as log t when learn_temperature).", gt=0.0
    )
    siglip_init_bias: float = option(-10.0, "SigLIP: initial logit bias b (always learned).")


@dataclass
class OptimConfig:
    lr: float = option(5e-4, "Peak learning rate.", gt=0.0)
    min_lr_ratio: float = option(
        0.1, "Cosine/linear decay floor as a fraction of lr.", ge=0.0, le=1.0
    )
    schedule: str = option(
        "cosine", "LR schedule after warmup.", choices=("cosine", "linear", "constant")
    )
    warmup_steps: int = option(100, "Linear warmup steps.", ge=0)
    warmup_epochs: float = option(
        0.0, "Warmup in epochs (0: use warmup_steps); needs train.epochs.", ge=0.0
    )
    weight_decay: float = option(
        0.1, "AdamW weight decay (not on biases, norms, embeddings, temperature).", ge=0.0
    )
    betas: list[float] = option([0.9, 0.98], "AdamW betas.")
    eps: float = option(1e-6, "AdamW epsilon.", gt=0.0)
    implementation: str = option(
        "auto",
        "AdamW kernel: fused (one kernel over all parameters; on CPU 6x faster than the "
        "per-tensor loop), foreach, for_loop (PyTorch's per-tensor loop), or auto: fused where "
        "every parameter is a plain floating-point tensor on CPU or CUDA, else PyTorch's "
        "default (sharded DTensor parameters under FSDP2).",
        choices=("auto", "fused", "foreach", "for_loop"),
    )
    grad_clip: float = option(
        1.0,
        "Clip the global grad norm to this (0: no clipping; the "
        "pre-clip norm is logged either way).",
        ge=0.0,
    )
    accum_steps: int = option(1, "Micro-batches accumulated per optimizer step.", ge=1)
    lr_scale: dict[str, float] = option(
        {}, "Per-module LR multipliers by parameter-name prefix, e.g. {vision: 0.1}."
    )


@dataclass
class TrainConfig:
    max_steps: int = option(
        1000,
        "Optimizer steps to train (derived from train.max_samples or train.max_flops when one "
        "of them is set: the schedule then ends at that budget).",
        ge=1,
    )
    max_samples: int = option(
        0,
        "Training budget in samples (0: off): max_steps = ceil(N / global batch per step).",
        ge=0,
    )
    max_flops: float = option(
        0.0,
        "Training budget in FLOPs (0: off): max_steps = floor(budget / (training FLOPs per "
        "sample x samples per step)), FLOPs from vltrain.scaling.flops (docs/scaling.md).",
        ge=0.0,
    )
    epochs: int = option(
        0,
        "Epochs to train (0: off); exclusive with train.max_steps, which is then derived: "
        "floor(dataset size / (global batch x optim.accum_steps)) steps per epoch.",
        ge=0,
    )
    save_every_epoch: bool = option(False, "train.epochs: also checkpoint at each epoch's end.")
    eval_every: int = option(200, "Evaluate every N steps (0: only at the end).", ge=0)
    save_every: int = option(500, "Checkpoint every N steps (0: only at the end).", ge=0)
    keep_last: int = option(3, "Keep this many newest step checkpoints.", ge=1)
    async_save: bool = option(
        False,
        "Write checkpoints in the background (one in flight): the weights and optimizer state "
        "are copied to CPU during the next step (its optimizer step waits for the copy) and "
        "written by a thread; fsdp: torch.distributed.checkpoint's async_save.",
    )
    best_metric: str = option("", "Eval metric that picks checkpoints/best ('' = stage default).")
    best_mode: str = option(
        "", "'max' or 'min' for best_metric ('' = stage default).", choices=("", "max", "min")
    )
    resume: bool = option(
        False,
        "Continue the run in run.out_dir from its newest checkpoint that loads "
        "(`vltrain train RUN/config.yaml train.resume=true`); the config must equal the run's "
        "saved config.yaml except for keys in train.allow_changes and harmless ones (logging, "
        "workers, eval/save cadence).",
    )
    checkpoint_on: list[str] = option(
        [],
        "Signals that save a checkpoint at the next step boundary and continue training, e.g. "
        "[SIGUSR1] for SLURM's early warning (`#SBATCH --signal=USR1@90`); one of SIGUSR1, "
        "SIGUSR2. SIGTERM and SIGINT always save and stop.",
    )
    allow_changes: list[str] = option(
        [],
        "Resume: keys allowed to differ from the run's saved config (e.g. [train.max_steps]); "
        "'global_batch' allows another data.batch_size x world size. Each change is logged.",
    )
    overwrite: bool = option(
        False,
        "Start over in a run.out_dir that already holds a run: delete its checkpoints, "
        "tokenizer, metrics and summary first (without it, vltrain refuses).",
    )
    parallel: str = option(
        "auto",
        "How the model is spread over processes: auto (ddp under torchrun, else none), none, "
        "ddp (DistributedDataParallel), fsdp (FSDP2 per block; sharded checkpoints that "
        "reshard across world sizes; see docs/scaling_out.md).",
        choices=("auto", "none", "ddp", "fsdp"),
    )
    activation_checkpointing: bool = option(
        False, "Recompute each transformer block's activations in backward (less memory)."
    )
    compile: bool = option(False, "torch.compile each transformer block (compiles at start).")
    fsdp_cpu_offload: bool = option(
        False, "train.parallel=fsdp: keep sharded parameters and optimizer state in CPU memory."
    )
    log_every: int = option(10, "Log train metrics every N steps.", ge=1)
    max_consecutive_skips: int = option(
        5, "Abort after this many consecutive steps skipped for non-finite loss/grads.", ge=1
    )


@dataclass
class LogConfig:
    progress: bool = option(True, "Show a progress bar on rank 0.")
    tensorboard: bool = option(True, "Write TensorBoard events (if tensorboard is installed).")
    wandb: bool = option(False, "Log to Weights & Biases (WANDB_MODE=offline works offline).")
    wandb_mode: str = option(
        "auto",
        "W&B mode: auto (WANDB_MODE if set, else online when credentials exist and offline "
        "with a warning when not), online (refused at load without credentials), offline, "
        "disabled.",
        choices=("auto", "online", "offline", "disabled"),
    )
    wandb_project: str = option("vltrain", "W&B project name.")
    wandb_entity: str = option("", "W&B entity (team or user; '' = your default entity).")
    wandb_name: str = option("", "W&B run name ('' = the run folder's name).")
    wandb_tags: list[str] = option([], "W&B run tags.")
    wandb_group: str = option("", "W&B run group, e.g. one per sweep or pipeline ('' = none).")
    mlflow: bool = option(
        False,
        "Log to MLflow: params (the resolved config), metrics every logged step, the run's "
        "summary and config as artifacts; resume continues the same MLflow run.",
    )
    mlflow_uri: str = option(
        "",
        "MLflow tracking URI ('' = a store inside the run folder: sqlite at mlruns/mlflow.db, "
        "artifacts in mlruns/artifacts); e.g. http://host:5000 or sqlite:///PATH/mlflow.db.",
    )
    mlflow_experiment: str = option("vltrain", "MLflow experiment name.")


@dataclass
class DoctorConfig:
    enabled: bool = option(True, "Run the training doctor's online checks (docs/doctor.md).")
    fail_on: str = option(
        "never",
        "Abort training on a finding of this severity or worse (warn, error); never: only report.",
        choices=("never", "warn", "error"),
    )
    spike_window: int = option(100, "Spike checks: steps of history the median/MAD use.", ge=4)
    spike_sigma: float = option(
        6.0, "Spike checks: a value this many MADs above the median is a spike.", gt=0.0
    )
    spike_rise: float = option(
        0.5, "Spike checks: and at least this fraction above the median (0.5: 1.5x).", ge=0.0
    )
    min_history: int = option(10, "Spike checks: steps seen before spikes are judged.", ge=2)
    grad_spike_warn_rise: float = option(
        2.0,
        "Grad-norm spikes at least this fraction above the median (2.0: 3x) are warnings; "
        "smaller ones are info (single-batch 2x blips are common and harmless).",
        ge=0.0,
    )
    grad_spike_step_rise: float = option(
        2.0,
        "A grad-norm spike also has to jump this fraction over the previous step's norm to "
        "warn (2.0: 3x): a run climbing out of a collapse rises 1.4-2.7x a step for many steps "
        "over a collapsed median; a real spike jumps at once (0: no jump required).",
        ge=0.0,
    )
    grad_spike_clipped_warn_rise: float = option(
        9.0,
        "The same for a step whose pre-clip norm optim.grad_clip capped (9.0: 10x, Megatron's "
        "spiky factor): the clip bounded the update, so only a large outlier warns.",
        ge=0.0,
    )
    constant_steps: int = option(
        3, "Steps of loss exactly 0 / bit-identical / zero gradient before it is reported.", ge=2
    )
    max_update_ratio: float = option(
        0.5, "Warn when a param group's per-step update/weight norm ratio exceeds this.", gt=0.0
    )
    chance_steps: int = option(
        10, "Contrastive loss at chance: steps in a row past warmup before it is reported.", ge=2
    )
    chance_tolerance: float = option(
        0.01, "Contrastive loss at chance: within this fraction of the chance loss.", gt=0.0
    )
    chance_grad_drop: float = option(
        100.0,
        "Contrastive loss at chance: only when every grad norm of those steps is this many "
        "times below the largest of the first chance_steps steps (a run that learns keeps it).",
        gt=1.0,
    )
    write_steps: bool = option(
        True, "Write doctor_steps.jsonl (one StepRecord per step) for `vltrain doctor/report`."
    )


@dataclass
class TuneConfig:
    space: dict[str, dict[str, Any]] = option(
        {},
        "Search space: dotted config key -> {type: float|int|categorical, low, high, log, "
        "step, choices} (see docs/tuning.md).",
    )
    metric: str = option(
        "",
        "Eval metric to optimise as logged, e.g. eval_R@1_mean or "
        "eval_loss ('' = the stage's best metric).",
    )
    direction: str = option(
        "",
        "'maximize' or 'minimize' ('' = the stage's default; required for any other metric).",
        choices=("", "maximize", "minimize"),
    )
    trials: int = option(
        10,
        "Trials to finish (complete or pruned) in the study; failed ones "
        "do not count. `--trials` overrides.",
        ge=1,
    )
    max_steps: int = option(
        0, "Optimizer steps per trial (0: tune.epochs, else train.max_steps).", ge=0
    )
    epochs: int = option(
        0,
        "Epochs per trial over the training subset; then each trial "
        "evaluates once per epoch and pruner steps count epochs.",
        ge=0,
    )
    eval_every: int = option(
        0,
        "With step budgets: evaluate and report to the pruner every N steps (0: train.eval_every).",
        ge=0,
    )
    train_samples: int = option(
        0, "Train each trial on the first N training records (0: all).", ge=0
    )
    pruner: str = option(
        "median", "'median' (Optuna MedianPruner) or 'none'.", choices=("median", "none")
    )
    n_startup_trials: int = option(
        3, "Median pruner: prune nothing until this many trials have completed.", ge=0
    )
    n_warmup_steps: int = option(
        0, "Median pruner: never prune before this step (epochs when tune.epochs is set).", ge=0
    )
    sampler: str = option(
        "tpe",
        "Optuna sampler: 'tpe' or 'random' (seeded from run.seed).",
        choices=("tpe", "random"),
    )
    storage: str = option(
        "",
        "'' = SQLite file in the study dir; 'journal' or 'journal:PATH' = "
        "journal file (several workers, one host); a SQLAlchemy URL (many "
        "machines); 'env:VAR' = the URL in environment variable VAR.",
    )
    study: str = option(
        "",
        "Study name, a folder under run.out_dir ('' = new name from the "
        "config file and time); reuse a name to resume.",
    )
    enqueue: list[dict[str, Any]] = option(
        [], "Parameter sets to try first, e.g. [{optim.lr: 1.0e-3}]; missing keys are sampled."
    )
    max_failed_trials: int = option(
        3, "Stop the search after this many failed trials in a row.", ge=1
    )
    heartbeat_interval: int = option(
        60,
        "SQL storages: running trials beat every N s; one "
        "silent for 2N s is marked failed (0: off).",
        ge=0,
    )
    plots: bool = option(
        True,
        "Save optimisation history, importances and intermediate "
        "values plots (HTML and PNG) in the study dir.",
    )


@dataclass
class CaptionConfig:
    mode: str = option(
        "pretrain",
        "Caption stage mode: pretrain (captions, usually connector only), finetune (captions, "
        "all parts), sft (chat records; loss on assistant tokens only). See docs/captioning.md.",
        choices=("pretrain", "finetune", "sft"),
    )
    prompt: str = option(
        "", "pretrain/finetune: text put before every caption (no loss on it); '' = just <bos>."
    )
    instruction: str = option(
        "describe the image.",
        "sft: the user turn used for plain caption records (records without 'messages').",
    )
    strategy: str = option(
        "greedy", "Eval decoding strategy for BLEU/CIDEr-D.", choices=("greedy", "beam")
    )
    num_beams: int = option(3, "Beam search width (strategy=beam).", ge=1)
    max_new_tokens: int = option(
        24, "Eval decoding: most new tokens per caption (capped by the decoder context).", ge=1
    )
    length_penalty: float = option(1.0, "Beam search length penalty (HF semantics).")
    eval_beam: bool = option(
        False,
        "Also report beam-search BLEU/CIDEr-D (eval_beam_*) next to caption.strategy's (the "
        "rl stage always decodes greedily first).",
    )


@dataclass
class RLConfig:
    k: int = option(4, "rl: captions sampled per image each step.", ge=1)
    temperature: float = option(1.0, "rl: sampling temperature.", gt=0.0)
    top_p: float = option(
        0.9, "rl: nucleus sampling mass (1.0: unbiased on-policy estimator).", gt=0.0, le=1.0
    )
    max_new_tokens: int = option(
        16, "rl: most sampled tokens per caption (capped by the decoder context).", ge=1
    )
    reward: str = option(
        "cider",
        "rl: reward against all references: CIDEr-D (df from the training references), "
        "sentence BLEU-4, or a weighted mix (rl.reward_weights).",
        choices=("cider", "bleu4", "mix"),
    )
    reward_weights: dict[str, float] = option(
        {}, "rl: reward=mix weights, e.g. {cider: 1.0, bleu4: 0.5} ({}: 1 each)."
    )
    baseline: str = option(
        "ema",
        "rl: advantage baseline: ema (moving average of the global mean reward), greedy "
        "(self-critical: reward of the greedy caption; one extra decode), loo or rloo "
        "(leave-one-out over the k samples, TRL's RLOO), grpo (group-normalised: "
        "(r - group mean) / (group std + 1e-4), TRL's GRPO).",
        choices=("ema", "greedy", "loo", "rloo", "grpo"),
    )
    scale_rewards: str = option(
        "group",
        "rl: baseline=grpo only: divide by the group's unbiased reward std (group) or not (none: "
        "Dr. GRPO); TRL's scale_rewards.",
        choices=("group", "none"),
    )
    ema_decay: float = option(0.9, "rl: decay of the ema baseline (below 1).", ge=0.0, le=0.9999)
    kl_coeff: float = option(
        0.0, "rl: weight of KL(policy || frozen reference) in the loss (logged always).", ge=0.0
    )
    entropy_coeff: float = option(0.0, "rl: weight of the entropy bonus.", ge=0.0)
    length_penalty: float = option(
        0.0,
        "rl: reward -= length_penalty * tokens (the caption's sampled tokens, EOS not counted), "
        "or * |tokens - length_target| when length_target > 0; 0: off.",
        ge=0.0,
    )
    length_target: int = option(
        0, "rl: caption length in tokens the length penalty pulls towards (0: none).", ge=0
    )
    normalize: str = option(
        "token",
        "rl: loss terms averaged over sampled tokens (token) or summed per sequence and "
        "averaged over sequences (sequence; retune coefficients).",
        choices=("token", "sequence"),
    )


@dataclass
class DrafterConfig:
    block_size: int = option(8, "Drafter: positions per block (anchor + block_size - 1).", ge=2)
    layers: int = option(1, "Drafter: decoder layers.", ge=1)
    heads: int = option(0, "Drafter: attention heads (0: width // 64, at least 2).", ge=0)
    mlp_ratio: float = option(2.0, "Drafter: SwiGLU hidden size / width.", gt=0.0)
    arch: str = option(
        "auto",
        "Drafter layers: dflash (Qwen3 layers with q/k norm, eps 1e-6, the target's embedding "
        "of the mask token: the architecture the speculators (vLLM) and DFlash (SGLang) formats "
        "describe, so `vltrain export --format speculators|dflash` can write it), vltrain (a "
        "learned mask embedding, no q/k norm; decoded by vltrain only), or auto: dflash for an "
        "HF causal LM target (model.kind hf_lm), vltrain for a captioner or an HF VLM, which "
        "those formats do not describe.",
        choices=("auto", "vltrain", "dflash"),
    )
    target_layers: int = option(
        3, "Drafter: target layers read (evenly spaced over [1, L-3], DFlash's rule).", ge=1
    )
    layer_ids: list[int] = option([], "Drafter: explicit target layer ids (overrides the rule).")
    noise: float = option(
        0.0,
        "Drafter: std of Gaussian noise on the target features it reads (training only).",
        ge=0.0,
    )
    noise_warmup_steps: int = option(
        0, "Drafter: optimizer steps over which drafter.noise ramps linearly up from 0.", ge=0
    )
    gamma: float = option(
        0.0,
        "Drafter: position-weight decay w_k = exp(-(k-1)/gamma); 0 derives it from block_size "
        "(8 -> 4, 16 -> 7; objectives.drafter.default_gamma). 10 suits tree deployment.",
        ge=0.0,
    )
    dpace: float = option(
        0.0, "Drafter: D-PACE alpha (0: off; 0.5 as in the paper).", ge=0.0, le=1.0
    )
    soft_labels: bool = option(False, "Drafter: CE against the target's own distribution.")
    soft_top_k: int = option(
        0,
        "Drafter soft labels: keep the target's k most likely tokens per position, "
        "renormalised (0: its whole distribution). Needed (> 0) with cache_target or "
        "cache_dir, which store those k log-probabilities with the features.",
        ge=0,
    )
    cache_target: bool = option(
        False,
        "Drafter: compute each record's target features once (alone, unpadded) and keep them "
        "in memory for later epochs (vltrain.inference.feature_cache); with soft_labels, also "
        "the target's top soft_top_k log-probabilities per position.",
    )
    cache_dir: str = option(
        "",
        "Drafter: also keep the cached target features on disk in this folder (one subfolder "
        "per target weights and layers, one file per sequence), so later runs of the same "
        "target (another block size, gamma or draft vocabulary; a resume; other ranks) read "
        "them instead of running the target. Implies cache_target.",
    )
    draft_vocab: int = option(
        0,
        "Drafter: score only the N most frequent tokens of the training labels (EAGLE-3's "
        "reduced draft vocabulary; 0: the whole vocabulary). The LM-head cost of training and "
        "of every decoding round shrinks by N / V; tokens outside are never drafted (decoding "
        "stays lossless) and count as misses (eval_vocab_coverage). N >= the target's "
        "vocabulary: the whole vocabulary (said).",
        ge=0,
    )
    anchors: int = option(64, "Drafter: anchors sampled per training sequence (0: all).", ge=0)
    chunk_blocks: int = option(
        32, "Drafter: blocks per loss chunk (checkpointed; memory flat in anchors).", ge=1
    )
    eval_prompts: int = option(
        16,
        "Drafter eval: held-out prompts decoded speculatively with the target (tau_decode).",
        ge=0,
    )
    eval_max_new_tokens: int = option(48, "Drafter eval: new tokens per decoded prompt.", ge=1)
    eval_tree_budget: int = option(
        0, "Drafter eval: also decode with a DDTree of this many nodes (0: chain only).", ge=0
    )
    min_label_agreement: float = option(
        0.95,
        "Drafter: flag (eval_labels_not_target=1 and a warning) when fewer supervised labels "
        "than this equal the target's greedy token: training tau then is not deployment tau.",
        ge=0.0,
        le=1.0,
    )


@dataclass
class Config:
    stage: str = option(
        "contrastive",
        "Stage registry key (vltrain.stages.STAGES): contrastive, caption, rl, drafter.",
    )
    run: RunConfig = section(RunConfig, "Run directory, seed, device and precision.")
    data: DataConfig = section(DataConfig, "Records, batching and decoding.")
    model: ModelConfig = section(ModelConfig, "Model architecture.")
    objective: ObjectiveConfig = section(ObjectiveConfig, "Loss.")
    optim: OptimConfig = section(OptimConfig, "Optimizer and learning-rate schedule.")
    train: TrainConfig = section(TrainConfig, "Loop length, evaluation, checkpoints, resume.")
    log: LogConfig = section(LogConfig, "Progress bar, TensorBoard, W&B, MLflow.")
    doctor: DoctorConfig = section(DoctorConfig, "Online training checks (the doctor).")
    tune: TuneConfig = section(TuneConfig, "Hyperparameter search (`vltrain tune`).")
    caption: CaptionConfig = section(CaptionConfig, "Caption stage: mode, prompts, eval decoding.")
    rl: RLConfig = section(RLConfig, "RL stage (REINFORCE on the captioner): sampling, reward.")
    drafter: DrafterConfig = section(DrafterConfig, "Drafter stage: block drafter, loss, eval.")


#: model kinds whose ops run under fp16 autocast on CPU (tests/engine/test_fp16.py)
FP16_CPU_KINDS = ("dual_encoder", "captioner")


def _check_fp16(cfg: Config) -> None:
    if cfg.run.precision != "fp16" or cfg.model.kind in FP16_CPU_KINDS:
        return
    import torch

    if cfg.run.device == "cpu" or (cfg.run.device == "auto" and not torch.cuda.is_available()):
        raise ConfigError(
            f"run.precision=fp16 on CPU supports model.kind in {list(FP16_CPU_KINDS)}, not "
            f"{cfg.model.kind!r}: use run.precision=bf16 (or fp32) on CPU, or a CUDA device"
        )


def _check_epochs(cfg: Config) -> None:
    t = cfg.train
    if t.epochs and (t.max_samples or t.max_flops):
        raise ConfigError("'train.epochs' and a budget (train.max_samples/max_flops): pick one")
    if t.save_every_epoch and not t.epochs:
        raise ConfigError("'train.save_every_epoch' needs 'train.epochs' (epochs are not counted)")
    if cfg.optim.warmup_epochs and not t.epochs:
        raise ConfigError("'optim.warmup_epochs' needs 'train.epochs'; else use optim.warmup_steps")


#: signals `train.checkpoint_on` may name (a checkpoint, then training goes on)
CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2")


def _check_allow_changes(entries: list[str]) -> None:
    """Each `train.allow_changes` entry is a config key (a mapping's, e.g. optim.lr_scale, with
    its sub-keys) or global_batch: a misspelt one allows nothing, and the resume refused the
    change with no word on why the entry did not count."""
    keys = value_keys(Config)
    mappings = tuple(f"{k}." for k, tp in keys.items() if typing.get_origin(tp) is dict)
    for entry in entries:
        if entry != "global_batch" and entry not in keys and not entry.startswith(mappings):
            raise ConfigError(
                f"'train.allow_changes' entry {entry!r} is neither a config key nor "
                f"global_batch{did_you_mean(entry, [*keys, 'global_batch'])}"
            )


def validate_cross_fields(cfg: Config) -> None:
    """Rules that involve more than one field."""
    if not cfg.run.out_dir.strip():
        raise ConfigError("'run.out_dir' is empty: name a folder for the run")
    if cfg.train.resume and cfg.train.overwrite:
        raise ConfigError("'train.resume' and 'train.overwrite' contradict each other: pick one")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"'optim.betas' must be two numbers in [0, 1), got {cfg.optim.betas}")
    if cfg.train.max_samples and cfg.train.max_flops:
        raise ConfigError(
            "'train.max_samples' and 'train.max_flops' are both set: a run has one budget"
        )
    _check_epochs(cfg)
    budget = bool(cfg.train.max_samples or cfg.train.max_flops or cfg.train.epochs)
    if not budget and cfg.optim.warmup_steps > cfg.train.max_steps:
        raise ConfigError(
            f"'optim.warmup_steps' ({cfg.optim.warmup_steps}) exceeds 'train.max_steps' "
            f"({cfg.train.max_steps}); lower the warmup"
        )
    if cfg.train.best_metric and not cfg.data.eval:
        raise ConfigError("'train.best_metric' is set but 'data.eval' is empty: nothing to rank")
    bad = [s for s in cfg.train.checkpoint_on if s not in CHECKPOINT_SIGNALS]
    if bad:
        raise ConfigError(
            f"'train.checkpoint_on' takes signal names from {list(CHECKPOINT_SIGNALS)}, got "
            f"{bad}; SIGTERM and SIGINT always save and stop"
        )
    _check_allow_changes(cfg.train.allow_changes)
    for key, scale in cfg.optim.lr_scale.items():
        if scale < 0:
            raise ConfigError(f"'optim.lr_scale.{key}' must be >= 0, got {scale}")
    if cfg.data.max_visual_tokens and cfg.model.kind not in ("vlm", "hf_vlm"):
        raise ConfigError(
            "'data.max_visual_tokens' applies to model.kind vlm or hf_vlm (patch-grid VLMs)"
        )
    if cfg.model.matryoshka_dims and cfg.model.kind != "vlm":
        raise ConfigError("'model.matryoshka_dims' applies to model.kind=vlm")
    dims = cfg.model.matryoshka_dims
    if any(d < 1 for d in dims) or any(a >= b for a, b in zip(dims, dims[1:], strict=False)):
        raise ConfigError(
            f"'model.matryoshka_dims' must be prefix sizes >= 1 in increasing order, got {dims}; "
            f"e.g. {sorted({max(d, 1) for d in dims})}"
        )
    _check_fp16(cfg)
    hub_ids.pin_splits(cfg.data)


def _run_length(file_tree: dict, over: dict) -> dict:
    """Merge the YAML and the overrides, with one run length: `train.epochs` or
    `train.max_steps`. An override of one replaces the other from the file (`vltrain train
    configs/clip.yaml train.epochs=3`); both in one layer is an error, except in a run's own
    config.yaml resumed (it records the max_steps its epochs derived, derived again)."""
    tree = deep_merge(file_tree, over)
    f, o, train = file_tree.get("train"), over.get("train"), tree.get("train")
    if not all(isinstance(x, dict | None) for x in (f, o, train)) or train is None:
        return tree  # no train section, or a malformed one: build() names the mistake
    f, o, train = f or {}, o or {}, dict(train)
    tree["train"] = train
    both = bool(o.get("epochs")) and "max_steps" in o
    if o.get("epochs") and not both:
        train.pop("max_steps", None)
    elif "max_steps" in o and f.get("epochs"):
        train["epochs"] = 0
    else:
        both = both or (bool(f.get("epochs")) and "max_steps" in f and not train.get("resume"))
    if both:
        raise ConfigError(
            "'train.epochs' and 'train.max_steps' are both set: a run's length is one of them; "
            "drop train.max_steps (derived from the dataset's size; a run's config.yaml records "
            "it, and train.resume=true derives it again)"
        )
    return tree


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Defaults -> YAML file -> dotted overrides, merged once and validated."""
    tree = load_yaml(path) if path else {}
    tree = _run_length(tree, parse_overrides(overrides or []))
    cfg = build(Config, tree)
    validate_cross_fields(cfg)
    return cfg


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config; loading it back reproduces the run.

    What was asked of the run folder this time (train.resume, train.overwrite,
    train.allow_changes) is an action, not part of the run, and is written as its default, so
    `vltrain train RUN/config.yaml train.resume=true` always works.
    """
    tree = to_dict(cfg)
    tree["train"].update(resume=False, overwrite=False, allow_changes=[])
    tmp = Path(path).with_name(Path(path).name + ".tmp")  # a kill leaves the old or the new file
    with open(tmp, "w") as f:
        f.write(yaml.safe_dump(tree, sort_keys=False))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
