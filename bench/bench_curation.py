"""Curation side by side: caption MinHash-LSH vs datasketch, pHash/dHash vs imagehash, the
decontamination Bloom filter vs rbloom, and P/R on a labelled planted image benchmark built
from photos that ship in scikit-image plus planted transforms.

    PYTHONPATH=. python bench/bench_curation.py [--captions 20000] [--copies 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vltrain.curation import minhash, planted
from vltrain.curation.bloom import BloomFilter
from vltrain.curation.decode import decode_rgb
from vltrain.curation.features import Features, FeatureSettings, iter_features
from vltrain.curation.hashing import image_hashes
from vltrain.curation.pipeline import CurateOptions, Decider
from vltrain.curation.text import NgramHasher, jaccard, words, words_batch

_PHOTOS = ("astronaut", "camera", "chelsea", "coffee", "coins", "horse", "rocket", "moon", "page",
           "text", "clock", "immunohistochemistry", "hubble_deep_field", "logo", "brick", "grass",
           "gravel", "colorwheel", "cell")  # fmt: skip


def photos() -> list[Image.Image]:
    """Real photos that ship inside Python packages: scikit-image's `data`, scikit-learn's
    sample images and matplotlib's sample data (no download)."""
    import matplotlib.cbook
    from skimage import data
    from sklearn.datasets import load_sample_images

    out = []
    for name in _PHOTOS:
        a = getattr(data, name)()
        out.append(Image.fromarray(a.astype(np.uint8)).convert("RGB"))
    out += [Image.fromarray(a).convert("RGB") for a in load_sample_images().images]
    for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png"):
        with Image.open(matplotlib.cbook.get_sample_data(name, asfileobj=False)) as im:
            out.append(im.convert("RGB"))
    return out


def captions(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """n captions: ~30% planted near-copies (one or two word edits) of earlier ones; labels =
    the cluster id of each caption."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    texts, label = [], []
    for i in range(n):
        if texts and rng.random() < 0.3:
            j = rng.randrange(len(texts))
            texts.append(planted.noisy_caption(texts[j], rng, rng.choice((1, 2))))
            label.append(label[j])
        else:
            texts.append(" ".join(rng.choices(vocab, k=rng.randint(12, 24))))
            label.append(i)
    return texts, label


def _minhash_part(texts: list[str], num_perm: int = 128, bands: int = 14, rows: int = 9) -> tuple:
    """One worker's share, shared-nothing: tokens, shingle sets, signatures and band keys;
    returns (flat shingles, offsets, band keys, CPU seconds it took). The parent only merges
    the band keys (one sort per band) and verifies candidates."""
    c0 = time.process_time()
    flat, off = NgramHasher(3).shingle_sets([[t] for t in words_batch(texts)])
    sigs = minhash.MinHasher(num_perm).signatures_flat(flat, off)  # (n, P)
    return flat, off, minhash.band_keys(sigs, bands, rows), time.process_time() - c0


_TEXTS: list[str] = []


def _load_texts(texts: list[str]) -> None:
    """Pool initializer: each worker holds the input, as a worker reading its own part of a
    file would (not timed); a task then names only its range."""
    _TEXTS[:] = texts


def _minhash_range(start: int, end: int, num_perm: int, bands: int, rows: int) -> tuple:
    return _minhash_part(_TEXTS[start:end], num_perm, bands, rows)


def _ours_minhash(texts: list[str], pool, b: int, r: int, threshold: float) -> tuple:
    """Shingles + signatures + band keys in this process (pool None) or in a warm pool's
    workers (one chunk per worker), then LSH candidates and exact verification here.
    Returns (flat, offsets, verified pairs, CPU seconds spent in workers)."""
    if pool is None:
        parts = [_minhash_part(texts, 128, b, r)]
    else:
        step = -(-len(texts) // pool._processes)  # one shared-nothing range per worker
        ranges = [(i, min(i + step, len(texts)), 128, b, r) for i in range(0, len(texts), step)]
        parts = pool.starmap(_minhash_range, ranges)
    flat = np.concatenate([x[0] for x in parts])
    sizes = np.concatenate([np.diff(x[1]) for x in parts])
    off = np.concatenate([[0], np.cumsum(sizes)])
    keys = np.concatenate([x[2] for x in parts])  # (N, bands)
    pairs = minhash.key_pairs(keys)
    sim = minhash.pair_jaccard(flat, off, pairs)
    ok = sim >= threshold
    found = {(i, j): s for (i, j), s in zip(pairs[ok].tolist(), sim[ok].tolist(), strict=True)}
    return flat, off, found, (sum(x[3] for x in parts) if pool is not None else 0.0)


def _textdedup(texts: list[str], python: str | None, threshold: float) -> dict | None:
    """text-dedup's MinHash on the same captions, in its own venv (bench/textdedup_runner.py);
    None when that interpreter is not there."""
    if not python or not Path(python).exists():
        return None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "captions.txt"
        path.write_text("\n".join(texts), encoding="utf-8")
        runner = Path(__file__).with_name("textdedup_runner.py")
        out = subprocess.run(
            [python, str(runner), str(path), "--threshold", str(threshold)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    res = json.loads(out.stdout)
    res["pairs"] = {tuple(x) for x in res["pairs"]}
    return res


def bench_minhash(
    n: int, threshold: float = 0.7, num_perm: int = 128, textdedup_python: str | None = None
) -> list[str]:
    from datasketch import MinHash, MinHashLSH

    texts, _ = captions(n)
    b, r = minhash.optimal_params(threshold, num_perm)
    _ours_minhash(texts[:200], None, b, r, threshold)  # warm: imports, first-call numpy
    runs = []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        flat, off, found, _ = _ours_minhash(texts, None, b, r, threshold)
        runs.append((time.perf_counter() - t0, time.process_time() - c0))
    t_ours, c_ours = (float(np.median([x[i] for x in runs])) for i in (0, 1))
    runs2 = []
    with multiprocessing.get_context("spawn").Pool(2, _load_texts, (texts,)) as pool:
        pool.starmap(_minhash_range, [(0, 10, 128, b, r)] * 2)  # warm: spawn not counted
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            _, _, found2, c_workers = _ours_minhash(texts, pool, b, r, threshold)
            runs2.append((time.perf_counter() - t0, time.process_time() - c0 + c_workers))
            assert found2.keys() == found.keys()
    t_ours2, c_ours2 = (float(np.median([x[i] for x in runs2])) for i in (0, 1))
    ours = set(found)
    t0, c0 = time.perf_counter(), time.process_time()
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    mhs = []
    for i, t in enumerate(texts):
        toks = words(t)
        m = MinHash(num_perm=num_perm)
        m.update_batch([" ".join(toks[k : k + 3]).encode() for k in range(len(toks) - 2)])
        lsh.insert(i, m)
        mhs.append(m)
    theirs = {(min(i, j), max(i, j)) for i, m in enumerate(mhs) for j in lsh.query(m) if i != j}
    t_theirs, c_theirs = time.perf_counter() - t0, time.process_time() - c0
    td = _textdedup(texts, textdedup_python, threshold)
    tdp = td["pairs"] if td else set()
    sh = [flat[off[i] : off[i + 1]] for i in range(n)]
    truth = {p for p in ours | theirs | tdp if jaccard(sh[p[0]], sh[p[1]]) >= threshold}

    # exhaustive truth would be O(n^2) pairs; the union of every tool's candidates, checked by
    # exact Jaccard, is the standard bound (a pair no tool finds counts for none)
    def prf(found: set) -> str:
        tp = len(found & truth)
        prec, rec = tp / max(len(found), 1), tp / max(len(truth), 1)
        return f"P={prec:.3f} R={rec:.3f} F1={2 * prec * rec / max(prec + rec, 1e-12):.3f}"

    rows = [
        f"| caption MinHash-LSH, {n:,} captions, word 3-grams, J>={threshold}, {num_perm} perms, "
        f"{b}x{r} bands, true pairs {len(truth):,} | tool | P/R/F1 | captions/s wall | "
        f"captions per CPU-second |",
        f"| | vltrain, 1 process | {prf(ours)} | {n / t_ours:,.0f} | {n / c_ours:,.0f} |",
        f"| | vltrain, 2 workers (parent merges band keys, verifies) | {prf(ours)} | "
        f"{n / t_ours2:,.0f} | {n / c_ours2:,.0f} (parent + workers) |",
        f"| | datasketch MinHashLSH | {prf(theirs)} | {n / t_theirs:,.0f} | {n / c_theirs:,.0f} |",
    ]
    if td:
        rows.append(
            f"| | text-dedup {td['version'] or '0.4.0'} minhash (its embed_func, {td['bands']}x"
            f"{td['rows']}) | {prf(tdp)} | {n / td['wall_s']:,.0f} | {n / td['cpu_s']:,.0f} |"
        )
    else:
        rows.append("| | text-dedup | not run (no --textdedup-python interpreter) | | |")
    return rows


def _hash_files(paths: list[Path]) -> float:
    """vltrain's features of each file as `vltrain data curate`'s workers compute them:
    `decode_rgb` (libspng for plain PNGs, else Pillow via `load_image_native`: bomb check,
    EXIF orientation, RGB), then `image_hashes` (content key, pHash, dHash and mirrors, colour
    thumbnail, crop windows). Returns this process's CPU seconds."""
    c0 = time.process_time()
    for p in paths:
        d = decode_rgb(p)
        image_hashes(d.image, 0, d.pixels)
    return time.process_time() - c0


def _curate_workers(paths: list[Path], workers: int) -> tuple[float, float, int]:
    """(wall seconds of `iter_features` over >= 640 records of these files with `workers`
    processes less the pool start-up, the start-up (a run on one file), the record count): the
    code path of `vltrain data curate --workers N` (one caption each)."""
    s = FeatureSettings(str(paths[0].parent), 0, 3, 128, 13, 14, 9)
    names = [p.name for p in paths] * -(-640 // len(paths))  # >= 10 chunks: a balanced tail
    items = [(i, name, ["a photo"]) for i, name in enumerate(names)]
    t0 = time.perf_counter()
    list(iter_features(items[:1], s, workers))
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    list(iter_features(items, s, workers))
    return time.perf_counter() - t0 - start, start, len(items)


def _imagehash_files(paths: list[Path]) -> float:
    import imagehash

    c0 = time.process_time()
    for p in paths:
        with Image.open(p) as im:
            imagehash.phash(im)
            imagehash.dhash(im)
    return time.process_time() - c0


def _decode_files(paths: list[Path]) -> float:
    c0 = time.process_time()
    for p in paths:
        with Image.open(p) as im:
            im.load()
    return time.process_time() - c0


def _decode_grey_files(paths: list[Path]) -> float:
    c0 = time.process_time()
    for p in paths:
        with Image.open(p) as im:
            im.convert("L")
    return time.process_time() - c0


def _floor_files(paths: list[Path]) -> float:
    """The floor for identical pHash + dHash: what imagehash itself needs, done once: decode,
    one grey conversion, the two full-resolution LANCZOS thumbnails (32x32 and 9x8)."""
    c0 = time.process_time()
    for p in paths:
        with Image.open(p) as im:
            grey = im.convert("L")
            grey.resize((32, 32), Image.Resampling.LANCZOS)
            grey.resize((9, 8), Image.Resampling.LANCZOS)
    return time.process_time() - c0


def _floor_ours(paths: list[Path]) -> float:
    """The same floor with vltrain's decoder (libspng for plain PNGs)."""
    c0 = time.process_time()
    for p in paths:
        grey = decode_rgb(p).image.convert("L")
        grey.resize((32, 32), Image.Resampling.LANCZOS)
        grey.resize((9, 8), Image.Resampling.LANCZOS)
    return time.process_time() - c0


def _decode_ours(paths: list[Path]) -> float:
    c0 = time.process_time()
    for p in paths:
        decode_rgb(p)
    return time.process_time() - c0


def _alternating(fns: dict, paths: list[Path], workers: int, rounds: int) -> dict:
    """{name: (wall, CPU seconds of the workers)}, medians over rounds that run every fn once
    in turn, each fn in its own warm pool of `workers` processes fed 4-file chunks as they
    free up (so one slow photo does not leave a worker idle)."""
    chunks = [paths[i : i + 4] for i in range(0, len(paths), 4)]
    ctx = multiprocessing.get_context("spawn")
    pools = {name: ctx.Pool(workers) for name in fns}
    try:
        for name, fn in fns.items():
            pools[name].map(fn, [paths[:1]] * workers)  # warm the workers (imports)
        runs: dict[str, list] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                cpu = sum(pools[name].map(fn, chunks, chunksize=1))
                runs[name].append((time.perf_counter() - t0, cpu))
    finally:
        for pool in pools.values():
            pool.terminate()
    return {
        k: (float(np.median([x[0] for x in v])), float(np.median([x[1] for x in v])))
        for k, v in runs.items()
    }


def _interleaved(fns: dict, paths: list[Path], rounds: int = 5) -> dict:
    """{name: (wall, CPU seconds)}, medians over rounds that each run every fn once in turn,
    so a change of machine load hits all of them alike (one process)."""
    runs: dict[str, list] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            cpu = fn(paths)
            runs[name].append((time.perf_counter() - t0, cpu))
    return {
        k: (float(np.median([x[0] for x in v])), float(np.median([x[1] for x in v])))
        for k, v in runs.items()
    }


def _shortcut_checks(imgs: list[Image.Image]) -> str:
    """Are `reduce()` / JPEG `draft()` before the LANCZOS thumbnails equivalent to imagehash's
    full-resolution path? Counts photos whose pHash AND dHash stay identical."""
    import io

    import imagehash

    def hashes(im: Image.Image) -> tuple[str, str]:
        return str(imagehash.phash(im)), str(imagehash.dhash(im))

    same_reduce = same_draft = n_reduce = 0
    for im in imgs:
        want = hashes(im)
        k = min(im.size) // 64  # leaves >= 64 px, twice the 32 px thumbnail
        if k >= 2:
            n_reduce += 1
            same_reduce += hashes(im.reduce(k)) == want
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        with Image.open(io.BytesIO(buf.getvalue())) as full:
            want_jpeg = hashes(full.convert("RGB"))
        with Image.open(io.BytesIO(buf.getvalue())) as small:
            small.draft("RGB", (64, 64))
            same_draft += hashes(small.convert("RGB")) == want_jpeg
    return (
        f"| shortcuts (not used) | `reduce(k)` to >= 64 px first: {same_reduce}/{n_reduce} "
        f"photos keep both hashes; JPEG `draft` to >= 64 px: {same_draft}/{len(imgs)} | | |"
    )


def bench_image_hashes(imgs: list[Image.Image], reps: int) -> list[str]:
    import imagehash

    same = all(
        image_hashes(im).phash == int(str(imagehash.phash(im)), 16)
        and image_hashes(im).dhash == int(str(imagehash.dhash(im)), 16)
        for im in imgs
    )
    px = sorted(im.width * im.height for im in imgs)
    rows = [
        f"| {len(imgs)} photos, {px[0]:,}..{px[-1]:,} px (median {px[len(px) // 2]:,}; "
        f"{sum(p >= 512 * 512 for p in px)} of them >= 512x512), x{reps} | images/s wall | "
        f"images per CPU-second | vs imagehash (CPU) |",
        _shortcut_checks(imgs),
    ]
    with tempfile.TemporaryDirectory() as d:
        for fmt in ("png", "jpg"):
            paths = []
            for i, im in enumerate(imgs * reps):
                p = Path(d) / f"{i}.{fmt}"
                im.save(p, quality=90) if fmt == "jpg" else im.save(p)
                paths.append(p)
            n = len(paths)
            t = _interleaved(
                {
                    "decode": _decode_files,
                    "grey": _decode_grey_files,
                    "floor": _floor_files,
                    "ours": _hash_files,
                    "theirs": _imagehash_files,
                },
                paths,
            )
            t |= _interleaved({"decode_ours": _decode_ours, "floor_ours": _floor_ours}, paths)
            pair = _alternating({"ours2": _hash_files, "theirs2": _imagehash_files}, paths, 2, 5)
            t |= pair
            cpu_theirs = t["theirs"][1]
            for name, label in (
                ("ours", "vltrain features (identical hashes: " + str(same) + "), 1 process"),
                ("ours2", "vltrain features, 2 workers (5 rounds alternating with imagehash)"),
                ("theirs", "imagehash phash + dhash, 1 process"),
                ("theirs2", "imagehash, 2 processes (alternating)"),
                ("decode", "Pillow decode alone"),
                ("decode_ours", "vltrain decode alone (libspng for plain PNGs)"),
                ("grey", "Pillow decode + one grey conversion"),
                ("floor", "floor, Pillow decode: + grey + the two LANCZOS thumbnails"),
                ("floor_ours", "floor, vltrain decode: + grey + the two LANCZOS thumbnails"),
            ):
                wall, cpu = t[name]
                rows.append(
                    f"| {fmt.upper()} {label} | {n / wall:,.0f} | {n / cpu:,.0f} | "
                    f"{cpu_theirs / cpu:.2f}x |"
                )
            rows.append(
                f"| {fmt.upper()} 2-worker wall vs imagehash 2 processes | "
                f"{pair['theirs2'][0] / pair['ours2'][0]:.2f}x | | |"
            )
            wall, start, m = _curate_workers(paths, 2)
            rows.append(
                f"| {fmt.upper()} `iter_features` (the curate workers, 64-record chunks), {m} "
                f"records, 2 workers, pool start-up {start:.1f} s excluded | {m / wall:,.0f} | | |"
            )
    return rows


def bench_bloom(n: int) -> list[str]:
    from rbloom import Bloom

    items = [f"ngram {i} of an eval caption" for i in range(n)]
    probes = [f"not a member {i}" for i in range(n)]
    t0 = time.perf_counter()
    f = BloomFilter(n, 1e-4, seed=0)
    f.update(items)
    fp = sum(p in f for p in probes) / n
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    rb = Bloom(n, 1e-4)  # Python hash(): salted per process, so it cannot be persisted as is
    rb.update(items)
    fp_rb = sum(p in rb for p in probes) / n
    t_rb = time.perf_counter() - t0
    return [
        f"| Bloom decontamination filter, {n} items, fpr 1e-4 | vltrain measured fpr {fp:.1e}, "
        f"{2 * n / t_ours:,.0f} ops/s, seeded & persistable | rbloom fpr {fp_rb:.1e}, "
        f"{2 * n / t_rb:,.0f} ops/s, process-salted hash | {t_ours / t_rb:.0f}x slower |"
    ]


def bench_planted(imgs: list[Image.Image], copies: int) -> list[str]:
    """Every photo plus `copies` transformed copies of each kind, hash stage (pHash/dHash,
    crop windows, thumbnails); run with the originals first and again with the copies first
    (so both directions of the crop match are exercised). Precision: removals whose witness
    is the same photo; recall per kind: copies removed (originals-first order), or originals
    removed against that copy (copies-first order)."""
    rng = random.Random(0)
    items, label = [(im, "original") for im in imgs], list(range(len(imgs)))
    for kind in planted.KINDS:
        for _ in range(copies):
            k = rng.randrange(len(imgs))
            items.append((planted.transform(imgs[k], kind, rng), kind))
            label.append(k)
    hashes = [image_hashes(im) for im, _ in items]
    rows = []
    for order_name, order in (
        ("originals first", list(range(len(items)))),
        ("copies first", list(range(len(imgs), len(items))) + list(range(len(imgs)))),
    ):
        dec = Decider(CurateOptions(), 14, 9)
        found: dict[str, list[int]] = {}
        right = wrong = 0
        for i in order:
            f = _image_features(i, hashes[i])
            d = dec.match(f)
            kind = items[i][1]
            if d.reason is None:
                dec.insert(f)
            else:
                ok = label[d.witness] == label[i]
                right, wrong = right + ok, wrong + (not ok)
                kind = kind if kind != "original" else items[d.witness][1]
            if items[i][1] != "original" or d.reason:
                s = found.setdefault(kind, [0, 0])
                s[0] += d.reason is not None and label[d.witness] == label[i]
        for i in range(len(imgs), len(items)):
            found.setdefault(items[i][1], [0, 0])[1] += 1
        if order_name == "copies first":  # each original is found at most once
            for s in found.values():
                s[0] = min(s[0], s[1])
        tr = [found[k] for k in planted.KINDS if k not in ("exact", "resized")]
        rec = sum(a for a, _ in tr) / max(sum(b for _, b in tr), 1)
        per_kind = ", ".join(f"{k} {found[k][0]}/{found[k][1]}" for k in planted.KINDS)
        rows.append(
            f"| planted photos ({len(imgs)} photos, {copies} copies per kind), {order_name} | "
            f"precision {right / max(right + wrong, 1):.3f} ({wrong} wrong), transformed recall "
            f"{rec:.3f}; {per_kind} |"
        )
    return rows


def _image_features(i: int, h) -> Features:
    empty = np.zeros(0, np.uint64)
    sig, keys = np.full(128, i, np.uint64), np.full(14, i, np.uint64)  # captions never match
    return Features(i, h, None, i, empty, sig, keys, "", (), ())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--captions", type=int, default=20000)
    p.add_argument("--copies", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--textdedup-python",
        default="/work/venv-textdedup/bin/python",
        help="interpreter of a venv with text-dedup (bench/textdedup_runner.py)",
    )
    p.add_argument("--only", choices=("minhash", "images", "bloom", "planted"), nargs="*")
    a = p.parse_args()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln), "?"
    )
    print(f"CPU: {cpu}; Python {platform.python_version()}; numpy {np.__version__}; "
          f"load average {os.getloadavg()}")  # fmt: skip
    only = set(a.only or ("minhash", "images", "bloom", "planted"))
    imgs = photos() if only & {"images", "planted"} else []
    rows = (
        bench_minhash(a.captions, textdedup_python=a.textdedup_python) if "minhash" in only else []
    )
    rows += bench_image_hashes(imgs, a.reps) if "images" in only else []
    rows += bench_bloom(100_000) if "bloom" in only else []
    rows += bench_planted(imgs, a.copies) if "planted" in only else []
    for row in rows:
        print(row)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
