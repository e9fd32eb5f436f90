"""TrainCheck 0.2.0 on the doctor's planted faults: detections, latency and overhead.

TrainCheck's workflow (docs/usage-guide.md of OrderLab/TrainCheck): `traincheck-collect` a
known-good reference run under instrumentation, `traincheck-infer` invariants from it, then
collect each target run selectively (`--invariants`) and `traincheck-check` it. The target
is bench/traincheck_target.py, a plain PyTorch script with one planted fault per run (the
faults of bench_doctor.py that a single-process plain-torch script can carry).

A fault counts as detected when the faulty run violates an invariant that the clean target
run (same script, another seed) does not violate; violations on the clean target are
TrainCheck's false alarms. "detected at" is the first training step of such a violation
(`first_step` in TrainCheck's violations_summary.json; META_VARS["step"] is set by the
script). Overhead: the median step time of the instrumented run over the plain run's.

TrainCheck must not pull another torch into the project's venv, so it lives apart:

    python3 -m venv bench/out/tc_venv   # the same CPython as /work/main/.venv
    /work/main/.venv/bin/python -m pip install --target bench/out/tc_pkgs --no-deps \\
        traincheck==0.2.0 astor orjson polars polars-runtime-32 numba llvmlite watchdog
    printf '%s\\n' $PWD/bench/out/tc_pkgs /work/main/.venv/lib/python3.11/site-packages \\
        > bench/out/tc_venv/lib/python3.11/site-packages/bench_paths.pth
    bench/out/tc_venv/bin/python bench/bench_traincheck.py --out bench/out/traincheck

(TrainCheck's runner replaces PYTHONPATH with the script's folder, so a --target folder
alone is not importable by the traced program; the .pth file of a separate venv is.)
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KEEP = False  # --keep: reuse traces (and the invariants) of an earlier invocation
TARGET = HERE / "traincheck_target.py"
# fault -> onset step (the first step the fault is present; traincheck_target.ONSET = 10;
# replayed order: the second epoch's first step; eval_on_train: the first eval, after step 7)
FAULTS = {
    "no_zero_grad": 10, "lr0": 10, "frozen_layer": 0, "not_in_optimizer": 0, "nan": 10,
    "loss_spike": 10, "grad_spike": 10, "replayed_order": 8, "zero_loss": 10,
    "label_mask": 10, "dead_gate": 0, "eval_on_train": 7,
}  # fmt: skip
DOCTOR_NAME = {  # the bench_doctor.py scenario each fault mirrors
    "no_zero_grad": "missing zero_grad", "lr0": "LR stuck at 0",
    "frozen_layer": "frozen tower", "not_in_optimizer": "params missing from optimizer",
    "nan": "NaN", "loss_spike": "loss spike (loss weight x6)", "grad_spike": "grad-norm spike",
    "replayed_order": "replayed epoch order", "zero_loss": "loss weight 0 (loss exactly 0)",
    "label_mask": "loss 0 from a label mask", "dead_gate": "dead gates",
    "eval_on_train": "eval on train data",
}  # fmt: skip


def _run(cmd: list[str], log: Path, timeout: int = 1800) -> float:
    """Run `cmd` (niced) in `log`'s folder (TrainCheck writes its own logs into the working
    directory), output to `log`; wall seconds. Raises with the log tail on failure."""
    t0 = time.time()
    with log.open("w") as f:
        res = subprocess.run(["nice", "-n", "5", *cmd], stdout=f, stderr=subprocess.STDOUT,
                             timeout=timeout, cwd=log.parent)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({res.returncode}):\n"
                           f"{log.read_text()[-2000:]}")  # fmt: skip
    return time.time() - t0


def _workdir(out: Path, name: str, fault: str, seed: int) -> Path:
    """A folder with its own copy of the script (TrainCheck writes its rewritten copy beside
    the original) and the run.sh that passes the fault."""
    work = out / "runs" / name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shutil.copy(TARGET, work / TARGET.name)
    (work / "run.sh").write_text(
        f"{sys.executable} -u {TARGET.name} --fault {fault} --seed {seed} "
        f"--times {work / 'times.txt'}\n"
    )
    return work


def collect(out: Path, name: str, fault: str, seed: int, invariants: Path | None) -> Path:
    """traincheck-collect one run (selective when `invariants` is given); its trace folder
    (named `name`: the checker names its per-trace results by the folder's name)."""
    done = out / "runs" / name / name / "program_output.txt"
    if KEEP and done.is_file() and "exited with code 0" in done.read_text():
        return done.parent  # --keep: a trace collected by an earlier invocation
    work = _workdir(out, name, fault, seed)
    cmd = [sys.executable, "-m", "traincheck.collect_trace", "--pyscript",
           str(work / TARGET.name), "--shscript", str(work / "run.sh"),
           "--models-to-track", "model", "--output-dir", str(work / name)]  # fmt: skip
    if invariants is not None:
        cmd += ["--invariants", str(invariants)]
    _run(cmd, work / "collect.log")
    return work / name


def plain(out: Path, fault: str, seed: int) -> list[float]:
    """The script without instrumentation: its per-step seconds."""
    work = _workdir(out, f"plain_{fault}_{seed}", fault, seed)
    _run(["bash", str(work / "run.sh")], work / "plain.log")
    return _times(work)


def _times(work: Path) -> list[float]:
    return [float(x) for x in (work / "times.txt").read_text().split()]


def check(traces: list[Path], invariants: Path, res: Path) -> tuple[dict[str, Any], float]:
    """One traincheck-check over all `traces` (the invariants and TrainCheck's JIT load once):
    {trace name: {violations: [{display_name, relation_type, first_step}]}}, seconds."""
    summaries = [res / t.name / "violations_summary.json" for t in traces]
    if KEEP and all(x.is_file() for x in summaries):  # --keep: an earlier check of these traces
        kept = zip(traces, summaries, strict=True)
        return {t.name: json.loads(x.read_text()) for t, x in kept}, -1.0
    if res.exists():
        shutil.rmtree(res)
    cmd = [sys.executable, "-m", "traincheck.checker", "-f", *map(str, traces),
           "-i", str(invariants), "-o", str(res), "--no-html-report"]  # fmt: skip
    seconds = _run(cmd, res.parent / "check.log", timeout=5400)
    return {
        t.name: json.loads((res / t.name / "violations_summary.json").read_text()) for t in traces
    }, seconds


def judge(fault: str, summary: dict[str, Any], clean_names: set[str]) -> dict[str, Any]:
    """Violations the clean target does not have; the first one at or after onset - 1."""
    onset = FAULTS[fault]
    new = [v for v in summary["violations"] if v["display_name"] not in clean_names]
    steps = [v["first_step"] for v in new if v["first_step"] is not None]
    hit = [s for s in steps if s >= onset - 1]
    first = min(hit) if hit else (None if not new else (min(steps) if steps else -1))
    relations = sorted({v["relation_type"] for v in new})
    return {
        "fault": fault, "doctor_scenario": DOCTOR_NAME[fault], "onset": onset,
        "violations": len(summary["violations"]), "new_violations": len(new),
        "relations": relations, "detected_at": first,
        # a missing call is seen at the step before (its optimizer.step not followed by it)
        "latency": None if first is None or first < 0 else max(first - onset, 0),
        "examples": [v["display_name"][:160] for v in new[:3]],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/traincheck")
    p.add_argument("--only", default="", help="'|'-separated faults to run (default: all)")
    p.add_argument("--references", type=int, default=2, help="clean reference runs (seeds)")
    p.add_argument("--keep", action="store_true", help="reuse traces/invariants already there")
    args = p.parse_args()
    global KEEP
    KEEP = args.keep
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    inv = out / "invariants.json"
    t_ref = [collect(out, f"reference_seed{s}", "none", s, None) for s in range(args.references)]
    infer_s = 0.0
    if not (KEEP and inv.is_file()):
        infer_s = _run([sys.executable, "-m", "traincheck.infer_engine", "-f",
                        *map(str, t_ref), "-o", str(inv)], out / "infer.log")  # fmt: skip
    n_inv = len(inv.read_text().splitlines())
    print(json.dumps({"invariants": n_inv, "infer_seconds": round(infer_s, 1)}), flush=True)
    wanted = [f for f in FAULTS if not args.only or f in args.only.split("|")]
    traces = [collect(out, "clean_seed2", "none", 2, inv)]
    traces += [collect(out, fault, fault, 2, inv) for fault in wanted]
    print(json.dumps({"collected": [t.name for t in traces]}), flush=True)
    summaries, check_s = check(traces, inv, out / "check")
    clean_names = {v["display_name"] for v in summaries["clean_seed2"]["violations"]}
    print(json.dumps({"clean_violations": len(clean_names), "check_seconds": round(check_s)}),
          flush=True)  # fmt: skip
    rows = [judge(fault, summaries[fault], clean_names) for fault in wanted]
    for row in rows:
        print(json.dumps(row), flush=True)
    base = statistics.median(plain(out, "none", 2))
    overhead: dict[str, float] = {"plain_median_step_s": base}
    runs = {"full_instr": t_ref[0].parent, "selective": out / "runs" / "clean_seed2"}
    for kind, work in runs.items():
        if (work / "times.txt").is_file():  # a kept reference from a run without --times has none
            overhead[f"{kind}_median_step_s"] = statistics.median(_times(work))
            overhead[f"{kind}_x"] = overhead[f"{kind}_median_step_s"] / base
    print(json.dumps(overhead), flush=True)
    result = {"invariants": n_inv, "infer_seconds": round(infer_s, 1),
              "check_seconds": round(check_s, 1), "clean_violations": sorted(clean_names),
              "faults": rows, "overhead": overhead}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=2))
    det = [r for r in rows if r["latency"] is not None and r["latency"] <= 2]
    print(f"TrainCheck: {len(det)}/{len(rows)} detected within 2 steps; "
          f"{len(clean_names)} invariants violated on the clean target run")  # fmt: skip


if __name__ == "__main__":
    main()
