"""The conv-stem / flatten-head image tower (`tiny_cnn`) behind the ViT's token interface."""

import pytest
import torch

from vltrain.models.captioner import Captioner
from vltrain.models.presets import vision_config
from vltrain.models.vit import CLIP_MEAN, VisionTower, VisionTowerConfig


def test_conv_stem_keeps_the_token_interface():
    torch.manual_seed(0)
    tower = VisionTower(vision_config("tiny_cnn"))
    x = torch.rand(3, 3, 64, 64)
    tokens = tower(x)
    assert tokens.shape == (3, 1 + 64, 128)  # class slot + the 8x8 grid, like the patch-8 ViT
    assert torch.equal(tower.pooled(x), tokens[:, 0])
    # token 0 is a map of the whole grid, so it depends on where a shape is (a moved copy of
    # the same content gives another feature), not only on what is there
    moved = torch.roll(x, shifts=16, dims=-1)
    assert not torch.allclose(tower.eval().pooled(x), tower.pooled(moved), atol=1e-4)
    # a ViT with the conv stem and a class token also builds (stem default: 32, 64, 128)
    hybrid = VisionTower(vision_config("tiny", stem="conv"))
    assert hybrid.cfg.stem_channels == (32, 64, 128) and hybrid(x).shape == (3, 65, 128)


def test_max_pool_finds_the_same_thing_anywhere():
    """pool=max: token 0 is the grid's channel-wise max (before the norms), so a pattern moved
    to another place gives the same pooled feature where flatten would not; the grid comes back
    beside it for a dense loss; stride-1 grid convs add layers at the grid's resolution."""
    torch.manual_seed(0)
    cfg = vision_config("tiny_cnn", pool="max", stem_grid_channels=(48,), image_size=128)
    tower = VisionTower(cfg).eval()
    convs = [m for m in tower.patch_embed if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [16, 32, 64, 48, 128]
    assert [c.stride[0] for c in convs] == [2, 2, 2, 1, 1]
    # a page at the pixel mean is 0 after normalisation, like the convolutions' zero padding,
    # so only the square decides the features: a square, and the same square moved (by a
    # multiple of the stem's stride 8; both further than the receptive field from the edges)
    x = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1).repeat(2, 1, 128, 128)
    x[0, :, 40:56, 40:56] = 1.0
    x[1, :, 64:80, 72:88] = 1.0
    pooled, grid = tower.pooled_and_grid(x)
    assert grid.shape == (2, 256, 128)
    torch.testing.assert_close(pooled, tower(x)[:, 0])
    torch.testing.assert_close(pooled, tower.pooled(x))
    torch.testing.assert_close(pooled[0], pooled[1], atol=1e-5, rtol=1e-5)
    # control: the flatten head sees where
    flat = VisionTower(vision_config("tiny_cnn", image_size=128)).eval()
    assert not torch.allclose(flat.pooled(x)[0], flat.pooled(x)[1], atol=1e-3)
    empty = x[:1].clone()
    empty[..., 40:56, 40:56] = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    assert not torch.allclose(tower.pooled(empty)[0], pooled[0], atol=1e-3)


@pytest.mark.parametrize(
    "over,message",
    [
        ({"stem": "conv", "patch_size": 12, "image_size": 48}, "power of two"),
        ({"stem": "conv", "stem_channels": (32, 64)}, "3 positive channel counts"),
        ({"stem_channels": (32, 64, 128)}, "need stem='conv'"),
        ({"stem_grid_channels": (32,)}, "need stem='conv'"),
        ({"stem": "conv", "stem_grid_channels": (0,)}, "must be positive"),
        ({"stem": "convolution"}, "stem must be one of"),
        ({"pool": "mean"}, "pool one of"),
    ],
)
def test_bad_stem_options_are_refused(over, message):
    dims = {"image_size": 64, "patch_size": 8, "width": 64, "layers": 1, "heads": 2, **over}
    with pytest.raises(ValueError, match=message):
        VisionTowerConfig(**dims)


def _captioner() -> Captioner:
    torch.manual_seed(0)
    return Captioner.from_config("tiny_cnn", "tiny", vocab_size=64, max_text_len=8)


def _bn_means(model: Captioner) -> list[torch.Tensor]:
    bns = [m for m in model.vision.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns
    return [m.running_mean.clone() for m in bns]


def test_a_frozen_tower_keeps_its_batch_norm_statistics():
    images = torch.rand(4, 3, 64, 64)
    ids = torch.randint(3, 64, (4, 6))
    mask = torch.ones_like(ids)
    frozen = _captioner()
    frozen.freeze(["vision"])
    before = _bn_means(frozen)
    frozen.train()
    frozen(images, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(before, _bn_means(frozen), strict=True))
    assert frozen.decoder.training and not frozen.vision.patch_embed[1].training
    # negative control: the same model, not frozen, moves its running statistics
    live = _captioner()
    live.train()
    live(images, ids, mask)
    assert not all(torch.equal(a, b) for a, b in zip(before, _bn_means(live), strict=True))


def test_vision_options_reach_the_tower_and_typos_are_named(tmp_path):
    from vltrain.config.core import ConfigError
    from vltrain.models.backbones import vision_options

    assert vision_options({"stem_channels": [16, 32, 64, 128]}) == {
        "stem_channels": (16, 32, 64, 128)
    }
    with pytest.raises(ConfigError, match="did you mean 'stem_norm'"):
        vision_options({"stem_nrom": "group"})
    with pytest.raises(ConfigError, match="unknown field 'image_size'"):
        vision_options({"image_size": 32})  # data.image_size decides it


def test_channels_last_stem_matches_the_plain_layout():
    """On CPU the conv stem runs channels-last (faster oneDNN kernels); the tokens, the weights'
    layout and the gradients are those of the plain NCHW computation."""
    torch.manual_seed(0)
    tower = VisionTower(vision_config("tiny_cnn"))
    x = torch.rand(4, 3, 64, 64)
    layouts = []
    tower.patch_embed[0].register_forward_pre_hook(
        lambda _m, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    fast = tower(x)
    assert layouts == [True]
    fast.square().mean().backward()
    grads = [p.grad.clone() for p in tower.parameters()]
    tower.zero_grad()
    x_plain = (x - tower.pixel_mean) / tower.pixel_std
    grid = tower.patch_embed(x_plain)  # NCHW, as the tower computed before
    assert layouts == [True, False] and grid.is_contiguous()
    tokens = grid.flatten(2).transpose(1, 2)
    slow = tower.norm(
        tower.norm_pre(
            torch.cat([tower.grid_pool(tokens.flatten(1))[:, None], tokens], 1) + tower.pos_embed
        )
    )
    slow.square().mean().backward()
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    for p, g in zip(tower.parameters(), grads, strict=True):
        assert p.is_contiguous() and g.is_contiguous()
        torch.testing.assert_close(g, p.grad, rtol=1e-3, atol=1e-6)
