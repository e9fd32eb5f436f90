"""What limits a trained page-retrieval run (configs/pages.yaml, the word-pair head): where its
readers fail, and which pages beat a query's page.

    python bench/pages_diagnose.py RUN --data DATA [--seed 0 --n-val 300 --distractors 10000
        --negatives 1 --image-size 96] [--temperatures 1 0.5 0.25]

DATA is the folder `vltrain data synth --kind pages` wrote (the options repeat the ones it was
written with, so the generator can be replayed: each val page's title, lines and font sizes;
the replay is checked against DATA/val/queries.jsonl). Prints:

1. Reading on 512 fresh training-style pages (never seen in training): token and next-token
   accuracy of title and body word cells, and for each adjacent word pair whether one of the
   cells the page code keeps (the least-background ones) reads the pair right (both argmax).
2. How much a pair's code overlaps the codes of pairs that share one of its words; R@1 / R@5
   of the run's last validation (RUN/eval_ranks_val.jsonl) by query group and font
   size, and for each query not at rank 1 where its words sit on the page that beat it.
3. With --temperatures: the val corpus encoded once and R@1 of page codes built from readings
   sharpened or softened by each softmax temperature (1 is the trained model; 0: argmax).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from vltrain.data import synth_pages as sp
from vltrain.data.pairs import DEFAULT_MAX_PIXELS, load_side, read_pair_records, side_inputs
from vltrain.data.reading import next_on_line
from vltrain.eval import corpus
from vltrain.tools.loading import load_trained


def replay_val(a: argparse.Namespace) -> tuple[dict[str, sp.Page], dict[str, dict]]:
    """The val split's pages by document id and its queries by id (with their group and font
    size, also for data written before queries named them), drawn again without rendering."""
    drawn: list[sp.Page] = []
    real = sp.render, sp._save, sp._write_jsonl
    try:
        sp.render = lambda page, size, boxes=None: drawn.append(page) or page
        sp._save = lambda img, out, rel: rel
        queries: list[dict] = []
        sp._write_jsonl = lambda path, rows: queries.extend(rows) if "queries" in path.name else 0
        rng = random.Random(f"{a.seed}-val")
        with tempfile.TemporaryDirectory() as tmp:
            split = (a.n_val, a.distractors, a.negatives, a.image_size, rng, sp.vocabulary())
            sp.write_split(Path(tmp), "val", *split)
    finally:
        sp.render, sp._save, sp._write_jsonl = real
    written = [json.loads(x) for x in (Path(a.data) / "val/queries.jsonl").read_text().splitlines()]
    if [q["text"] for q in queries] != [q["text"] for q in written]:
        raise SystemExit(
            "the replayed val queries differ: pass the options the data was written with"
        )
    docs = [
        json.loads(x)["_id"] for x in (Path(a.data) / "val/corpus.jsonl").read_text().splitlines()
    ]
    return dict(zip(docs, drawn, strict=True)), {q["_id"]: q for q in queries}


def reading_by_place(stage: object, model: torch.nn.Module, out: Path, size: int) -> None:
    """Part 1: readers on fresh pages, title vs body."""
    fresh = out / "fresh"
    if not (fresh / "train.jsonl").is_file():
        sp.write_train(fresh, 512, 0, size, random.Random("diagnose"), sp.vocabulary())
    rt = stage.reading_targets()
    enc, bg = model.encoder, rt.background
    cells: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    pairs: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    recs = read_pair_records(fresh / "train.jsonl")
    for b in range(0, len(recs), 64):
        sides = [
            load_side(r["positives"][0], size, False, DEFAULT_MAX_PIXELS, "p")
            for r in recs[b : b + 64]
        ]
        images, _ = side_inputs(stage.batcher, "doc", "image", sides)
        words = [s["words"] for s in sides]
        tok, nxt = rt(words).unbind(1)  # (B, P) each
        with torch.no_grad():
            _, read = enc.encode_image_read(images)
        pred = read.tokens.argmax(-1)
        word = (tok >= 0) & (tok != bg)
        npred = torch.full_like(tok, -1)
        with torch.no_grad():
            npred[word] = read.following(word).argmax(-1)
        lg = read.tokens.float()
        kept = torch.zeros_like(word).scatter_(1, enc.pairs.kept_cells(lg), True)
        right = (pred == tok) & (npred == nxt)
        for i, ws in enumerate(words):
            for k, w in enumerate(ws):
                place = "title" if k < 2 else "body"
                m = rt([[w]])[0, 0]
                m = (m >= 0) & (m != bg)
                c = cells[place]
                c[0] += int(m.sum())
                c[1] += int(((pred[i] == tok[i]) & m).sum())
                c[2] += int(((npred[i] == nxt[i]) & m).sum())
                if next_on_line(ws, k) is not None:
                    p = pairs[place]
                    p[0] += 1
                    p[1] += int((m & kept[i]).any())
                    p[2] += int((m & kept[i] & right[i]).any())
    print("\n| word cells | cells | token acc | next-token acc |\n|---|---|---|---|")
    for place, (n, t, x) in cells.items():
        print(f"| {place} | {n} | {t / n:.3f} | {x / n:.3f} |")
    print(
        "\n| adjacent pairs | pairs | a kept cell | a kept cell reads it right |\n|---|---|---|---|"
    )
    for place, (n, k, r) in pairs.items():
        print(f"| {place} | {n} | {k / n:.3f} | {r / n:.3f} |")


def pair_overlap(head: torch.nn.Module, n: int = 5000) -> None:
    """Cosine of a pair's code (a, b) with the codes of pairs sharing one word or none."""
    g = torch.Generator().manual_seed(0)
    classes = head.first.shape[0] - 2
    a, b, x, y = (torch.randint(0, classes, (n,), generator=g) for _ in range(4))

    def code(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        first, second = head.rows()
        return F.normalize(head.combine(first[u], second[v]), dim=-1)

    ab = code(a, b)
    print("\n| a pair's code (a, b) vs | mean cosine |\n|---|---|")
    with torch.no_grad():
        for name, (u, v) in {
            "(a, x)": (a, x),
            "(x, b)": (x, b),
            "(b, a)": (b, a),
            "(x, y)": (x, y),
        }.items():
            print(f"| {name} | {float((ab * code(u, v)).sum(-1).mean()):.3f} |")


def ranks_by_group(run: Path, pages: dict[str, sp.Page], queries: dict[str, dict]) -> None:
    """Part 2: the last validation's ranks by group and font size; what beat the misses."""
    by: dict[tuple[str, int], list[int]] = defaultdict(list)
    beaten: Counter[tuple[str, str]] = Counter()
    for row in map(json.loads, (run / "eval_ranks_val.jsonl").read_text().splitlines()):
        q = queries[row["query"]]
        by[(q["group"], q["font_px"])].append(row["rank"])
        by[(q["group"], 0)].append(row["rank"])
        if row["rank"] == 1:
            continue
        top = pages[row["top"][0]]
        where = "".join(
            "T" if w in top.title else "B" if w in top.words() else "-" for w in q["text"].split()
        )
        beaten[(q["group"], where)] += 1
    print("\n| group | font px (0: all) | queries | R@1 | R@5 |\n|---|---|---|---|---|")
    for (g, px), r in sorted(by.items()):
        r1, r5 = (sum(x <= k for x in r) / len(r) for k in (1, 5))
        print(f"| {g} | {px} | {len(r)} | {r1:.3f} | {r5:.3f} |")
    print(
        "\nqueries not at rank 1: where their two words sit on the page ranked first "
        "(T: its title, B: its body, -: absent)\n| group | words | queries |\n|---|---|---|"
    )
    for (g, where), n in beaten.most_common():
        print(f"| {g} | {where} | {n} |")


def sharpen(logits: torch.Tensor, t: float) -> torch.Tensor:
    """Softmax at temperature `t`; 0: one-hot argmax (hard readings)."""
    if t == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return (logits / t).softmax(-1)


def temperatures(
    stage: object,
    model: torch.nn.Module,
    data: Path,
    meta: dict[str, dict],
    temps: list[float],
    size: int,
) -> None:
    """Part 3: R@1 with page codes from readings at other softmax temperatures."""
    v = data / "val"
    split = corpus.read_split(v / "queries.jsonl", v / "corpus.jsonl", v / "qrels.tsv")
    split.groups = [meta[qid]["group"] for qid in split.query_ids]
    head, vision = model.encoder.pairs, model.encoder.vision
    toks, nxts = [], []
    with torch.no_grad():
        for b in range(0, len(split.docs), 256):
            sides = [
                load_side(s, size, False, DEFAULT_MAX_PIXELS, "d") for s in split.docs[b : b + 256]
            ]
            images, _ = side_inputs(stage.batcher, "doc", "image", sides)
            cur, after = head.kept_logits(head.reading(vision.grid(images)))
            toks.append(cur)
            nxts.append(after)
        inputs, _ = side_inputs(stage.batcher, "query", "text", split.queries)
        q = F.normalize(head.text(*inputs).float(), dim=-1)
        tok, nxt = torch.cat(toks), torch.cat(nxts)
        print("\n| reading temperature | R@1 | R@5 | R@1 title | R@1 body | hard-neg acc |")
        print("|---|---|---|---|---|---|")
        for t in temps:
            codes = []
            for c in range(0, tok.shape[0], 512):  # (512, K, D) at a time
                codes.append(head.code_of(*(sharpen(x[c : c + 512], t) for x in (tok, nxt))))
            d = F.normalize(torch.cat(codes), dim=-1)
            m, ranks, _ = corpus.corpus_metrics(q, d, split.qrels)
            g = corpus.group_metrics(ranks, split.groups)
            hn = corpus.judged_negative_accuracy(q, d, split.qrels, split.judged_negatives)
            groups = f"{g.get('R@1_title', 0):.3f} | {g.get('R@1_body', 0):.3f}"
            print(f"| {t} | {m['R@1']:.3f} | {m['R@5']:.3f} | {groups} | {hn or 0:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("--data", required=True)
    p.add_argument("--checkpoint", default="", help="default: the run's last")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-val", type=int, default=300)
    p.add_argument("--distractors", type=int, default=10000)
    p.add_argument("--negatives", type=int, default=1)
    p.add_argument("--image-size", type=int, default=96)
    p.add_argument("--temperatures", type=float, nargs="*", default=[])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    run, data = Path(a.run), Path(a.data)
    _, stage, model = load_trained(a.checkpoint or a.run)
    model.eval()
    reading_by_place(stage, model, run / "diagnose", a.image_size)
    pair_overlap(model.encoder.pairs)
    pages, queries = replay_val(a)
    ranks_by_group(run, pages, queries)
    if a.temperatures:
        temperatures(stage, model, data, queries, a.temperatures, a.image_size)


if __name__ == "__main__":
    main()
