"""The rl stage's rollouts on Hugging Face VLMs: model kinds ``hf_vlm`` and ``llava``.

`vltrain.stages.rl.RLStage` holds an `HFRollouts` when ``model.kind`` is an HF kind and keeps
everything else (rewards, baselines, length penalty, ``reinforce_loss``, metrics, resume state)
to itself, so the objective is one code path for every kind. What differs lives here:

- sampling: ``rl.k`` captions per image by the one decoder loop over an `HFVLMTarget` of the
  policy (LoRA adapters on), from the stage's per-(seed, rank, rollout) generator;
- teacher-forced logits of the sampled tokens: images + the left-padded prompt + the sampled
  tokens through the (DDP-wrapped) `HFVLM`, with the position ids HF ``generate`` uses (mask
  based; Qwen-VL's M-RoPE from the model's own helper), so they are the sampling distribution;
- the reference: with LoRA none (the policy with its adapters disabled), else a frozen copy of
  the starting model (``model.init_from``, or ``model.path`` for hf_vlm);
- the reward df: the references of the training records (plain captions or a chat's last
  assistant turn).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.data.batches import CaptionBatch
from vltrain.data.images import BadSample, check_text
from vltrain.inference.decoding import rollouts
from vltrain.inference.vlm_captioning import end_tokens, left_pad_prompts
from vltrain.inference.vlm_target import HFVLMTarget
from vltrain.models.hf_vlm import GRID_VLMS, HFVLM
from vltrain.objectives.reference import check_frozen_reference, frozen_reference, has_adapters
from vltrain.stages.caption_hf import HFCaptionCore
from vltrain.stages.caption_hf_checks import check_hf_caption_config

_TEXT_KEYS = ("input_ids", "attention_mask")


def check_hf_rl_config(cfg: Config) -> None:
    """The caption stage's rules of the HF kinds (with ``rl.*`` read), and a starting model."""
    check_hf_caption_config(cfg, stage="rl", extra=("rl.*",))
    if cfg.model.kind == "llava" and not cfg.model.init_from:
        raise ConfigError(
            "stage 'rl' with model.kind=llava needs 'model.init_from' (a caption run of the "
            "llava kind): RL starts from a trained connector and anchors the KL to it"
        )


def repeat_images(images: dict[str, Tensor], k: int, model_type: str) -> dict[str, Tensor]:
    """The image inputs of a batch with every image repeated k times (rows b*k .. b*k+k-1 are
    image b). Qwen-VL's ``pixel_values`` are the images' patches concatenated: split by grid."""
    if model_type in GRID_VLMS:
        grid = images["image_grid_thw"]  # (B, 3)
        chunks = images["pixel_values"].split(grid.prod(-1).tolist())
        pixels = torch.cat([c for c in chunks for _ in range(k)])
        return {**images, "pixel_values": pixels, "image_grid_thw": grid.repeat_interleave(k, 0)}
    return {key: v.repeat_interleave(k, 0) for key, v in images.items()}


def placeholder_ids(model: HFVLM) -> list[int]:
    """The image / video placeholder ids: never a caption token (a sampled one would be read as
    an image slot by the teacher-forced forward), so sampling and the policy both exclude them."""
    config = model.base_model().config
    ids = {model.image_token_id, getattr(config, "video_token_id", None)}
    return sorted(i for i in ids if i is not None)


def without(logits: Tensor, banned: list[int]) -> Tensor:
    """`logits` (..., V) with the `banned` ids at the dtype's lowest value (probability 0)."""
    if not banned:
        return logits
    out = logits.clone()
    out[..., banned] = torch.finfo(logits.dtype).min
    return out


class CaptionTarget(HFVLMTarget):
    """`HFVLMTarget` whose next-token distributions exclude the `banned` ids."""

    def __init__(self, model: nn.Module, banned: list[int], **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.banned = banned

    def prefill(self, *args: Any, **inputs: Any) -> Any:
        logits, cache, ctx = super().prefill(*args, **inputs)
        return without(logits, self.banned), cache, ctx

    def step(self, tokens: Tensor, cache: Any) -> Any:
        logits, cache = super().step(tokens, cache)
        return without(logits, self.banned), cache


class HFRollouts:
    """Sampling, teacher-forced logits, reference and reward references of an HF kind."""

    def __init__(self, cfg: Config, core: HFCaptionCore) -> None:
        self.cfg, self.core = cfg, core

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def training_refs(self) -> dict[int, list[str]]:
        """``{index: references}`` of the training records (no image decoding)."""
        ds = self.core.train_dataset(train=False)
        refs: dict[int, list[str]] = {}
        for i, rec in enumerate(ds.records):
            try:
                if "messages" in rec:
                    last = [m for m in rec["messages"] if m["role"] == "assistant"][-1]
                    refs[i] = [check_text(last["content"], f"id={rec.get('id')}")]
                else:
                    refs[i] = [check_text(t, f"id={rec.get('id')}") for t in rec["text"]]
            except (BadSample, IndexError, KeyError):  # the loader skips and counts it
                continue
        return refs

    def reference(self, model: HFVLM) -> nn.Module | None:
        """None for a LoRA policy (its adapters disabled); else a frozen copy of the starting
        model (build_model's, before any step or resumed weights)."""
        self.eos_ids = end_tokens(model.base_model(), self.pad_id)
        self.banned = placeholder_ids(model)
        if has_adapters(model):
            return None
        ref = frozen_reference(model)
        check_frozen_reference(ref, model)
        return ref

    def _inputs(self, policy: HFVLM, batch: CaptionBatch) -> dict[str, Tensor]:
        dev = next(policy.parameters()).device
        ids, mask = left_pad_prompts(batch["prompt_ids"], self.pad_id)  # (B, P)
        return policy.model_inputs(batch["images"], ids.to(dev), mask.to(dev))

    def sample(self, policy: HFVLM, batch: CaptionBatch, gen: torch.Generator) -> dict[str, Any]:
        """K samples per image drawn with `gen` (+ greedy captions for the greedy baseline)."""
        r, k = self.cfg.rl, self.cfg.rl.k
        inputs = self._inputs(policy, batch)
        target = CaptionTarget(policy.base_model(), self.banned, eos_token_id=self.eos_ids)
        room = target.room(inputs["input_ids"].shape[1])
        if room is not None and room < 1:
            raise ValueError(
                f"the prompt takes {inputs['input_ids'].shape[1]} of the model's "
                f"{target.max_positions} positions; use fewer visual tokens or a shorter prompt"
            )
        new = r.max_new_tokens if room is None else min(r.max_new_tokens, room)
        out, greedy = rollouts(
            policy, target, inputs, k, new, r.temperature, r.top_p, gen, r.baseline == "greedy"
        )
        res: dict[str, Any] = {"ids": inputs["input_ids"], "pmask": inputs["attention_mask"]}
        res |= {"seq": out.sequences, "len": out.lengths}
        if greedy is not None:
            res["greedy_texts"] = self.decode(greedy.sequences, greedy.lengths)
        return res

    def decode(self, seq: Tensor, lengths: Tensor) -> list[str]:
        """Captions as the caption stage's evaluation decodes them (special tokens dropped)."""
        rows = [s[: int(n)].tolist() for s, n in zip(seq, lengths, strict=True)]
        return [t.strip() for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]

    def logits_fn(
        self, policy: HFVLM, batch: CaptionBatch, s: dict[str, Any], k: int
    ) -> Callable[[nn.Module], Tensor]:
        """``fn(model) -> (B*K, L, V)`` teacher-forced logits of the sampled tokens; row t is the
        distribution token t was drawn from. `model`: the DDP-wrapped policy, the plain one (with
        adapters disabled) or the frozen reference."""
        seq = s["seq"]  # (B*K, L)
        images = repeat_images(batch["images"], k, policy.model_type)
        p = s["ids"].shape[1]
        # the padding after a sample's end stays visible: causal attention keeps it out of the
        # logits that count, and positions stay contiguous (Qwen-VL's M-RoPE needs that)
        ids = torch.cat([s["ids"].repeat_interleave(k, 0), seq], 1)  # (B*K, P + L)
        mask = torch.cat([s["pmask"].repeat_interleave(k, 0), torch.ones_like(seq)], 1)
        with torch.no_grad():  # the positions HF generate (and the decoder loop) use
            target = HFVLMTarget(policy.base_model(), eos_token_id=self.eos_ids)
            extra = policy.model_inputs(images, ids, mask)
            extra = {key: v for key, v in extra.items() if key not in _TEXT_KEYS}
            pos = target.prompt_positions(ids, mask, extra)

        def fn(model: nn.Module) -> Tensor:
            logits = model(images, ids, mask, position_ids=pos)["logits"]  # (B*K, P + L, V)
            return without(logits[:, p - 1 : -1], self.banned)  # position P-1+t predicts token t

        return fn
