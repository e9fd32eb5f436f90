"""The best R@1 a perfect model can reach when several images carry the same description.

When two images are described by captions with the same meaning (the synthetic shapes data: the
same two shapes, sizes, colours and relation), no model can tell from a caption which of them it
came from: a perfect model scores all their captions alike, and its top-1 among tied candidates
is a draw. Under a uniformly random draw among ties (the expected value of any tie-breaking that
does not peek at the labels), with images grouped by description key:

    text->image: a caption of an image in a group of g images is a hit with probability 1/g.
    image->text: an image with n of the group's T captions is a hit with probability n/T.

The reported ceilings are the means over queries (captions for text->image, images for
image->text), the same queries `image_text_retrieval` averages over. Images whose key is None
(no description) count as unique.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence


def retrieval_ceiling(
    keys: Sequence[Hashable | None], n_captions: Sequence[int]
) -> dict[str, float]:
    """Expected R@1 of a perfect model: ``{"i2t_R@1": ..., "t2i_R@1": ...}``.

    Args:
        keys: one description key per image (equal keys = indistinguishable by any caption).
        n_captions: the number of captions of each image (each >= 1).
    """
    if len(keys) != len(n_captions):
        raise ValueError(f"{len(keys)} keys but {len(n_captions)} caption counts")
    if any(n < 1 for n in n_captions):
        raise ValueError("every image needs at least one caption")
    if not keys:
        return {"i2t_R@1": 0.0, "t2i_R@1": 0.0}
    groups = [k if k is not None else ("__unique__", i) for i, k in enumerate(keys)]
    images: Counter[Hashable] = Counter(groups)
    texts: dict[Hashable, int] = defaultdict(int)
    for g, n in zip(groups, n_captions, strict=True):
        texts[g] += n
    i2t = sum(n / texts[g] for g, n in zip(groups, n_captions, strict=True)) / len(groups)
    t2i = sum(n / images[g] for g, n in zip(groups, n_captions, strict=True)) / sum(n_captions)
    return {"i2t_R@1": i2t, "t2i_R@1": t2i}
