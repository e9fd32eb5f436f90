"""Captioner: connectors, masked caption loss, fusion keys, decoding (`CaptionerTarget`),
overfit (CPU)."""

from __future__ import annotations

import pytest
import torch

from vltrain.engine.optim import no_decay_names
from vltrain.inference.captioner_target import CaptionerCache, CaptionerTarget
from vltrain.models.captioner import IGNORE_INDEX, Captioner
from vltrain.models.connectors import CONNECTORS, ConnectorDims, build_connector
from vltrain.models.text import CausalDecoder, TextTowerConfig
from vltrain.models.vit import VisionTower, VisionTowerConfig

VOCAB = 53
BOS, EOS, PAD = 1, 2, 0
KINDS = ["projector", "gated_xattn"]
MAX_TEXT = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _decoder_cfg(context: int, layers: int = 2) -> TextTowerConfig:
    return TextTowerConfig(VOCAB, context, width=64, layers=layers, heads=4)


def _small(kind: str, seed: int = 0, **opts) -> Captioner:
    """Smaller than the `tiny` presets (32 px, 16 patches, width 64) so tests stay fast."""
    torch.manual_seed(seed)
    v_cfg = VisionTowerConfig(image_size=32, patch_size=8, width=48, layers=1, heads=4)
    dims = ConnectorDims(48, 1 + v_cfg.num_patches, 64, 2, 4)
    defaults = {"gated_xattn": {"n_latents": 8, "resampler_layers": 1}}.get(kind, {})
    conn = build_connector(kind, dims, **{**defaults, **opts})
    dec = CausalDecoder(_decoder_cfg(conn.num_prefix_tokens() + MAX_TEXT))
    return Captioner(VisionTower(v_cfg), conn, dec, BOS, EOS, PAD).eval()


def _open_gates(model: Captioner, value: float = 0.7) -> None:
    """Make the cross-attention path matter (at init it is gated off)."""
    with torch.no_grad():
        for name, p in model.connector.named_parameters():
            if "gate" in name:
                p.fill_(value)


def _images(n: int, seed: int = 0, size: int = 32) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=_gen(seed))


def _tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, shape, generator=_gen(seed))


# --------------------------------------------------------------------------- build, shapes


@pytest.mark.parametrize(
    ("kind", "opts", "prefix"),
    [
        ("projector", {}, 65),
        ("projector", {"pool": 2, "projector_layers": 1}, 17),
        ("gated_xattn", {"n_latents": 16}, 0),
    ],
)
def test_from_config_shapes_and_context(kind: str, opts: dict, prefix: int) -> None:
    torch.manual_seed(0)
    model = Captioner.from_config(
        "tiny", "tiny", vocab_size=VOCAB, connector=kind, connector_options=opts, max_text_len=12
    ).eval()
    assert model.decoder.cfg.context_length == prefix + 12 and model.max_text_len == 12
    ids = _tokens((2, 12), 1)  # the longest text that fits
    out = model(_images(2, size=64), ids, torch.ones_like(ids))
    assert out["logits"].shape == (2, 12, VOCAB)
    assert out["loss"].ndim == 0 and torch.isfinite(out["loss"])
    assert 0.0 <= out["token_acc"].item() <= 1.0 and out["n_tokens"].item() == 2 * 11
    visual = model.encode_images(_images(2, size=64))
    assert visual.shape == (2, prefix or 16, 128)
    with pytest.raises(ValueError, match="exceeds context_length"):
        model(_images(2, size=64), _tokens((2, 13), 1), torch.ones(2, 13))


def test_registry_and_readable_errors() -> None:
    assert set(KINDS) <= set(CONNECTORS)
    dims = ConnectorDims(48, 17, 64, 2, 4)
    with pytest.raises(ValueError, match="Did you mean 'projector'"):
        build_connector("projecter", dims)
    with pytest.raises(ValueError, match="no option.*n_latents"):
        build_connector("projector", dims, n_latents=4)
    with pytest.raises(ValueError, match="projector_layers must be 1 or 2"):
        build_connector("projector", dims, projector_layers=3)
    with pytest.raises(ValueError, match=r"divide the patch grid side 4 \(valid: \[1, 2, 4\]\)"):
        build_connector("projector", dims, pool=3)
    model = _small("projector")
    with pytest.raises(ValueError, match="Did you mean 'vision'"):
        model.freeze(["visoin"])
    with pytest.raises(ValueError, match="context_length 18 leaves 1 text positions"):
        Captioner(model.vision, model.connector, CausalDecoder(_decoder_cfg(18)), 1, 2, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Captioner(model.vision, model.connector, model.decoder, 1, VOCAB, 0)
    with pytest.raises(ValueError, match="left-padded"):
        CaptionerTarget(model).prefill(
            _images(1), torch.tensor([[1, 5, 0]]), torch.tensor([[1, 1, 0]])
        )


# --------------------------------------------------------------------------- loss


@pytest.mark.parametrize("kind", KINDS)
def test_loss_masking_matches_manual(kind: str) -> None:
    model = _small(kind)
    _open_gates(model)
    ids = _tokens((3, 9), 2)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :3] = IGNORE_INDEX  # a prompt the loss must not train on
    out = model(_images(3), ids, mask, labels)
    logp = out["logits"].float().log_softmax(-1)
    terms, hits = [], 0
    for b in range(3):
        for t in range(8):
            y = labels[b, t + 1].item()
            if y != IGNORE_INDEX:
                terms.append(-logp[b, t, y])
                hits += int(logp[b, t].argmax().item() == y)
    assert out["n_tokens"].item() == len(terms) == 2 * 6 + 3
    torch.testing.assert_close(out["loss"], torch.stack(terms).mean(), atol=1e-6, rtol=1e-6)
    assert out["token_acc"].item() == pytest.approx(hits / len(terms))
    # Negative control: counting the prompt and padding changes the loss.
    assert abs(model(_images(3), ids, mask, ids)["loss"].item() - out["loss"].item()) > 1e-4
    # Default labels are the input ids with padding ignored.
    default = model(_images(3), ids, mask)["loss"]
    explicit = model(_images(3), ids, mask, ids.masked_fill(mask == 0, IGNORE_INDEX))["loss"]
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)


def test_all_ignored_labels_give_zero_loss_with_gradient() -> None:
    model = _small("projector").train()
    ids = _tokens((2, 5), 3)
    out = model(_images(2), ids, torch.ones_like(ids), torch.full_like(ids, IGNORE_INDEX))
    assert out["loss"].item() == 0.0 and out["n_tokens"].item() == 0
    out["loss"].backward()  # still part of the graph (DDP needs every rank to backward)
    assert model.connector.proj[0].weight.grad is not None


# --------------------------------------------------------------------------- fusion


def test_gated_at_init_equals_plain_decoder_and_negative_control() -> None:
    model = _small("gated_xattn")
    ids = _tokens((2, 10), 4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding takes the masked path in both
    plain = model.decoder(ids, mask)  # (B, T, V), no visual input at all
    fused = model(_images(2), ids, mask)["logits"]
    assert torch.equal(fused, plain) or torch.allclose(fused, plain, atol=1e-6, rtol=0)
    with torch.no_grad():
        model.connector.xattn["0"].attn_gate.scale.fill_(0.5)
    opened = model(_images(2), ids, mask)["logits"]
    assert (opened - plain).abs().max() > 1e-3  # negative control: an open gate changes logits


def test_plain_decoder_state_dict_loads_into_gated_captioner() -> None:
    model = _small("gated_xattn")
    torch.manual_seed(123)
    pretrained = CausalDecoder(model.decoder.cfg).eval()
    plain_sd = pretrained.state_dict()
    assert set(model.decoder.state_dict()) == set(plain_sd)
    model.decoder.load_state_dict(plain_sd, strict=True)
    # Through the whole model: nothing unexpected, and only the non-decoder parts are missing.
    res = model.load_state_dict({f"decoder.{k}": v for k, v in plain_sd.items()}, strict=False)
    assert res.unexpected_keys == []
    assert all(k.startswith(("vision.", "connector.")) for k in res.missing_keys)
    new = set(model.state_dict()) - {f"decoder.{k}" for k in plain_sd}
    new -= {f"vision.{k}" for k in model.vision.state_dict()}
    assert new and all(k.startswith("connector.") for k in new)
    assert all(any(s in k for s in ("resampler", "xattn", "gate")) for k in new), sorted(new)
    gates = {k for k in new if k.endswith("gate.scale")}
    assert gates == {f"connector.xattn.{i}.{g}_gate.scale" for i in (0, 1) for g in ("attn", "mlp")}
    ids = _tokens((2, 7), 5)
    fused = model(_images(2), ids, torch.ones_like(ids))["logits"]
    torch.testing.assert_close(fused, pretrained(ids, torch.ones_like(ids)), atol=1e-6, rtol=0)


def test_xattn_every_places_blocks() -> None:
    dims = ConnectorDims(48, 17, 64, 5, 4)
    conn = build_connector("gated_xattn", dims, n_latents=4, xattn_every=2)
    assert sorted(conn.xattn.keys()) == ["0", "2", "4"]
    names = no_decay_names(conn)
    assert "resampler.latents" in names and "xattn.0.attn_gate.scale" in names


# --------------------------------------------------------------------------- decoding


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), PAD)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :] = r
        mask[i, t - len(r) :] = 1
    return ids, mask


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_step_equal_full_forward(kind: str) -> None:
    model = _small(kind)
    _open_gates(model)
    images = _images(3, 6)
    prompts = [torch.tensor([BOS]), torch.tensor([BOS, 7, 9, 11]), torch.tensor([BOS, 5])]
    ids, mask = _left_pad(prompts)
    cont = _tokens((3, 4), 7)
    target = CaptionerTarget(model)
    logits, cache, _ = target.prefill(images, ids, mask)
    assert isinstance(cache, CaptionerCache) and logits.dtype == torch.float32
    assert logits.shape == (3, VOCAB)
    steps = [logits]
    for j in range(cont.shape[1]):
        logits, cache = target.step(cont[:, j], cache)
        steps.append(logits)
    inc = torch.stack(steps, 1)  # (B, 1 + 4, V)
    for row in range(3):
        seq = torch.cat([prompts[row], cont[row]])[None]  # unpadded, (1, T_row)
        ref = model(images[row : row + 1], seq, torch.ones_like(seq))["logits"][0]
        n = len(prompts[row])
        torch.testing.assert_close(inc[row], ref[n - 1 :], atol=1e-5, rtol=0)
    # The batched, left-padded full forward agrees too.
    full_ids = torch.cat([ids, cont], 1)
    full = model(images, full_ids, torch.cat([mask, torch.ones_like(cont)], 1))["logits"]
    torch.testing.assert_close(inc, full[:, ids.shape[1] - 1 :], atol=1e-5, rtol=0)
    # Negative control: the images really condition the decoding.
    other, _, _ = target.prefill(images.flip(0), ids, mask)
    assert (other - inc[:, 0]).abs().max() > 1e-4  # 10x the tolerance above


@pytest.mark.parametrize("kind", KINDS)
def test_reorder_expands_and_reorders_rows(kind: str) -> None:
    model = _small(kind)
    _open_gates(model)
    target = CaptionerTarget(model)
    images = _images(2, 8)
    ids, mask = _left_pad([torch.tensor([BOS, 6]), torch.tensor([BOS, 8, 10])])
    _, cache, _ = target.prefill(images, ids, mask)
    beams = torch.tensor([1, 0, 0, 1, 1])
    nxt = _tokens((5,), 9)
    got, _ = target.step(nxt, target.reorder(cache, beams))
    _, ref_cache, _ = target.prefill(images[beams], ids[beams], mask[beams])
    ref, _ = target.step(nxt, ref_cache)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # Negative control: the wrong rows give different logits.
    bad, _ = target.step(nxt, target.reorder(cache, torch.tensor([0, 1, 1, 0, 0])))
    assert (bad - ref).abs().max() > 1e-3
    if kind == "gated_xattn":  # the latents must move with the rows, not just the KV cache
        half = CaptionerCache(
            kv=target.reorder(cache, beams).kv, visual=cache.visual[[0, 1, 1, 0, 0]]
        )
        stale, _ = target.step(nxt, half)
        assert (stale - ref).abs().max() > 1e-4  # 10x the tolerance above


# --------------------------------------------------------------------------- training


def _greedy(model: Captioner, images: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy captions (B, steps) through the decode target."""
    target = CaptionerTarget(model)
    prompt = torch.full((images.shape[0], 1), BOS)
    logits, cache, _ = target.prefill(images, prompt, torch.ones_like(prompt))
    out = []
    for _ in range(steps):
        out.append(logits.argmax(-1))
        logits, cache = target.step(out[-1], cache)
    return torch.stack(out, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_overfit_eight_images(kind: str) -> None:
    # Measured: 100% token accuracy after ~30 (projector) / 60-100 (gated_xattn) steps.
    model = _small(kind, seed=0).train()
    images = _images(8, 10)
    body = _tokens((8, 6), 11)
    ids = torch.cat([torch.full((8, 1), BOS), body, torch.full((8, 1), EOS)], 1)  # (8, 8)
    mask = torch.ones_like(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(150):
        out = model(images, ids, mask)
        if out["token_acc"].item() == 1.0:
            break
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = model(images, ids, mask)["token_acc"].item()
        shuffled = model(images.roll(1, 0), ids, mask)["token_acc"].item()
    assert acc == 1.0, f"{kind}: token accuracy {acc:.3f} after 150 steps"
    # Every teacher-forced argmax is right, so greedy decoding must reproduce the captions.
    assert torch.equal(_greedy(model, images, 7), ids[:, 1:])
    # Negative control: the captions come from the images (8 distinct first tokens).
    assert shuffled <= 0.9, f"{kind}: accuracy {shuffled:.3f} with images shuffled"


@pytest.mark.parametrize("kind", KINDS)
def test_freeze_parts(kind: str) -> None:
    model = _small(kind).train()
    model.freeze(["vision", "decoder"])
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"connector"}
    ids = _tokens((2, 6), 12)
    model(_images(2), ids, torch.ones_like(ids))["loss"].backward()
    assert all(p.grad is None for p in model.vision.parameters())
    assert all(p.grad is None for p in model.decoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.connector.parameters())
    assert "decoder.pos_embed" in no_decay_names(model)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast_forward_and_decoding(kind: str) -> None:
    model = _small(kind)
    _open_gates(model)
    ids = _tokens((2, 6), 13)
    mask = torch.ones_like(ids)
    ref = model(_images(2), ids, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(_images(2), ids, mask)
        target = CaptionerTarget(model)
        logits, cache, _ = target.prefill(_images(2), ids, mask)
        step, _ = target.step(ids[:, 0], cache)
    assert out["logits"].dtype == torch.bfloat16 and out["loss"].dtype == torch.float32
    assert torch.isfinite(out["loss"]) and abs(out["loss"].item() - ref["loss"].item()) < 0.05
    assert logits.dtype == step.dtype == torch.float32 and torch.isfinite(step).all()
