"""The retrieval ceiling: what a perfect model expects when descriptions repeat."""

import pytest
import torch
import torch.nn.functional as F

from vltrain.data.synth import scene_key
from vltrain.eval.ceiling import retrieval_ceiling
from vltrain.eval.retrieval import image_text_retrieval


def test_hand_computed_groups():
    # images 0,1 share a description (2 + 3 captions); image 2 is alone (1 caption)
    c = retrieval_ceiling(["a", "a", "b"], [2, 3, 1])
    assert c["i2t_R@1"] == pytest.approx((2 / 5 + 3 / 5 + 1) / 3)
    assert c["t2i_R@1"] == pytest.approx((2 * 0.5 + 3 * 0.5 + 1) / 6)
    # negative control: distinct descriptions -> a perfect model is perfect
    assert retrieval_ceiling(["a", "b", "c"], [2, 3, 1]) == {"i2t_R@1": 1.0, "t2i_R@1": 1.0}
    # no description: unique
    assert retrieval_ceiling([None, None], [1, 1])["t2i_R@1"] == 1.0


@pytest.mark.slow
def test_oracle_model_meets_the_ceiling_on_average():
    """A model that embeds each description exactly (ties everywhere they must be) measures,
    averaged over random orders of the eval set, the ceiling's expected R@1."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 12, (40,), generator=g).tolist()
    n_caps = torch.randint(1, 5, (40,), generator=g).tolist()
    want = retrieval_ceiling(keys, n_caps)
    basis = F.normalize(torch.randn(12, 16, generator=g), dim=-1)
    got = {"i2t_R@1": 0.0, "t2i_R@1": 0.0}
    trials = 300
    for _ in range(trials):
        order = torch.randperm(40, generator=g).tolist()  # tie-breaking by index = random draw
        img = basis[[keys[i] for i in order]]
        owner = [j for j, i in enumerate(order) for _ in range(n_caps[i])]
        perm = torch.randperm(len(owner), generator=g)
        txt_owner = torch.tensor(owner)[perm]
        txt = img[txt_owner]
        m = image_text_retrieval(img, txt, txt_owner)
        for k in got:
            got[k] += m[k] / trials
    for k in got:
        assert got[k] == pytest.approx(want[k], abs=0.02), k
    assert want["i2t_R@1"] < 0.5  # 12 groups over 40 images: ties matter (the test can fail)


def test_scene_key_reads_the_synthetic_records():
    a = {"size": "large", "color": "red", "shape": "circle"}
    b = {"size": "small", "color": "blue", "shape": "square"}
    left = {"objects": [a, b], "relation": "left of"}
    right = {"objects": [b, a], "relation": "right of"}
    assert scene_key(left) == scene_key(right)  # "A left of B" == "B right of A"
    assert scene_key(left) != scene_key({"objects": [a, b], "relation": "right of"})
    assert scene_key({"objects": [a], "relation": None}) == (("large", "red", "circle"),)
    assert scene_key({"text": ["x"]}) is None  # not synthetic data: no key
