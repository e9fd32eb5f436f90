"""Drafter loss parity: vltrain's DFlash block objective against `speculators` (vllm-project).

Run in a venv that has `speculators` (it pulls torchvision, so not the project venv):
``python bench/speculators_parity.py``. No timing; a correctness check printed as a table.

What is compared, on the same random logits / labels / masks (blocks built by vltrain's own
``sample_anchors`` + ``block_labels`` from padded rows with unsupervised spans, so blocks hold
invalid slots mid-block and padded anchors hold none), block sizes 4 / 8 / 16, several gammas:

- position weights: ``position_weights`` vs ``speculators.losses.dflash_loss_decay``;
- per-slot CE: ``slot_loss`` vs ``speculators.losses.eager.ce_loss``;
- D-PACE weights: ``dpace_weights`` vs ``speculators.losses.dpace_loss_decay``;
- the loss: ``speculators.models.dflash.metrics.compute_metrics`` normalises by the number of
  supervised slots (+ 1e-5), vltrain by the weight sum. The weighted CE sum is compared to
  1e-6 through the peer's normaliser; vltrain's ``sum(CE w) / sum(w)`` is printed beside it
  (a documented difference, not a parity claim);
- metrics both define: exact acceptance length (vltrain ``tau`` vs peer ``eal``), slot accuracy
  over slots >= 1 (``acc`` vs ``full_acc``), per-slot accuracy (``acc_k`` vs
  ``position_k_acc``), block count (``blocks`` vs ``eal_total``).

Every parity row asserts max |diff| <= 1e-6; the negative controls (gamma hard-coded to 4 at
block 16, the decay started one slot early, tau without the bonus token, a bug in D-PACE's
prefix) must each be detected (diff > 1e-3), so the check cannot pass vacuously.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from importlib.metadata import version

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOL = 1e-6
DETECT = 1e-3


def load_objective():
    """vltrain/objectives/drafter.py by path: it needs only torch, not the package's deps."""
    path = os.path.join(ROOT, "vltrain", "objectives", "drafter.py")
    spec = importlib.util.spec_from_file_location("vltrain_drafter_objective", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


obj = load_objective()
sys.path.insert(0, ROOT)
from speculators.losses import dflash_loss_decay, dpace_loss_decay, eager  # noqa: E402
from speculators.models.dflash.metrics import compute_metrics  # noqa: E402

from vltrain.data import draft_data  # noqa: E402  (torch, numpy, pillow, pyyaml: light deps)

PEER_CE = {"ce": (eager.ce_loss, 1.0)}  # eager: the fused losses need Triton on a GPU


def make_case(block: int, seed: int, rows: int = 3, t: int = 48, anchors: int = 8, v: int = 64):
    """Random blocks from padded rows: labels (B, J, K), valid (B, J, K), logits (B, J, K, V).

    Row r has length ``t - 9 r`` (the rest is padding), a prompt of 5 unsupervised tokens and
    one unsupervised span mid-row, so some blocks stop early and some slots are invalid inside
    a block. Logits favour the label on ~75% of slots so acceptance runs have varied lengths.
    """
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, v, (rows, t), generator=g)
    labels = torch.full((rows, t), -100)
    for r in range(rows):
        n = t - 9 * r
        labels[r, 5:n] = tok[r, 5:n]
        labels[r, 20 + r : 23 + r] = -100  # unsupervised span inside the row
    anc = [draft_data.sample_anchors(labels[r] >= 0, anchors, g) for r in range(rows)]
    j = max(len(a) for a in anc)
    anchor_pos = torch.zeros(rows, j, dtype=torch.long)
    anchor_valid = torch.zeros(rows, j, dtype=torch.bool)
    for r, a in enumerate(anc):
        anchor_pos[r, : len(a)] = a
        anchor_valid[r, : len(a)] = True
    anchor_valid[-1, -1] = False  # a padded anchor in the last row
    lab, valid = obj.block_labels(labels, anchor_pos, anchor_valid, block)
    logits = torch.randn(rows, j, block, v, generator=g)
    favour = torch.rand(rows, j, block, generator=g) < 0.75
    logits.scatter_add_(-1, lab[..., None], 4.0 * favour[..., None].float())
    return logits, lab, valid


def to_peer(logits, lab, valid):
    """The peer's packed layout: [1, blocks * K, V] logits, one-hot target logits, mask."""
    v = logits.shape[-1]
    targets = torch.nn.functional.one_hot(lab, v).float() * 10.0  # argmax = label
    return logits.reshape(1, -1, v), targets.reshape(1, -1, v), valid.reshape(1, -1).float()


def pos_idx(block: int, n: int) -> torch.Tensor:
    return (torch.arange(n) % block).float()[None]


def maxdiff(a, b) -> float:
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max())


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, str]] = []

    def parity(self, name: str, case: str, diff: float) -> None:
        self.rows.append((name, case, diff, "ok" if diff <= TOL else "FAIL"))

    def control(self, name: str, case: str, diff: float) -> None:
        self.rows.append((name, case, diff, "detected" if diff > DETECT else "MISSED"))

    def print(self) -> bool:
        print("| check | case | max abs diff | result |")
        print("|---|---|---|---|")
        for name, case, diff, res in self.rows:
            print(f"| {name} | {case} | {diff:.2e} | {res} |")
        return all(r[3] in ("ok", "detected") for r in self.rows)

    def summary(self) -> None:
        """One line per check: how many cases, the largest difference, the worst result."""
        print("\n| check | cases | max abs diff | result |")
        print("|---|---|---|---|")
        names = dict.fromkeys(r[0] for r in self.rows)
        for name in names:
            rows = [r for r in self.rows if r[0] == name]
            bad = [r[3] for r in rows if r[3] in ("FAIL", "MISSED")]
            worst = min if rows[0][3] == "detected" else max
            diff = worst(r[2] for r in rows)
            print(f"| {name} | {len(rows)} | {diff:.2e} | {bad[0] if bad else rows[0][3]} |")


def ours_metrics(logits, lab, valid) -> dict[str, float]:
    return obj.summarize_metrics(obj.block_metrics(logits, lab, valid))


def peer_metrics(m: dict, block: int) -> dict[str, float]:
    out = {
        "tau": float(m["eal_sum"] / m["eal_total"]),
        "acc": float(m["full_acc_sum"] / m["full_acc_total"]),
        "blocks": float(m["eal_total"]),
    }
    for k in range(1, block):
        if float(m[f"position_{k}_acc_total"]) > 0:
            out[f"acc_{k}"] = float(m[f"position_{k}_acc_sum"] / m[f"position_{k}_acc_total"])
    return out


def check_fixed(tab: Table, block: int, gamma: float, seed: int) -> None:
    case = f"K={block} gamma={gamma:g} seed={seed}"
    logits, lab, valid = make_case(block, seed)
    lp, tp, mp = to_peer(logits, lab, valid)
    w_ours = obj.position_weights(block, gamma)
    w_peer = dflash_loss_decay(pos_idx(block, block), gamma)[0]
    tab.parity("position weights", case, maxdiff(w_ours, w_peer))

    ce = obj.slot_loss(logits, lab, valid)  # (B, J, K), 0 where invalid
    ce_peer = eager.ce_loss(lp, tp) * mp
    tab.parity("per-slot CE", case, maxdiff(ce.reshape(1, -1), ce_peer))

    num, den = obj.weighted_loss(ce, valid, w_ours)
    loss_peer, m = compute_metrics(
        lp,
        tp,
        mp,
        block,
        gamma=gamma,
        loss_config=PEER_CE,
        per_position_loss_weight="fixed-exp-decay",
    )
    n_sup = float(valid.sum())
    tab.parity("loss (peer's normaliser)", case, maxdiff(num / (n_sup + 1e-5), loss_peer))
    ratio = float(num / den) / float(loss_peer)
    print(
        f"{case}: vltrain sum(CE w)/sum(w) = {float(num / den):.6f}, speculators "
        f"sum(CE w)/(n + 1e-5) = {float(loss_peer):.6f} (ratio {ratio:.4f} = n / sum(w))"
    )

    ours, peer = ours_metrics(logits, lab, valid), peer_metrics(m, block)
    keys = ["tau", "acc"] + [k for k in peer if k.startswith("acc_")]
    assert set(keys) <= set(ours), f"vltrain metrics lack {set(keys) - set(ours)}"
    tab.parity("tau / eal, acc, acc_k", case, max(maxdiff(ours[k], peer[k]) for k in keys))
    blocks_ours = float(obj.block_metrics(logits, lab, valid)["blocks"])
    tab.parity("blocks / eal_total", case, maxdiff(blocks_ours, peer["blocks"]))
    assert 1.3 < ours["tau"] < block - 1, f"{case}: tau {ours['tau']} too trivial to test"
    assert len(keys) == block + 1, f"{case}: some slot has no supervised sample"
    assert n_sup < valid.shape[0] * valid.shape[1] * (block - 1), f"{case}: no invalid slot"


def check_dpace(tab: Table, block: int, alpha: float, seed: int) -> None:
    case = f"K={block} D-PACE alpha={alpha:g} seed={seed}"
    logits, lab, valid = make_case(block, seed)
    lp, tp, mp = to_peer(logits, lab, valid)
    ce = obj.slot_loss(logits, lab, valid)
    w_ours = obj.dpace_weights(ce, valid, alpha)  # (B, J, K)
    w_peer = dpace_loss_decay(
        pos_idx(block, lp.shape[1]),
        loss_mask=mp,
        block_size=block,
        dpace_alpha=alpha,
        elementwise_loss=eager.ce_loss(lp, tp) * mp,
    )
    tab.parity("D-PACE weights", case, maxdiff(w_ours.reshape(1, -1), w_peer))
    num, _ = obj.weighted_loss(ce, valid, obj.position_weights(block, 1.0), dpace=alpha)
    loss_peer, _ = compute_metrics(
        lp,
        tp,
        mp,
        block,
        loss_config=PEER_CE,
        per_position_loss_weight="dpace",
        dpace_alpha=alpha,
    )
    tab.parity(
        "D-PACE loss (peer's normaliser)", case, maxdiff(num / (valid.sum() + 1e-5), loss_peer)
    )
    den = float(w_ours.sum())
    print(
        f"{case}: vltrain sum(CE w)/sum(w) = {float(num) / den:.6f}, speculators "
        f"sum(CE w)/(n + 1e-5) = {float(loss_peer):.6f} (n / sum(w) = "
        f"{float(valid.sum()) / den:.4f})"
    )
    if alpha < 1:  # alpha = 1 makes every q~ 1: a prefix bug would not change anything
        bad = w_ours.clone()
        bad[..., 1:] = obj.dpace_weights(ce, valid, alpha)[..., :-1]  # prefix shifted one slot
        tab.control("D-PACE, weights one slot late", case, maxdiff(bad.reshape(1, -1), w_peer))


def controls(tab: Table) -> None:
    """Bugs the parity rows must catch."""
    block = 16
    w_peer = dflash_loss_decay(pos_idx(block, block), obj.default_gamma(block))[0]
    tab.control(
        "gamma hard-coded 4 at K=16", "K=16", maxdiff(obj.position_weights(block, 4.0), w_peer)
    )
    k = torch.arange(block, dtype=torch.float32)
    early = torch.exp(-k / 7.0)
    early[0] = 0.0  # decay from slot 0 instead of slot 1
    tab.control("decay one slot early", "K=16 gamma=7", maxdiff(early, w_peer))
    logits, lab, valid = make_case(8, 3)
    lp, tp, mp = to_peer(logits, lab, valid)
    _, m = compute_metrics(
        lp, tp, mp, 8, loss_config=PEER_CE, per_position_loss_weight="fixed-exp-decay"
    )
    tau_no_bonus = ours_metrics(logits, lab, valid)["tau"] - 1.0
    tab.control(
        "tau without the bonus token", "K=8", maxdiff(tau_no_bonus, peer_metrics(m, 8)["tau"])
    )


def main() -> int:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    print(
        f"speculators {version('speculators')}, torch {torch.__version__}, "
        f"python {platform.python_version()}, {cpu}"
    )
    default_k = {k: obj.default_gamma(k) for k in (4, 8, 16)}
    print(f"default gamma: vltrain {default_k}; speculators 4.0 for every block size")
    tab = Table()
    for block in (4, 8, 16):
        for gamma in sorted({obj.default_gamma(block), 4.0, 10.0}):
            for seed in (0, 1):
                check_fixed(tab, block, gamma, seed)
        for alpha in (0.25, 0.5, 1.0):
            check_dpace(tab, block, alpha, seed=2)
    controls(tab)
    ok = tab.print()
    tab.summary()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
