"""The two-round hard-negative mining recipe on the synthetic pages (issue 54, item 7), as a
user runs it: train -> `vltrain mine` -> train again from round 1 with the mined page
negatives; held-out R@1 / nDCG@10 / hard-negative accuracy after each round, and a control
round 2 that trains the same steps from round 1 without mined negatives (so the gain of
mining is not the gain of more steps).

    PYTHONPATH=. python bench/pages_mining_rounds.py --out bench/out/mining \
        [--n-train 8000] [--batch 32] [--steps1 1600] [--steps2 400] [--k 1] [--no-control]

Every step is the CLI (`vltrain data synth --kind pages`, `vltrain train configs/pages.yaml`,
`vltrain mine`, `vltrain eval`); the preset's model (built-in towers, reading loss) and batch,
round 1 at half the preset's 3,200 steps (500 steps of 16 learn nothing yet: R@1 0.000, the
reading loss has not started). Prints one Markdown table and writes OUT/rounds.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vltrain(args: list[str], log: Path) -> float:
    """Run `vltrain ARGS` (output to `log`); seconds taken."""
    t = time.perf_counter()
    with log.open("w") as f:
        res = subprocess.run(
            [sys.executable, "-m", "vltrain", *map(str, args)],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if res.returncode:
        raise SystemExit(f"vltrain {args[0]} failed; see {log}")
    return time.perf_counter() - t


def train(
    out: Path, data: Path, steps: int, warmup: int, batch: int, extra: list[str], log: Path
) -> float:
    return vltrain(
        [
            "train",
            "configs/pages.yaml",
            f"run.out_dir={out}",
            f"optim.warmup_steps={warmup}",
            f"data.batch_size={batch}",
            "data.eval=",  # evaluated afterwards, on the test split
            "data.test=",
            "train.best_metric=",
            f"train.max_steps={steps}",
            "train.eval_every=0",
            f"train.save_every={steps}",
            "log.progress=false",
            *extra,
        ],
        log,
    )


def evaluate(run: Path, data: Path, out: Path) -> dict[str, float]:
    split = data / "test"
    vltrain(
        [
            "eval",
            run,
            "--queries",
            split / "queries.jsonl",
            "--corpus",
            split / "corpus.jsonl",
            "--qrels",
            split / "qrels.tsv",
            "--out",
            out,
        ],
        out.with_suffix(".log"),
    )
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n-train", type=int, default=8000)
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--distractors", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32, help="pages a step (the preset's)")
    ap.add_argument("--steps1", type=int, default=1600)
    ap.add_argument("--steps2", type=int, default=400)
    ap.add_argument("--warmup1", type=int, default=200)
    ap.add_argument("--warmup2", type=int, default=20)
    ap.add_argument("--no-control", action="store_true", help="skip the control round 2")
    ap.add_argument("--k", type=int, default=1, help="mined negatives per query")
    ap.add_argument("--margin", type=float, default=0.95, help="vltrain mine --margin")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out, data = a.out, a.out / "data"
    out.mkdir(parents=True, exist_ok=True)
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    synth = ["data", "synth", "--kind", "pages", "--out", data, "--n-train", a.n_train]
    synth += ["--n-val", 100, "--n-test", a.n_test, "--negatives", 1, "--seed", a.seed]
    synth += ["--distractors", a.distractors, "--force"]
    args_file = out / "synth_args.json"
    if args_file.is_file() and json.loads(args_file.read_text()) == list(map(str, synth)):
        secs["synth"] = 0.0  # the same data set is already there
    else:
        secs["synth"] = vltrain(synth, out / "synth.log")
        args_file.write_text(json.dumps(list(map(str, synth))))
    seed = [f"run.seed={a.seed}", f"data.train={data / 'train.jsonl'}"]
    secs["round 1"] = train(out / "r1", data, a.steps1, a.warmup1, a.batch, seed, out / "r1.log")
    mined = data / "train_mined.jsonl"
    secs["mine"] = vltrain(
        ["mine", "--checkpoint", out / "r1", "--data", data / "train.jsonl"]
        + ["--corpus", data / "train_corpus.jsonl", "--out", mined, "--k", a.k]
        + ["--margin", a.margin],
        out / "mine.log",
    )
    r2 = [f"run.seed={a.seed}", f"model.init_from={out / 'r1'}"]
    secs["round 2"] = train(
        out / "r2",
        data,
        a.steps2,
        a.warmup2,
        a.batch,
        r2
        + [f"data.train={mined}", f"data.train_corpus={data / 'train_corpus.jsonl'}"]
        + [f"objective.hard_negatives={a.k}"],
        out / "r2.log",
    )
    rows = {
        f"round 1 ({a.steps1} steps of {a.batch})": evaluate(out / "r1", data, out / "r1.json"),
        f"round 2: +{a.steps2} steps with {a.k} mined negative(s)": evaluate(
            out / "r2", data, out / "r2_test.json"
        ),
    }
    if not a.no_control:
        ctl = [*r2, f"data.train={data / 'train.jsonl'}"]
        secs["control"] = train(
            out / "r2_control", data, a.steps2, a.warmup2, a.batch, ctl, out / "r2_control.log"
        )
        rows[f"control: +{a.steps2} steps, no negatives"] = evaluate(
            out / "r2_control", data, out / "r2_control_test.json"
        )
    total = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every vltrain process, its workers
    cpu_min = (usage.ru_utime + usage.ru_stime) / 60
    recs = [json.loads(x) for x in mined.read_text().splitlines()]
    n_mined = sum(len(r.get("negatives", [])) for r in recs)
    print(
        f"\nmachine: {_cpu()}; load average at the end {os.getloadavg()[0]:.1f}; "
        f"{datetime.date.today()}; {platform.python_version()}; {a.n_train} training records, "
        f"test: {a.n_test} queries over {a.n_test * 2 + a.distractors} pages; mined "
        f"{n_mined} negatives for {len(recs)} records (k {a.k}, margin {a.margin}); "
        f"CPU time {cpu_min:.1f} min (all processes), wall {total / 60:.1f} min "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in secs.items())})\n"
    )
    print("| model | test R@1 | R@10 | nDCG@10 | hard-negative acc |")
    print("|---|---|---|---|---|")
    for name, m in rows.items():
        print(
            f"| {name} | {m['R@1']:.3f} | {m['R@10']:.3f} | {m['nDCG@10']:.3f} | "
            f"{m.get('hardneg_acc', float('nan')):.3f} |"
        )
    (out / "rounds.json").write_text(json.dumps({"rows": rows, "secs": secs}, indent=1))
    return 0


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name")]
    return names[0] if names else platform.machine()


if __name__ == "__main__":
    sys.exit(main())
