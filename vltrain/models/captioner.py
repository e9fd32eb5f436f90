"""Generative captioner: vision tower -> connector -> causal decoder.

Training: ``forward(images, input_ids, attention_mask, labels)`` returns the teacher-forced
next-token loss over labelled tokens (``-100`` = ignored; the caller marks prompt and padding),
the text logits and the token accuracy.

Decoding: ``vltrain.inference.captioner_target.CaptionerTarget`` drives ``encode_images`` and
``connector.run`` (the decoder loop) as a ``DecodeTarget``.

Context: a prefix connector puts its visual tokens into the decoder context, so
``from_config`` sizes ``context_length = prefix tokens + max_text_len`` (the tiny ViT gives
1 + 64 = 65 prefix tokens; ``projector`` with ``pool=2`` gives 1 + 16). ``gated_xattn`` takes
no context positions.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.data.chat import IGNORE_INDEX
from vltrain.models.connectors import Connector, ConnectorDims, build_connector
from vltrain.models.presets import text_config, vision_config
from vltrain.models.text import CausalDecoder
from vltrain.models.vit import VisionTower


def next_token_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced cross-entropy of ``logits`` (B, T, V) against ``labels`` (B, T).

    Position t predicts ``labels[:, t + 1]``; ``-100`` labels are ignored. Returns the loss
    averaged over labelled tokens (fp32; 0 with a gradient path when none are labelled), the
    token accuracy (correct / labelled, detached) and the number of labelled tokens.
    """
    return token_loss(logits[:, :-1], labels[:, 1:])


def token_loss(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`next_token_loss` with the shift done: ``logits[:, t]`` predicts ``target[:, t]``."""
    pred = logits.float()  # (B, T', V)
    keep = target != IGNORE_INDEX
    n = keep.sum()
    loss_sum = F.cross_entropy(
        pred.reshape(-1, pred.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    denom = n.clamp(min=1)
    correct = ((pred.detach().argmax(-1) == target) & keep).sum()
    return loss_sum / denom, correct.float() / denom, n


class Captioner(nn.Module):
    """``vision`` -> ``connector`` -> ``decoder``; each part freezable and LR-scalable by name."""

    PARTS = ("vision", "connector", "decoder")

    def __init__(
        self,
        vision: VisionTower,
        connector: Connector,
        decoder: CausalDecoder,
        bos_id: int,
        eos_id: int,
        pad_id: int,
    ) -> None:
        super().__init__()
        vocab = decoder.cfg.vocab_size
        bad = {
            k: v for k, v in dict(bos=bos_id, eos=eos_id, pad=pad_id).items() if not 0 <= v < vocab
        }
        if bad:
            raise ValueError(f"special token ids {bad} are outside the vocabulary [0, {vocab})")
        room = decoder.cfg.context_length - connector.num_prefix_tokens()
        if room < 2:
            raise ValueError(
                f"decoder context_length {decoder.cfg.context_length} leaves {room} text "
                f"positions after {connector.num_prefix_tokens()} visual prefix tokens; build "
                "the decoder with context_length = prefix tokens + max text length (see "
                "Captioner.from_config) or pool the visual tokens"
            )
        self.vision = vision
        self.connector = connector
        self.decoder = decoder
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_id, eos_id, pad_id
        self.frozen: tuple[str, ...] = ()

    @classmethod
    def from_config(
        cls,
        vision: str = "tiny",
        text: str = "tiny",
        *,
        vocab_size: int,
        connector: str = "projector",
        connector_options: Mapping[str, Any] | None = None,
        max_text_len: int = 32,
        bos_id: int = 1,
        eos_id: int = 2,
        pad_id: int = 0,
        dropout: float = 0.0,
        tie_weights: bool = True,
        text_dims: Mapping[str, int] | None = None,
        vision_dims: Mapping[str, int] | None = None,
    ) -> Captioner:
        """Build from size presets, a connector registry key and that connector's options.

        The decoder context is sized to ``connector prefix tokens + max_text_len``;
        ``text_dims`` / ``vision_dims`` (e.g. ``{"layers": 3, "width": 96}``) override the
        presets' dimensions.
        """
        v_cfg = vision_config(vision, dropout=dropout, **dict(vision_dims or {}))
        dims_over = dict(text_dims or {})
        t_cfg = text_config(
            text, vocab_size, dropout=dropout, context_length=max_text_len, **dims_over
        )
        dims = ConnectorDims(
            vision_width=v_cfg.width,
            vision_tokens=1 + v_cfg.num_patches,
            text_width=t_cfg.width,
            text_layers=t_cfg.layers,
            text_heads=t_cfg.heads,
        )
        conn = build_connector(connector, dims, **dict(connector_options or {}))
        t_cfg = dataclasses.replace(t_cfg, context_length=conn.num_prefix_tokens() + max_text_len)
        dec = CausalDecoder(t_cfg, tie_weights=tie_weights)
        return cls(VisionTower(v_cfg), conn, dec, bos_id, eos_id, pad_id)

    @property
    def max_text_len(self) -> int:
        """Text tokens (prompt + generated) that fit in the decoder context."""
        return self.decoder.cfg.context_length - self.connector.num_prefix_tokens()

    def encode_images(self, images: Tensor) -> Tensor:
        """Images (B, 3, H, W) in [0, 1] -> the connector's visual conditioning (B, N, Wd)."""
        return self.connector(self.vision(images))

    def forward(
        self,
        images: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        labels: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Teacher-forced captioning loss.

        Returns ``loss`` (mean next-token CE over labelled tokens, fp32), ``logits`` (B, T, V)
        of the text positions, ``token_acc`` and ``n_tokens`` (labelled tokens, for weighting
        across micro-batches). ``labels`` default to ``input_ids`` with padding ignored.
        """
        if labels is None:
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}"
            )
        visual = self.encode_images(images)  # (B, N, Wd)
        h, _ = self.connector.hidden_states(self.decoder, visual, input_ids, attention_mask)
        n_prefix = h.shape[1] - input_ids.shape[1]
        logits = self.decoder.logits(h[:, n_prefix:])  # (B, T, V)
        loss, acc, n = next_token_loss(logits, labels)
        return {"loss": loss, "logits": logits, "token_acc": acc, "n_tokens": n}

    # ----------------------------------------------------------------------- training helpers

    def freeze(self, parts: Iterable[str]) -> None:
        """Stop gradients to the named parts (``vision``, ``connector``, ``decoder``).

        Dropout in a frozen part still follows ``train()`` / ``eval()``; batch-norm layers of a
        frozen part stay in eval mode (their running statistics are part of what was frozen).
        """
        parts = list(parts)
        for part in parts:
            if part not in self.PARTS:
                close = difflib.get_close_matches(part, self.PARTS, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"cannot freeze unknown part {part!r} of the captioner; "
                    f"choose from {list(self.PARTS)}.{hint}"
                )
        for part in parts:
            getattr(self, part).requires_grad_(False)
        self.frozen = tuple(dict.fromkeys((*self.frozen, *parts)))
        self.train(self.training)

    def train(self, mode: bool = True) -> Captioner:
        """``nn.Module.train``, except that batch norms of frozen parts never leave eval mode."""
        super().train(mode)
        for part in self.frozen:
            for m in getattr(self, part).modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    def no_weight_decay(self) -> list[str]:
        """Positional embeddings and the class token are exempt from weight decay."""
        names = ("vision.class_token", "vision.pos_embed", "decoder.pos_embed")
        own = dict(self.named_parameters())
        return [n for n in names if n in own]
