"""The probe on a real module and optimizer: what the loop's hooks let the doctor see."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vltrain.diagnostics.probe import SAMPLE, Probe, _sample_index
from vltrain.diagnostics.record import StepRecord


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 4)  # never in the forward: no gradient


def _step(net, opt, probe, zero=True, x=None) -> StepRecord:
    x = torch.randn(8, 4) if x is None else x
    net.head(net.vision(x)).pow(2).mean().backward()
    opt.step()
    rec = StepRecord(step=0, loss=0.0, grad_norm=1.0, lr=opt.param_groups[0]["lr"])
    probe.fill(rec)
    if zero:
        opt.zero_grad(set_to_none=True)
    return rec


def test_probe_sees_steps_stale_grads_and_missing_gradients():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    probe = Probe(net, opt, [], True)
    rec = _step(net, opt, probe)
    assert rec.stepped and rec.update_ratio[0] > 0 and rec.lr_applied == [1e-2]
    assert sorted(rec.no_grad) == ["unused.bias", "unused.weight"] and not rec.stale_grads
    rec = _step(net, opt, probe, zero=False)  # control: this one was zeroed before
    assert not rec.stale_grads
    rec = _step(net, opt, probe)  # the previous step did not zero: stale at this backward
    assert rec.stale_grads
    for g in opt.param_groups:
        g["lr"] = 0.0
    rec = _step(net, opt, probe)
    assert rec.update_ratio == [0.0]
    probe.close()


def test_probe_structure_and_provenance():
    net = Net()
    net.vision.requires_grad_(False)  # frozen though model.freeze does not say so
    opt = torch.optim.AdamW(net.head.parameters(), lr=1e-3)  # `unused` left out
    probe = Probe(net, opt, [], True)
    assert sorted(probe.frozen_unasked) == ["vision.bias", "vision.weight"]
    assert sorted(probe.not_in_optimizer) == ["unused.bias", "unused.weight"]
    ok = Probe(net, torch.optim.AdamW(net.parameters(), lr=1e-3), ["vision"], True)
    assert ok.frozen_unasked == [] and ok.frozen_trainable == []
    net.head.weight.data[0, 1] = float("inf")
    assert probe.provenance() == {"kind": "weight", "first": "head.weight", "count": 1}
    net.head.weight.data[0, 1] = 0.0
    net.head.bias.grad = torch.tensor([float("nan")])
    assert probe.provenance()["first"] == "head.bias"
    probe.close()
    ok.close()


def test_parts_frozen_by_design_are_not_unasked() -> None:
    """A part that freezes some of its own parameters lists them in ``frozen_by_design`` (an
    HF embedder's LM head): the frozen-part check leaves them out, and still names the rest."""
    net = Net()
    net.vision.frozen_by_design = ("weight",)  # as the part would declare it
    net.vision.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    assert Probe(net, opt, [], True).frozen_unasked == []
    net.head.bias.requires_grad_(False)  # frozen by nobody's design
    assert Probe(net, opt, [], True).frozen_unasked == ["head.bias"]


def test_a_vlm_embedder_full_finetune_declares_its_frozen_lm_head(tmp_path) -> None:
    """A full fine-tune (lora_r 0) of a VLM embedder: its LM head never reaches the embedding
    and is frozen by construction; the doctor's check used to call that an error."""
    pytest.importorskip("transformers")
    from tests.models import vlm_fixtures
    from vltrain.models.hf_embedders import VLMEmbedder

    enc = VLMEmbedder(vlm_fixtures.tiny_qwen2vl(tmp_path))
    assert enc.frozen_by_design == ("model.lm_head.weight",)
    outer = nn.ModuleDict({"encoder": enc})
    opt = torch.optim.AdamW([p for p in outer.parameters() if p.requires_grad], lr=1e-3)
    probe = Probe(outer, opt, [], True)
    assert probe.frozen_unasked == [] and probe.not_in_optimizer == []
    enc.model.model.language_model.norm.weight.requires_grad_(False)
    assert Probe(outer, opt, [], True).frozen_unasked == [
        "encoder.model.model.language_model.norm.weight"
    ]


def _torch_path(probe: Probe) -> list[torch.Tensor]:
    """The sampled weights through the per-tensor torch indexing (the reference path)."""
    return [
        torch.cat([p.detach().reshape(-1)[i] for p, i in zip(ps, ix, strict=True)]).double()
        for ps, ix in zip(probe.groups, probe.index, strict=True)
    ]


def test_numpy_sampling_equals_torch_indexing_and_follows_replaced_weights():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(
        [{"params": net.vision.parameters()}, {"params": net.head.parameters(), "lr": 0.1}]
    )
    probe = Probe(net, opt, [], False)
    first = probe._sampled()
    assert all(torch.equal(a, b) for a, b in zip(first, _torch_path(probe), strict=True))
    rec = _step(net, opt, probe)  # in-place updates are seen through the cached views
    assert all(r > 0 for r in rec.update_ratio)
    assert not torch.equal(probe._sampled()[1], first[1])
    # `p.data = ...` moves the storage: the views are rebuilt, not read stale
    net.head.weight.data = torch.full_like(net.head.weight, 3.0)
    assert torch.equal(probe._sampled()[1], _torch_path(probe)[1])
    assert float(probe._sampled()[1][0]) == 3.0
    probe.close()


def test_bfloat16_weights_take_the_torch_path():
    net = Net().to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    probe = Probe(net, opt, [], False)
    assert probe._numpy_views(0) is None
    got = probe._sampled()
    assert got[0].dtype == torch.float64 and torch.equal(got[0], _torch_path(probe)[0])
    rec = _step(net, opt, probe, x=torch.randn(8, 4, dtype=torch.bfloat16))
    assert rec.update_ratio[0] > 0
    probe.close()


def test_sample_index_stays_inside_a_weight_past_float32_precision() -> None:
    """SmolLM2's 49153 x 576 embedding: float32 linspace put its last index one past the end."""
    n = 49153 * 576
    idx = _sample_index(torch.empty(n, dtype=torch.bool))
    assert len(idx) == SAMPLE and int(idx[0]) == 0 and int(idx[-1]) == n - 1
    assert bool((idx[1:] > idx[:-1]).all())
    assert _sample_index(torch.empty(1)).tolist() == [0]
    assert _sample_index(torch.empty(5)).tolist() == [0, 1, 2, 3, 4]


def test_a_generative_vlm_is_judged_by_its_parts(tmp_path) -> None:
    """A LLaVA captioner (model.kind hf_vlm / llava): model.freeze names its parts (vision,
    connector, decoder), not its top-level module ('model'), and the vision layers its
    projector never reads are frozen by design. The check called every such run an error."""
    pytest.importorskip("transformers")
    from tests.models import vlm_fixtures
    from vltrain.models.hf_vlm import HFVLM, load_hf_vlm

    model = HFVLM(load_hf_vlm(vlm_fixtures.tiny_hf_llava(tmp_path), True), "hf_vlm")
    unread = set(model.frozen_by_design)
    assert unread and all("vision_tower" in n for n in unread)

    def probe(freeze: list[str]) -> Probe:
        model.requires_grad_(True)
        model._freeze_unused()
        model.freeze(freeze)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        return Probe(model, opt, freeze, True)

    assert probe([]).frozen_unasked == []
    assert probe(["vision"]).frozen_unasked == [] and probe(["vision"]).frozen_trainable == []
    probe(["vision"])
    name = next(n for n, _ in model.named_parameters() if "multi_modal_projector" in n)
    model.get_parameter(name).requires_grad_(False)  # frozen by nobody's asking
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    got = Probe(model, opt, ["vision"], True)
    assert got.frozen_unasked == [name] and got.unasked_parts == ["connector"]
