"""What a set of runs cannot identify in L(N, D) = E + A / N^alpha + B / D^beta, from where
the runs lie alone (before any fit): too few distinct points for five parameters, a constant
N or D, or N and D that only ever move together (one isoFLOP budget, a fixed tokens-per-
parameter ratio). Approach 3 fits such runs without complaint; these say what its numbers
(and any prediction from them) rest on."""

from __future__ import annotations

import math

import numpy as np

#: approach 3's free parameters: E, A, B, alpha, beta
N_PARAMETERS = 5


def identifiability_warnings(
    params: np.ndarray,
    tokens: np.ndarray,
    budget: np.ndarray | None = None,
    tolerance: float = 0.05,
) -> list[str]:
    """One sentence per thing these runs (N `params`, D `tokens`, isoFLOP groups `budget`)
    cannot identify. N or D varying by less than `tolerance` (relative), or points within
    that of one line in (log N, log D), count as constant and as one line."""
    out = []
    points = len(set(zip(params.tolist(), tokens.tolist(), strict=True)))
    if points <= N_PARAMETERS:
        out.append(
            f"approach 3 fits {N_PARAMETERS} parameters to {points} distinct (N, D) points: "
            "no run is left over to average out the noise, so E, A, B, alpha and beta are "
            "fitted to the noise, not determined by these runs; add runs (well over "
            f"{N_PARAMETERS}: several sizes on each of several budgets)"
        )
    log_n, log_d = np.log(params), np.log(tokens)  # (R,) each
    tol = math.log1p(tolerance)
    if np.ptp(log_d) <= tol and np.ptp(log_n) <= tol:
        return out  # one point, repeated: the count above said it
    if np.ptp(log_d) <= tol:
        out.append(
            f"D is the same for every run ({np.median(tokens):.3g} tokens): beta and B are not "
            "identifiable (B / D^beta is one constant that E absorbs), nor is how the loss "
            "trades N against D, so N_opt and D_opt are not either; vary D (an isoFLOP sweep "
            "trades N against D at several budgets)"
        )
    elif np.ptp(log_n) <= tol:
        out.append(
            f"N is the same for every run ({np.median(params):.3g} parameters): alpha and A are "
            "not identifiable (A / N^alpha is one constant that E absorbs), nor is how the "
            "loss trades N against D, so N_opt and D_opt are not either; vary N"
        )
    else:
        if budget is not None and len(np.unique(budget)) == 1:
            what = f"all runs are one budget ({budget[0]:.3g} FLOPs)"
        elif _on_one_line(log_n, log_d, tol):
            slope = float(np.polyfit(log_n, log_d, 1)[0])
            what = (
                f"all runs lie on one isoFLOP line (6 N D ~ {np.median(6 * params * tokens):.3g})"
                if abs(slope + 1) <= 0.1
                else f"N and D only move together (D ~ N^{slope:.2f} across the runs)"
            )
        else:
            return out
        out.append(
            f"{what}: N and D are never varied independently, so how N_opt moves with compute "
            "(the exponent a) is not measured: approach 3 infers it from the shape of one curve "
            "under its assumed form, and a prediction at another budget extrapolates that "
            "guess; sweep at least 2 budgets (3 or more for a trend), several sizes each"
        )
    return out


def _on_one_line(log_n: np.ndarray, log_d: np.ndarray, tol: float) -> bool:
    """Whether the points (log N, log D) lie within `tol` (RMS, perpendicular) of one line."""
    centred = np.stack([log_n - log_n.mean(), log_d - log_d.mean()], axis=1)  # (R, 2)
    spread = np.linalg.svd(centred, compute_uv=False)  # (2,), largest first
    return spread[1] / math.sqrt(len(log_n)) <= tol
