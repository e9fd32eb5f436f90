"""One-call GPU readiness check: run it once on a GPU machine, get one table (about 5 minutes).

    python bench/gpu_check.py                  # every check; GPU parts skip, saying so, on CPU
    python bench/gpu_check.py --only clip_mfu  # one check
    python bench/gpu_check.py --peak-tflops 989  # the GPU's dense bf16 peak, for the MFU

Checks (each row: check, status ok|FAILED|skipped, result, seconds):

- env: torch / CUDA / GPUs;
- stage_<name>: 3 bf16 steps of each shipped stage preset on CUDA (synthetic data), through
  the `vltrain train` CLI (rl starts from the caption run);
- nccl_fsdp: an NCCL process group over every visible GPU (all_reduce checked), then FSDP2
  (`engine/sharding.py`) on a tiny dual encoder, with and without CPU offload: two steps
  equal an unsharded copy;
- fsdp_cli: `torchrun --nproc_per_node=<GPUs> -m vltrain train configs/clip.yaml
  train.parallel=fsdp` on CUDA, bf16;
- grad_cache_qwen3vl2b: GradCache (chunks of 8 of 32 texts) through a randomly initialised
  Qwen3-VL-2B-sized language model (no weights downloaded): step time and peak memory;
- clip_mfu: a CLIP ViT-B/16 training step (batch 128, bf16 autocast, AdamW): FLOPs from
  torch's FlopCounterMode, MFU against --peak-tflops, peak memory, open_clip's ViT-B-16
  side by side when open_clip is installed;
- drafter: skipped until vltrain has a drafter stage.
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
Row = tuple[str, str, str]  # status, result, (filled in) seconds


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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

        synth_command(str(data), 64, 16, 0, 0)
    return data


def _train_cmd(preset: str, out: Path, data: Path, *extra: str, nproc: int = 1) -> list[str]:
    head = [sys.executable, "-m", "vltrain"]
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        head += [f"--nproc_per_node={nproc}", "-m", "vltrain"]
    over = [f"run.out_dir={out}", f"data.train={data / 'train.jsonl'}"]
    over += [f"data.eval={data / 'val.jsonl'}", "data.num_workers=2", "train.max_steps=3"]
    over += ["train.eval_every=0", "train.save_every=0", "log.progress=false"]
    over += ["log.tensorboard=false", "run.device=cuda", "run.precision=bf16", "data.test="]
    return [*head, "train", str(PRESETS / preset), *over, *extra]


def _stage_check(preset: str, name: str, *extra: str) -> Callable[[argparse.Namespace], tuple]:
    def check(args: argparse.Namespace) -> tuple[str, str]:
        if not _gpus():
            return _no_gpu()
        out = args.work / f"stage_{name}"
        res = _run(_train_cmd(preset, out, _synth(args.work), "train.overwrite=true", *extra), 240)
        if res.returncode:
            return "FAILED", _tail(res)
        s = json.loads((out / "summary.json").read_text())
        return "ok", f"{s['steps']} bf16 steps in {s['train_seconds']} s (incl. first-step warmup)"

    return check


def check_nccl_fsdp(args: argparse.Namespace) -> tuple[str, str]:
    if not _gpus():
        return _no_gpu()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={_gpus()}", __file__, "--nccl-worker"]
    res = _run(cmd, 240)
    return ("ok" if res.returncode == 0 else "FAILED"), _tail(res)


def nccl_worker() -> None:
    """Under torchrun: NCCL all_reduce, then FSDP2 vs an unsharded copy on this rank's GPU."""
    from vltrain.engine import distributed as D
    from vltrain.engine import sharding
    from vltrain.models.dual_encoder import DualEncoder
    from vltrain.models.presets import text_config, vision_config

    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(D.local_rank())
    torch.distributed.init_process_group("nccl")
    world, rank = D.world_size(), D.rank()
    total = D.all_reduce_sum(torch.ones(1, device="cuda"))
    assert int(total.item()) == world, f"all_reduce gave {total.item()}, expected {world}"
    torch.manual_seed(0)
    make = lambda: DualEncoder(  # noqa: E731
        vision_config("tiny", image_size=64), text_config("tiny", vocab_size=256), 64
    ).cuda()
    ref, model, off = make(), make(), make()
    model.load_state_dict(ref.state_dict())
    off.load_state_dict(ref.state_dict())
    sharding.apply_fsdp(model, world, None, offload=False)
    sharding.apply_fsdp(off, world, None, offload=True)  # shards + optimizer state in CPU RAM
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model, off)]
    for step in range(2):
        g = torch.Generator(device="cuda").manual_seed(step)
        images = torch.randn(2 * world, 3, 64, 64, device="cuda", generator=g)
        ids = torch.randint(1, 256, (2 * world, 16), device="cuda", generator=g)
        mine = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        runs = ((ref, opts[0], slice(None)), (model, opts[1], mine), (off, opts[2], mine))
        for m, opt, rows in runs:
            img = m.encode_image(images[rows])
            txt = m.encode_text(ids[rows], torch.ones_like(ids[rows]))
            (img * txt).sum(-1).mean().backward()
            opt.step()
            opt.zero_grad()
    diffs = {}
    for name, m in (("FSDP2", model), ("FSDP2 + CPU offload", off)):
        full = sharding.full_state_dict(m)
        ref_sd = ref.state_dict()
        diffs[name] = max(float((full[k] - v.cpu()).abs().max()) for k, v in ref_sd.items())
    if rank == 0:
        said = ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
        print(f"NCCL over {world} GPU(s) ok; vs unsharded after 2 steps, max diff: {said}")
    torch.distributed.destroy_process_group()
    for name, diff in diffs.items():
        if diff > 1e-4:
            raise SystemExit(f"{name} differs from the unsharded model by {diff}")


def check_fsdp_cli(args: argparse.Namespace) -> tuple[str, str]:
    if not _gpus():
        return _no_gpu()
    out = args.work / "fsdp_cli"
    extra = ("train.parallel=fsdp", "train.overwrite=true", "train.save_every=3")
    res = _run(_train_cmd("clip.yaml", out, _synth(args.work), *extra, nproc=_gpus()), 300)
    if res.returncode:
        return "FAILED", _tail(res)
    sharded = (out / "checkpoints" / "step_3" / "shards" / ".metadata").is_file()
    return "ok", f"{_gpus()} rank(s), sharded checkpoint written: {sharded}"


def _peak_mem_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def check_grad_cache_qwen3vl(args: argparse.Namespace) -> tuple[str, str]:
    if not _gpus():
        return _no_gpu()
    try:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    except ImportError as e:
        return "skipped", f"transformers has no Qwen3-VL ({e})"
    from vltrain.objectives.grad_cache import grad_cache

    text = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28)
    text |= dict(num_attention_heads=16, num_key_value_heads=8, vocab_size=151936)
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16)
    lm = model.model.language_model
    n_params = sum(p.numel() for p in model.parameters()) / 1e9

    def encode(ids: torch.Tensor) -> torch.Tensor:
        h = lm(input_ids=ids).last_hidden_state[:, -1].float()  # (b, D)
        return torch.nn.functional.normalize(h, dim=-1)

    def loss_fn(q: torch.Tensor, d: torch.Tensor):  # noqa: ANN202
        logits = q @ d.T / 0.05
        return torch.nn.functional.cross_entropy(logits, torch.arange(len(q), device="cuda")), {}

    ids = torch.randint(0, 151936, (2, 32, 64), device="cuda")  # (side, B, T)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        chunks = [list(ids[s].split(8)) for s in range(2)]
        grad_cache([encode, encode], chunks, loss_fn)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return "ok", (
        f"{n_params:.2f} B params, batch 32 x 64 tokens in chunks of 8: "
        f"{min(times[1:]):.2f} s/step, peak {_peak_mem_gib():.1f} GiB"
    )


def _clip_step_stats(model: torch.nn.Module, step: Callable[[], None]) -> tuple[float, float]:
    """(FLOPs of one step, median seconds of 5 steps after 2 warmup)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(counter.get_total_flops()), sorted(times)[2]


def check_clip_mfu(args: argparse.Namespace) -> tuple[str, str]:
    if not _gpus():
        return _no_gpu()
    from vltrain.models.dual_encoder import DualEncoder
    from vltrain.models.presets import text_config, vision_config
    from vltrain.objectives.contrastive import Features, InfoNCELoss

    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    b = 128
    images = torch.randn(b, 3, 224, 224, device="cuda")
    ids = torch.randint(1, 49408, (b, 77), device="cuda")
    torch.manual_seed(0)
    model = DualEncoder(vision_config("base"), text_config("base", vocab_size=49408), 512).cuda()
    loss = InfoNCELoss().cuda()
    opt = torch.optim.AdamW([*model.parameters(), *loss.parameters()], lr=1e-4)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img = model.encode_image(images)  # (B, E)
            f = Features(img, model.encode_text(ids, torch.ones_like(ids)), None)
            out, _ = loss.loss_from_features(f)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    flops, sec = _clip_step_stats(model, step)
    mfu = f"{100 * flops / sec / (peak * 1e12):.1f}%" if peak else "n/a (pass --peak-tflops)"
    result = f"vltrain {sec * 1e3:.0f} ms/step, MFU {mfu}, peak {_peak_mem_gib():.1f} GiB"
    try:
        import open_clip
    except ImportError:
        return "ok", result + "; open_clip not installed (pip install open_clip_torch)"
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

    torch.cuda.reset_peak_memory_stats()
    oc_flops, oc_sec = _clip_step_stats(oc, oc_step)
    oc_mfu = f"{100 * oc_flops / oc_sec / (peak * 1e12):.1f}%" if peak else "n/a"
    return "ok", result + (
        f"; open_clip {oc_sec * 1e3:.0f} ms/step, MFU {oc_mfu}, peak {_peak_mem_gib():.1f} GiB"
    )


def check_drafter(args: argparse.Namespace) -> tuple[str, str]:
    from vltrain.stages import STAGES

    if "drafter" not in STAGES:
        return "skipped", "vltrain has no drafter stage yet (speculative speed-up not measured)"
    return "skipped", "a drafter stage exists but this check has not been written for it yet"


CHECKS: dict[str, Callable[[argparse.Namespace], tuple[str, str]]] = {
    "env": check_env,
    "stage_contrastive": _stage_check("clip.yaml", "contrastive"),
    "stage_caption": _stage_check("caption_pretrain.yaml", "caption"),
    "nccl_fsdp": check_nccl_fsdp,
    "fsdp_cli": check_fsdp_cli,
    "grad_cache_qwen3vl2b": check_grad_cache_qwen3vl,
    "clip_mfu": check_clip_mfu,
    "drafter": check_drafter,
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
    p.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nccl_worker:
        nccl_worker()
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
            except Exception as e:  # noqa: BLE001 - one failing check must not hide the rest
                status, result = "FAILED", f"{type(e).__name__}: {str(e)[:150]}"
            rows.append((name, status, result.replace("|", "/"), time.perf_counter() - t))
            print(f"gpu_check: {name}: {status}", file=sys.stderr, flush=True)
    print(table(rows))
    return 1 if any(s == "FAILED" for _, s, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
