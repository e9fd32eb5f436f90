"""The HF VLM's training loss runs the LM head only where a label is predicted: loss, token
accuracy, label count and every gradient equal the full-logits loss of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.inference.vlm_helpers import saved_vlm
from vltrain.models.captioner import IGNORE_INDEX, next_token_loss
from vltrain.models.hf_vlm import HFVLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_loss_on_labelled_positions_equals_the_full_logits_loss(kind: str, tmp_path: Path) -> None:
    model, inputs, _ = saved_vlm(kind, tmp_path / kind, eos_norm=1.0)
    wrapped = HFVLM(model.requires_grad_(True), "hf_vlm").float()
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    labels = torch.full_like(ids, IGNORE_INDEX)
    # labels on the last tokens of each row, a different count per row (and none in a middle
    # stretch), so the kept positions are a union across rows
    for row, last in enumerate((3, 5, 2)):
        labels[row, -last:] = ids[row, -last:]
    labels[1, -1] = IGNORE_INDEX
    image_side = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}

    def run(full: bool) -> tuple[tuple, dict]:
        wrapped.zero_grad(set_to_none=True)
        if full:
            logits = wrapped(image_side, ids, mask)["logits"]
            out = next_token_loss(logits, labels)
        else:
            res = wrapped(image_side, ids, mask, labels)
            out = (res["loss"], res["token_acc"], res["n_tokens"])
        out[0].backward()
        grads = {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.grad is not None}
        return out, grads

    (loss_f, acc_f, n_f), grads_f = run(full=True)
    (loss_k, acc_k, n_k), grads_k = run(full=False)
    assert int(n_k) == int(n_f) == 9
    assert torch.allclose(loss_k, loss_f, rtol=0, atol=1e-6)
    assert float(acc_k) == float(acc_f)
    assert grads_k.keys() == grads_f.keys() and len(grads_k) > 0
    for name, g in grads_f.items():
        assert torch.allclose(grads_k[name], g, rtol=0, atol=1e-6), name


def test_no_labelled_token_gives_a_zero_loss_with_a_gradient_path(tmp_path: Path) -> None:
    model, inputs, _ = saved_vlm("llava", tmp_path / "m", eos_norm=1.0)
    wrapped = HFVLM(model.requires_grad_(True), "hf_vlm").float()
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    out = wrapped(inputs, ids, mask, torch.full_like(ids, IGNORE_INDEX))
    assert float(out["loss"]) == 0.0 and int(out["n_tokens"]) == 0
    out["loss"].backward()  # no error: the graph exists
