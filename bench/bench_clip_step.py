"""CLIP training step: vltrain vs open_clip on the same architecture, data and optimizer.

Run in the benchmark venv (open_clip needs torchvision, which vltrain never imports):

    python3 -m venv /work/bench-venv
    /work/bench-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 open_clip_torch
    /work/bench-venv/bin/pip install -e .
    /work/bench-venv/bin/python bench/bench_clip_step.py [--batch 128] [--steps 12]

Both models: ViT (64 px, patch 8, width 128, 2 layers, 4 heads) + text transformer (context 32,
vocab 2000, width 128, 2 layers, 4 heads), embed dim 128, symmetric InfoNCE with a learnable
temperature, AdamW, fp32. The two steps alternate so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import open_clip
import torch
from open_clip.loss import ClipLoss
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

import vltrain
from vltrain.models.dual_encoder import DualEncoder
from vltrain.objectives.contrastive import InfoNCELoss


def build_open_clip() -> torch.nn.Module:
    vision = CLIPVisionCfg(
        layers=2, width=128, head_width=32, mlp_ratio=4.0, patch_size=8, image_size=64
    )
    text = CLIPTextCfg(context_length=32, vocab_size=2000, width=128, heads=4, layers=2)
    return CLIP(embed_dim=128, vision_cfg=vision, text_cfg=text)


def build_vltrain() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = DualEncoder.from_preset("tiny", "tiny", 128, vocab_size=2000, context_length=32)
    return model, InfoNCELoss(temperature=0.07)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b = args.batch
    images = torch.rand(b, 3, 64, 64)
    ids = torch.randint(4, 2000, (b, 32))
    ids[:, -1] = 1999  # open_clip pools at the argmax id (its EOT); vltrain at the last token
    mask = torch.ones_like(ids)

    oc = build_open_clip()
    oc_loss = ClipLoss()
    oc_opt = torch.optim.AdamW(oc.parameters(), lr=1e-4)
    vl, vl_loss = build_vltrain()
    vl_opt = torch.optim.AdamW([*vl.parameters(), *vl_loss.parameters()], lr=1e-4)

    def oc_step() -> float:
        img, txt, scale = oc(images, ids)
        loss = oc_loss(img, txt, scale)
        loss.backward()
        oc_opt.step()
        oc_opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def vl_step() -> float:
        loss, _ = vl_loss(vl.encode_image(images), vl.encode_text(ids, mask))
        loss.backward()
        vl_opt.step()
        vl_opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    times: dict[str, list[float]] = {"open_clip": [], "vltrain": []}
    for i in range(args.steps + 2):
        for name, fn in (("open_clip", oc_step), ("vltrain", vl_step)):
            t = time.perf_counter()
            fn()
            if i >= 2:  # warm-up steps are not timed
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_oc = sum(p.numel() for p in oc.parameters())
    n_vl = sum(p.numel() for p in vl.parameters()) + 1
    print(
        f"machine: {platform.processor() or platform.machine()}, {args.threads} threads; "
        f"torch {torch.__version__}, open_clip {open_clip.__version__}, "
        f"vltrain {vltrain.__version__}"
    )
    print(
        f"params: open_clip {n_oc:,}, vltrain {n_vl:,}; batch {b}, fp32, "
        f"median of {args.steps} steps\n"
    )
    print("| library | step time (s) | samples/s | ratio vs open_clip |")
    print("|---|---|---|---|")
    for name in ("open_clip", "vltrain"):
        sps = b / med[name]
        print(f"| {name} | {med[name]:.3f} | {sps:.0f} | {med['open_clip'] / med[name]:.2f}x |")


if __name__ == "__main__":
    main()
