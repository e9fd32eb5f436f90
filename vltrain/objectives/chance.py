"""The loss a contrastive objective has when its logits carry no information ("chance").

Plain math, no torch: the losses report it per step (``chance_loss`` in their metrics) and the
doctor's ``contrastive_chance`` check reads it, offline too (docs/doctor.md).
"""

from __future__ import annotations

import math


def infonce_chance(n: int, m: int, symmetric: bool = True) -> float:
    """InfoNCE's loss when the logits carry no information (every row uniform): image->text
    picks among the `n` texts and `m` hard negatives, text->image among the `n` images. Label
    smoothing does not change it (a uniform row costs ln K against any target that sums to 1).
    """
    i2t = math.log(n + m)
    return 0.5 * (i2t + math.log(n)) if symmetric else i2t


def siglip_chance(n: int, m: int) -> float:
    """SigLIP's best loss without information: every logit the same constant c, chosen best.

    Per image (the loss is the per-image sum over its K = n + m candidates, one positive):
    ``-log sigmoid(c) - (K - 1) log sigmoid(-c)`` is smallest at sigmoid(c) = 1/K, giving
    ``ln K + (K - 1) ln(K / (K - 1))``. The bias alone reaches it, so a SigLIP run whose
    embeddings carry nothing sits here, not at its initial loss.
    """
    k = n + m
    return math.log(k) + (k - 1) * math.log(k / (k - 1)) if k > 1 else 0.0
