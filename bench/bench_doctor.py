"""Fault-injection benchmark of the training doctor, side by side with peer spike rules.

Plants one fault per tiny CPU run (shapes data, built-in models), records the step the
doctor first reports a warn-or-worse finding (``detected_at``) against the fault's onset, and
checks clean runs for false alarms. On the same runs' loss / grad-norm series it applies the
LLM Foundry ``KillLossSpike`` rule (loss > 2x the mean of the last 100 steps) and the OLMo-core
rule (> 6 sigma over the last 128 steps), as implemented here from their documentation.

    PYTHONPATH=. python bench/bench_doctor.py --out bench/out/doctor [--only NAME]
    PYTHONPATH=. python bench/bench_doctor.py --out bench/out/doctor --clean [--quickstart DIR]

``--clean`` runs only the clean runs (each past warmup + the doctor's min_history, so every
check judges) and the reduced quickstart, and tabulates each run's warn-or-error findings in
OUT/clean.md.

Two-process runs use torchrun (gloo); the script re-invokes itself as `--ddp-worker`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vltrain.config import load_config  # noqa: E402
from vltrain.data import samplers  # noqa: E402
from vltrain.diagnostics import doctor as doctor_mod  # noqa: E402
from vltrain.diagnostics import probe as probe_mod  # noqa: E402
from vltrain.engine import loop  # noqa: E402
from vltrain.engine.task import StepOutput  # noqa: E402
from vltrain.stages import check_config  # noqa: E402

STEPS = 10  # clean runs and onset-0 faults; mid-run spike faults use 16
ONSET = 12  # mid-run faults start here (after the spike rules' minimum history)
CHANCE_ONSET = 20  # blank images from here: after the learning recipe has left chance


def contrastive(data: Path, out: Path, **extra: Any) -> list[str]:
    base = {
        "run.out_dir": out, "data.train": data / "train.jsonl", "data.eval": "",
        "data.batch_size": 8, "data.num_workers": 0, "data.tokenizer_vocab": 400,
        "data.image_size": 32,
        "train.max_steps": STEPS, "train.eval_every": 0, "train.save_every": 0,
        "train.log_every": 1, "optim.warmup_steps": 2, "log.progress": False,
        "log.tensorboard": False,
    }  # fmt: skip
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# Batch 8 of the tiny dual encoder collapses at the LR peak and never leaves chance (loss ln 8,
# grad norm down ~500x, train accuracy 1/8: the doctor's contrastive_chance finds it); at a
# global batch of 32 it sits at chance for ~7 steps and then learns (3.47 -> 3.15 by step 29).
# Clean contrastive runs and the contrastive collapse fault use this recipe.
LEARNING_CLIP = {"data.batch_size": 32}


def learning_contrastive(data: Path, out: Path, **extra: Any) -> list[str]:
    return contrastive(data, out, **{**LEARNING_CLIP, **extra})


def caption(data: Path, out: Path, **extra: Any) -> list[str]:
    """The built-in captioner (its tiny vision preset takes 64x64 images)."""
    base = {
        "stage": "caption", "run.out_dir": out, "data.train": data / "train.jsonl",
        "data.eval": "", "data.batch_size": 8, "data.num_workers": 0, "data.image_size": 64,
        "data.tokenizer_vocab": 400, "data.max_text_len": 32, "model.kind": "captioner",
        "model.connector": "projector", "model.freeze": "[]", "model.init_from": "",
        "caption.mode": "finetune", "caption.max_new_tokens": 6, "caption.num_beams": 2,
        "train.max_steps": STEPS, "train.eval_every": 0, "train.save_every": 0,
        "train.log_every": 1, "optim.warmup_steps": 1, "optim.lr": 2e-3,
        "log.progress": False, "log.tensorboard": False,
    }  # fmt: skip
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@dataclass
class Scenario:
    name: str
    overrides: Callable[[Path, Path], list[str]]
    onset: int = 0
    install: Callable[[Any], None] | None = None  # (trainer) before run()
    on_step: Callable[[int, Any], None] | None = None  # (step, trainer) before set_lr
    patches: Callable[[], contextlib.AbstractContextManager] | None = None
    ddp: bool = False
    steps: int = STEPS
    preset: Path | None = None  # a shipped YAML the overrides apply to (None: the defaults)


class Hooks:
    """The benchmark's one per-step hook: wraps engine.loop.set_lr (called once per step)."""

    trainer: Any = None
    scenario: Scenario | None = None
    real_set_lr = staticmethod(loop.set_lr)

    @classmethod
    def set_lr(cls, optimizer, step, max_steps, cfg):
        sc = cls.scenario
        lr = cls.real_set_lr(optimizer, step, max_steps, cfg)
        if sc is not None and sc.on_step is not None:
            sc.on_step(step, cls.trainer)
        return lr


def _onset() -> int:
    return Hooks.scenario.onset if Hooks.scenario is not None else ONSET


def _wrap_fb(trainer, fn: Callable) -> None:
    """Replace the stage's forward_backward with fn(real, model, batch, scale, step)."""
    real = trainer.stage.forward_backward

    def fb(model, batch, scale):
        return fn(real, model, batch, scale, trainer.state.step)

    trainer.stage.forward_backward = fb


def _scale_loss(trainer):
    def fn(real, model, batch, scale, step):
        k = 6.0 if step == _onset() else 1.0  # a hard-coded loss weight for one step
        out = real(model, batch, scale * k)
        return StepOutput(out.loss * k, out.metrics)

    _wrap_fb(trainer, fn)


def _grad_spike(trainer):
    def fn(real, model, batch, scale, step):
        out = real(model, batch, scale)
        if step == _onset():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(50.0)
        return out

    _wrap_fb(trainer, fn)


def _nan(trainer):
    def fn(real, model, batch, scale, step):
        if step == _onset():
            batch = {**batch, "images": batch["images"] * float("inf")}
        return real(model, batch, scale)

    _wrap_fb(trainer, fn)


def _blank_images(trainer):
    def fn(real, model, batch, scale, step):
        if step >= _onset():  # a decode/normalisation bug: every image the same (black)
            batch = {**batch, "images": torch.zeros_like(batch["images"])}
        return real(model, batch, scale)

    _wrap_fb(trainer, fn)


def _zero_weight(trainer):
    def fn(real, model, batch, scale, step):
        w = 0.0 if step >= _onset() else 1.0
        out = real(model, batch, scale * w)
        return StepOutput(out.loss * w, out.metrics)

    _wrap_fb(trainer, fn)


def _mask_all_labels(trainer):
    def fn(real, model, batch, scale, step):
        if step >= _onset():  # tokenisation/label-mask mismatch: nothing labelled
            batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
        return real(model, batch, scale)

    _wrap_fb(trainer, fn)


def _freeze_vision(trainer):
    real = trainer.stage.build_model

    def build():
        m = real()
        m.vision.requires_grad_(False)  # the frozen tower nobody asked for
        return m

    trainer.stage.build_model = build


def _kill_gates(trainer):
    real = trainer.stage.build_model

    def build():
        m = real()
        for mod in m.modules():
            if type(mod).__name__ == "TanhGate":
                mod.scale.register_hook(lambda g: g * 0)  # the gate never gets a gradient
        return m

    trainer.stage.build_model = build


@contextlib.contextmanager
def _optimizer_without_vision() -> Iterator[None]:
    real = loop.build_optimizer

    def build(module, cfg):
        opt = real(module, cfg)
        vision = {id(p) for p in module.vision.parameters()}
        for g in opt.param_groups:
            g["params"] = [p for p in g["params"] if id(p) not in vision]
        return opt

    loop.build_optimizer = build
    try:
        yield
    finally:
        loop.build_optimizer = real


@contextlib.contextmanager
def _same_order_every_epoch() -> Iterator[None]:
    real = samplers.ShardedBatchSampler.permutation
    samplers.ShardedBatchSampler.permutation = lambda self, epoch: real(self, 0)
    try:
        yield
    finally:
        samplers.ShardedBatchSampler.permutation = real


@contextlib.contextmanager
def _uncapped_buckets() -> Iterator[None]:
    """The sampler's epoch order bucket by bucket (sorted by bucket id, stable) while it still
    reports the cap as applied: what a repair pass that never runs would leave."""
    cls = samplers.LengthBucketBatchSampler
    real = cls._epoch

    def uncapped(self, epoch):
        groups, rows, limit = real(self, epoch)
        order = sorted(range(len(groups)), key=lambda i: groups[i])
        return [groups[i] for i in order], rows[torch.tensor(order)], limit

    cls._epoch = uncapped
    try:
        yield
    finally:
        cls._epoch = real


def one_caption_data(data: Path) -> Path:
    """The training records with their first caption only (so a sample's length is fixed)."""
    out = data / "train_one_caption.jsonl"
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    for r in rows:
        r["text"] = [r["text"][0]] if isinstance(r["text"], list) else [r["text"]]
        if r.get("caption_negatives"):  # one list per caption: keep the first caption's
            r["caption_negatives"] = r["caption_negatives"][:1]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@contextlib.contextmanager
def _length_sorted_sampler(data: Path) -> Iterator[None]:
    """A 'shuffle' that returns the records sorted by caption length (homogeneous batches)."""
    rows = [json.loads(x) for x in one_caption_data(data).read_text().splitlines()]
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["text"][0].split()), i))
    real = samplers.ShardedBatchSampler.permutation
    samplers.ShardedBatchSampler.permutation = lambda self, epoch: torch.tensor(order)
    try:
        yield
    finally:
        samplers.ShardedBatchSampler.permutation = real


def _lr_zero(step, trainer):
    if step >= _onset():
        for g in trainer.optimizer.param_groups:
            g["lr"] = 0.0


def _no_zero_grad(step, trainer):
    if step == _onset() - 1:  # the zero_grad after this step is gone
        trainer.optimizer.zero_grad = lambda *a, **k: None


def scenarios(data: Path) -> list[Scenario]:
    c, cap = contrastive, caption
    gated = {"model.connector": "gated_xattn", "model.connector_options": "{}"}
    return [
        Scenario("missing zero_grad", c, 3, on_step=_no_zero_grad, steps=6),
        Scenario("replayed epoch order", c, 8, patches=_same_order_every_epoch, steps=10),
        Scenario("frozen tower", cap, 0, install=_freeze_vision, steps=3),
        Scenario(
            "params missing from optimizer", cap, 0, patches=_optimizer_without_vision, steps=3
        ),
        Scenario("LR stuck at 0", c, 3, on_step=_lr_zero, steps=6),
        Scenario("loss spike (loss weight x6)", c, ONSET, install=_scale_loss, steps=14),
        Scenario("grad-norm spike", c, ONSET, install=_grad_spike, steps=14),
        Scenario("NaN", c, 3, install=_nan, steps=5),
        Scenario(
            "homogeneous batches (length-sorted sampler)",
            lambda d, o: cap(d, o, **{"data.train": one_caption_data(d)}),
            0,
            patches=lambda: _length_sorted_sampler(data),
            steps=5,
        ),
        Scenario(
            "homogeneous batches (bucket cap not applied)",
            lambda d, o: cap(d, o, **{"data.length_buckets": 3, "data.max_same_bucket_run": 1}),
            -1,
            patches=_uncapped_buckets,
            steps=10,
        ),
        Scenario("loss weight 0 (loss exactly 0)", c, 3, install=_zero_weight, steps=7),
        Scenario("loss 0 from a label mask", cap, 3, install=_mask_all_labels, steps=7),
        Scenario("dead gates", lambda d, o: cap(d, o, **gated), 0, install=_kill_gates, steps=4),
        Scenario(
            "eval on train data",
            lambda d, o: c(d, o, **{"data.eval": d / "train.jsonl"}),
            0,
            steps=2,
        ),
        Scenario(
            "temperature pinned at clamp",
            lambda d, o: c(d, o, **{"objective.temperature": 0.005}),
            0,
            steps=4,
        ),
        Scenario("duplicated shards across ranks", c, 0, ddp=True, steps=3),
        Scenario("DDP desync", c, 2, ddp=True, steps=5),
        # the reduced quickstart's failure at bench size: the clean recipe of earlier
        # sessions (batch 8) collapses once the LR peaks (onset: the end of warmup)
        Scenario("contrastive collapse at the LR peak (batch 8)", c, 2, steps=30),
        Scenario(
            "contrastive collapse (blank images)",
            learning_contrastive,
            CHANCE_ONSET,
            install=_blank_images,
            steps=CHANCE_ONSET + 20,
        ),
    ]


# Clean runs must outlast warmup + doctor.min_history (2 + 10 here), or the spike and
# update-ratio checks never judge a step: 30 steps leaves 18 judged steps per run.
CLEAN_STEPS = 30
PRESETS = REPO / "vltrain" / "configs"
BUCKETED = "clean captioner, length buckets (caption_finetune.yaml)"


def _preset_run(data: Path, out: Path, **extra: Any) -> list[str]:
    """A shipped caption preset shrunk to the bench: shapes data, batch 8, no eval/saves."""
    base = {
        "run.out_dir": out, "data.train": data / "train.jsonl", "data.eval": "",
        "data.batch_size": 8, "data.num_workers": 0, "data.tokenizer_vocab": 400,
        "model.init_from": "", "train.eval_every": 0, "train.save_every": 0,
        "train.log_every": 1, "optim.warmup_steps": 2, "log.progress": False,
        "log.tensorboard": False,
    }  # fmt: skip
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _from_bucketed(data: Path, out: Path) -> list[str]:
    """SFT / RL start from the bucketed finetune run (same model keys as their presets)."""
    return _preset_run(data, out, **{"model.init_from": out.parent / _slug(BUCKETED)})


def clean_runs() -> list[Scenario]:
    c, cap, n = learning_contrastive, caption, CLEAN_STEPS
    gated = {"model.connector": "gated_xattn", "model.connector_options": "{}"}
    frozen = {"model.freeze": "[vision,decoder]", "caption.mode": "pretrain"}
    return [
        Scenario("clean contrastive (InfoNCE) seed 0", c, steps=n),
        Scenario("clean contrastive seed 1", lambda d, o: c(d, o, **{"run.seed": 1}), steps=n),
        Scenario(
            "clean contrastive SigLIP",
            lambda d, o: c(d, o, **{"objective.loss": "siglip"}),
            steps=n,
        ),
        Scenario("clean captioner, projector", cap, steps=n),
        Scenario(
            "clean captioner, pretrain (frozen vision+decoder)",
            lambda d, o: cap(d, o, **frozen),
            steps=n,
        ),
        Scenario(
            "clean captioner, gated cross-attention", lambda d, o: cap(d, o, **gated), steps=n
        ),
        Scenario(
            BUCKETED,
            # saves its last step: the SFT and RL runs start from it
            lambda d, o: _preset_run(d, o, **{"train.save_every": n}),
            steps=n,
            preset=PRESETS / "caption_finetune.yaml",
        ),
        Scenario(
            "clean SFT (caption_sft.yaml)",
            _from_bucketed,
            steps=n,
            preset=PRESETS / "caption_sft.yaml",
        ),  # fmt: skip
        Scenario("clean RL (rl.yaml)", _from_bucketed, steps=n, preset=PRESETS / "rl.yaml"),
        Scenario("clean 2-process DDP contrastive", c, ddp=True, steps=n),
    ]


QUICKSTART = [
    "--steps", "60", "--caption-steps", "60", "--rl-steps", "24", "--n-train", "800",
    "--n-eval", "100", "--batch-size", "32",
]  # fmt: skip


def run_quickstart(out: Path) -> None:
    """The reduced quickstart (every stage passes warmup + min_history), as users run it."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "vltrain", "quickstart", "--out", str(out), *QUICKSTART]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=3600)


def _clean_row(name: str, run: Path, error: str = "", offline: bool = False) -> dict[str, Any]:
    """Warn-or-error findings of one clean run (each is a false alarm unless shown real), the
    steps the spike checks judged, and the peer spike rules on the same series. `offline`:
    the findings of `vltrain doctor RUN` (today's rules replayed over the run's records),
    not the ones the run wrote while training."""
    if offline:
        found = [asdict(f) for f in doctor_mod.analyse_run(run)]
    else:
        found = _findings(run)
    warn = [f for f in found if f["severity"] != "info"]
    info = sorted({f["check"] for f in found if f["severity"] == "info"})
    row: dict[str, Any] = {
        "run": name, "false_alarms": len(warn), "checks": sorted({f["check"] for f in warn}),
        "info": [f"{f['check']}@{f['step']}" for f in found if f["severity"] == "info"],
        "info_checks": info,
        "findings": [f"{f['check']}@{f['step']}: {f['message']}" for f in warn],
        "error": error,
    }  # fmt: skip
    if (run / "doctor_steps.jsonl").is_file():
        loss, grad = _series(run)
        row["steps"] = len(loss)
        row["foundry"], row["olmo_loss"], row["olmo_grad"] = (
            foundry_kill_loss_spike(loss),
            olmo_spike(loss),
            olmo_spike(grad),
        )
    return row


def _findings(out: Path) -> list[dict[str, Any]]:
    path = out / "doctor.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def run_one(sc: Scenario, data: Path, out: Path) -> dict[str, Any]:
    """Train the scenario; its findings, error (if the fault crashed it), wall time."""
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    err = ""
    if sc.ddp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               __file__, "--ddp-worker", sc.name, str(data), str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        env["BENCH_STEPS"], env["BENCH_ONSET"] = str(sc.steps), str(sc.onset)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        err = "" if res.returncode == 0 else res.stderr[-800:]
    else:
        err = _train_in_process(sc, data, out)
    return {"findings": _findings(out), "error": err, "seconds": time.time() - t0}


def _train_in_process(sc: Scenario, data: Path, out: Path) -> str:
    cfg = load_config(sc.preset, [*sc.overrides(data, out), f"train.max_steps={sc.steps}"])
    trainer = loop.Trainer(cfg, stage=check_config(cfg))
    Hooks.trainer, Hooks.scenario = trainer, sc
    if sc.install is not None:
        sc.install(trainer)
    loop.set_lr = Hooks.set_lr
    try:
        with sc.patches() if sc.patches else contextlib.nullcontext():
            trainer.run()
    except Exception as e:  # a fault may crash the run; what the doctor wrote still counts
        return f"{type(e).__name__}: {e}"[:300]
    finally:
        loop.set_lr = Hooks.real_set_lr
    return ""


def ddp_worker(name: str, data: Path, out: Path) -> None:
    """One rank of a two-process scenario (launched by torchrun)."""
    from vltrain.core import distributed

    steps, onset = int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_ONSET"])
    # the clean run: the learning recipe's global batch of 32 as 2 x 16
    extra = {"data.batch_size": 16} if name.startswith("clean") else {}
    cfg = load_config(None, [*contrastive(data, out, **extra), f"train.max_steps={steps}"])
    trainer = loop.Trainer(cfg, stage=check_config(cfg))
    stack = contextlib.ExitStack()
    if name == "duplicated shards across ranks":  # a sampler that ignores the rank
        real = samplers.ShardedBatchSampler.__init__

        def init(self, n, batch_size, rank, world_size, *args, **kwargs):
            real(self, n, batch_size, 0, world_size, *args, **kwargs)

        samplers.ShardedBatchSampler.__init__ = init
    if name == "DDP desync":  # rank 1 takes a private update from ONSET on

        def desync(step, t):
            if step >= _onset() and distributed.rank() == 1:
                with torch.no_grad():
                    next(t.optimizer.param_groups[0]["params"].__iter__()).add_(1e-2)

        Hooks.trainer = trainer
        Hooks.scenario = Scenario(name, contrastive, onset, on_step=desync)
        loop.set_lr = Hooks.set_lr
    with stack:
        trainer.run()
    # free the DDP wrapper while the process group is still registered: if its Reducer holds
    # the last reference at exit, ~ProcessGroupGloo joins a gloo thread that waits for the GIL
    # the destructor holds (a torch teardown deadlock seen on the clean 2-process run)
    del trainer, stack
    Hooks.trainer = None
    gc.collect()
    distributed.shutdown()


# ---- peer rules, applied to the same runs' series ------------------------------------------


def foundry_kill_loss_spike(losses: list[float], window: int = 100, mult: float = 2.0) -> int:
    """First step where loss > mult x the mean of the last `window` losses (-1: none)."""
    for i in range(1, len(losses)):
        hist = losses[max(0, i - window) : i]
        if losses[i] > mult * statistics.fmean(hist):
            return i
    return -1


def olmo_spike(values: list[float], window: int = 128, sigma: float = 6.0) -> int:
    """First step more than `sigma` standard deviations above the last `window` values."""
    for i in range(10, len(values)):
        hist = values[max(0, i - window) : i]
        sd = statistics.pstdev(hist)
        if sd > 0 and values[i] > statistics.fmean(hist) + sigma * sd:
            return i
    return -1


def _series(out: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(x) for x in (out / "doctor_steps.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def onset_of_homogeneous(out: Path, max_run: int) -> int:
    """The first step whose batch is the (max_run+1)-th in a row from one length bucket, by
    the doctor's own per-step records (the sampler's buckets are not logged)."""
    rows = [json.loads(x) for x in (out / "doctor_steps.jsonl").read_text().splitlines()]
    means = [statistics.fmean(r["lengths"]) for r in rows]
    edges = statistics.quantiles([x for r in rows for x in r["lengths"]], n=3)
    buckets = [sum(m > e for e in edges) for m in means]
    run = 0
    for i, b in enumerate(buckets):
        run = run + 1 if i and b == buckets[i - 1] else 1
        if run > max_run:
            return i
    return -1


def evaluate(sc: Scenario, res: dict[str, Any], out: Path) -> dict[str, Any]:
    warn = [f for f in res["findings"] if f["severity"] in ("warn", "error")]
    onset = sc.onset if sc.onset >= 0 else onset_of_homogeneous(out, 1)
    hit = [f for f in warn if f.get("detected_at", -1) >= onset - 1 or f.get("detected_at") == -1]
    first = min(hit, key=lambda f: max(f.get("detected_at", 0), 0), default=None)
    row = {
        "fault": sc.name, "onset": onset, "error": res["error"],
        "doctor": None if first is None else first["check"],
        "detected_at": None if first is None else max(first.get("detected_at", 0), 0),
        "seconds": round(res["seconds"], 1),
    }  # fmt: skip
    row["latency"] = None if first is None else row["detected_at"] - max(onset, 0)
    if (out / "doctor_steps.jsonl").is_file():
        loss, grad = _series(out)
        row["foundry"] = foundry_kill_loss_spike(loss)
        row["olmo_loss"], row["olmo_grad"] = olmo_spike(loss), olmo_spike(grad)
    return row


def overhead(data: Path, out: Path) -> dict[str, float]:
    """Time inside the doctor (observe + the probe's optimizer hooks) as a share of the loop's
    step time, on a clean contrastive run (a ratio: robust to a shared, busy CPU)."""
    spent = {"t": 0.0}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["t"] += time.perf_counter() - t

        return wrapper

    reals = (doctor_mod.Doctor.observe, probe_mod.Probe._pre_step, probe_mod.Probe._post_step)
    doctor_mod.Doctor.observe = timed(reals[0])
    probe_mod.Probe._pre_step, probe_mod.Probe._post_step = timed(reals[1]), timed(reals[2])
    try:
        run_one(Scenario("overhead", contrastive, steps=STEPS), data, out)
    finally:
        doctor_mod.Doctor.observe = reals[0]
        probe_mod.Probe._pre_step, probe_mod.Probe._post_step = reals[1], reals[2]
    rows = (out / "doctor_steps.jsonl").read_text().splitlines()
    steps = [json.loads(x)["time_s"] for x in rows]
    return {
        "doctor_s_per_step": spent["t"] / len(steps),
        "median_step_s": statistics.median(steps),
        "doctor_share_of_step": spent["t"] / sum(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/doctor")
    p.add_argument("--ddp-worker", nargs=3, metavar=("NAME", "DATA", "OUT"))
    p.add_argument(
        "--only", default="", help="'|'-separated substrings: run only matching scenarios"
    )
    p.add_argument(
        "--clean",
        action="store_true",
        help="run only the clean runs (and the reduced quickstart): false alarms per run",
    )
    p.add_argument(
        "--quickstart", default="", help="a finished quickstart folder to use (else run one)"
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="with --clean: re-judge the existing clean runs with today's rules (no training)",
    )
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--overhead-only", action="store_true")
    p.add_argument("--skip", default="", help="'|'-separated scenario names not to run")
    args = p.parse_args()
    if args.ddp_worker:
        name, data, out = args.ddp_worker
        return ddp_worker(name, Path(data), Path(out))
    out = Path(args.out)
    data = out / "shapes64"
    if not (data / "train.jsonl").is_file():
        from vltrain.data.synth import synth_command

        synth_command(str(data), 64, 16, 16, 0)  # 64 / batch 8: 8 steps per epoch
    if args.overhead_only:
        print(json.dumps(overhead(data, out / "overhead")))
        return None
    rows, clean = [], []
    skip = set(filter(None, args.skip.split("|")))
    for sc in [] if args.clean else scenarios(data):
        if _wanted(sc.name, args.only, skip):
            rows.append(
                evaluate(
                    sc,
                    run_one(sc, data, out / "faults" / _slug(sc.name)),
                    out / "faults" / _slug(sc.name),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    if args.clean and args.offline:
        rows = [
            {**_clean_row(sc.name, out / "clean" / _slug(sc.name), offline=True), "offline": True}
            for sc in clean_runs()
            if _wanted(sc.name, args.only, skip) and (out / "clean" / _slug(sc.name)).is_dir()
        ]
        clean = _merge(out / "clean.json", rows)
        (out / "clean.json").write_text(json.dumps(clean, indent=2))
        print(clean_table(clean))
        return None
    if args.clean:
        clean = _merge(out / "clean.json", run_clean(data, out, args.only, skip, args.quickstart))
        (out / "clean.json").write_text(json.dumps(clean, indent=2))
        (out / "clean.md").write_text(clean_table(clean))
        print(clean_table(clean))
        return None
    result: dict[str, Any] = {"faults": rows, "clean": clean}
    if not args.skip_overhead:
        result["overhead"] = overhead(data, out / "overhead")
        print(json.dumps(result["overhead"]))
    (out / "results.json").write_text(json.dumps(result, indent=2))
    det = [r for r in rows if r["latency"] is not None and r["latency"] <= 2]
    print(
        f"detected within 2 steps: {len(det)}/{len(rows)}; "
        f"false alarms on clean runs: {sum(c['false_alarms'] for c in clean)}"
    )


def run_clean(
    data: Path, out: Path, only: str, skip: set[str], quickstart: str
) -> list[dict[str, Any]]:
    """Every clean run, one at a time, then the quickstart's stage runs (of the finished
    `quickstart` folder, else of a fresh reduced one); one row per run."""
    rows = []
    for sc in clean_runs():
        if _wanted(sc.name, only, skip):
            run = out / "clean" / _slug(sc.name)
            res = run_one(sc, data, run)
            rows.append(_clean_row(sc.name, run, res["error"]))
            rows[-1]["seconds"] = round(res["seconds"], 1)
            print(json.dumps(rows[-1]), flush=True)
    if not _wanted("quickstart", only, skip):
        return rows
    qs = Path(quickstart) if quickstart else out / "clean" / "quickstart"
    if not quickstart:
        t0 = time.time()
        run_quickstart(qs)
        print(json.dumps({"quickstart_seconds": round(time.time() - t0, 1)}), flush=True)
    for run in sorted(p for p in qs.iterdir() if (p / "doctor.jsonl").is_file()):
        rows.append(_clean_row(f"quickstart/{run.name}", run))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _peer(v: int | None) -> str:
    return "-" if v is None or v < 0 else str(v)


def clean_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per clean run, its steps, warn-or-error findings, the peer rules."""
    lines = [
        "| clean run | steps | warn/error findings | info findings | Foundry rule | "
        "OLMo rule (loss / grad) |",
        "|---|---:|---|---|---:|---|",
    ]
    for r in rows:
        what = "; ".join(f.replace("|", "/") for f in r["findings"]) or "0"
        if r["error"]:
            what += f" (run failed: {r['error'][:120]})"
        info = ", ".join(r.get("info", [])) or "-"
        lines.append(
            f"| {r['run']} | {r.get('steps', '?')} | {what} | {info} "
            f"| {_peer(r.get('foundry'))} | "
            f"{_peer(r.get('olmo_loss'))} / {_peer(r.get('olmo_grad'))} |"
        )
    total = sum(r["false_alarms"] for r in rows)
    return "\n".join(lines) + f"\n\n{len(rows)} clean runs, {total} warn-or-error findings\n"


def _merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of earlier partial invocations (in `path`) updated with this one's, by run name."""
    merged = {r["run"]: r for r in json.loads(path.read_text())} if path.is_file() else {}
    merged.update({r["run"]: r for r in rows})
    order = {sc.name: i for i, sc in enumerate(clean_runs())}
    return sorted(merged.values(), key=lambda r: (order.get(r["run"], len(order)), r["run"]))


def _wanted(name: str, only: str, skip: set[str]) -> bool:
    """`name` is selected by `only` ('|'-separated substrings; '' = all) and not skipped."""
    return name not in skip and (not only or any(o in name for o in only.split("|")))


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)[:60]


if __name__ == "__main__":
    main()
