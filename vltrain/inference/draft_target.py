"""The frozen target a drafter trains against, as the drafter stage holds it (composition).

Targets (``model.kind``): ``hf_lm`` (a local HF causal LM directory or ``.gguf`` file: Llama,
Qwen2, Qwen3 families), ``captioner`` (a vltrain caption/rl run) or ``hf_vlm`` (a local HF
image-text-to-text directory: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA; `HFVLMTarget`): for the
last two the image prefix is in the context and text is drafted; ``model.target`` names it.
`DraftTarget` loads it, reads its records the way it tokenizes them, and turns a batch into
the drafter's step inputs: the target's features at ``drafter.layer_ids`` and its logits (or
top-k tokens), computed online under ``no_grad`` in every step, or once per sequence with
``drafter.cache_target`` (kept in memory, `vltrain.inference.feature_cache`; anchors are still
drawn per epoch, over the cached features; not for ``hf_vlm``) and also on disk for later runs
of the same target with ``drafter.cache_dir``. For evaluation it also decodes held-out prompts
speculatively with the target (``tau_decode``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.data.batches import DraftBatch
from vltrain.data.caption_data import CaptionDataset, read_caption_source
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.draft_data import ChatRecords, VLMCaptionRecords, chat_prompt_ids
from vltrain.data.images import BadSample
from vltrain.inference.captioner_target import CaptionerTarget, load_captioner
from vltrain.inference.captioning import left_pad
from vltrain.inference.feature_cache import FeatureCache, TopK, greedy_tokens, top_logprobs
from vltrain.inference.hf_target import HFTarget, load_hf_causal_lm
from vltrain.inference.native_llama import NativeTarget, causal_lm_target
from vltrain.inference.speculative import speculative_generate
from vltrain.inference.target import Context
from vltrain.inference.vlm_target import (
    HFVLMTarget,
    is_hf_vlm,
    load_hf_vlm,
    vlm_inputs,
    vlm_run,
)
from vltrain.models.drafter import config_sha256, run_config_sha256, target_layer_ids
from vltrain.objectives.drafter import block_labels, block_soft_labels

TARGET_KINDS = ("hf_lm", "captioner", "hf_vlm")


def check_target(cfg: Config) -> None:
    """Load-time checks of an ``hf_vlm`` target: a VLM directory, features computed online."""
    m, d = cfg.model, cfg.drafter
    if m.kind != "hf_vlm":
        return
    if not is_hf_vlm(m.target) and vlm_run(m.target) is None:
        raise ConfigError(
            f"'model.target' {m.target} is not an HF image-text-to-text model directory nor a "
            "caption run of model.kind hf_vlm or llava (model.kind=hf_vlm): pass one, or set "
            "model.kind to hf_lm or captioner"
        )
    if d.cache_target or d.cache_dir:
        raise ConfigError(
            "'drafter.cache_target' / 'drafter.cache_dir' do not support model.kind=hf_vlm "
            "(its features are computed online): turn them off"
        )


@dataclass
class DraftInputs:
    """One batch as a drafter step reads it: the target's side (under no_grad) and the
    data's block labels at the batch's anchors."""

    context: Context  # the target's features (B, P + T, F), their positions and validity
    target: Tensor | TopK | None  # logits (B, T, V), top-k tokens (soft_top_k), None: cached
    greedy: Tensor  # (B, T) the target's greedy token after each position
    prefix: int  # P: context rows before the text (a captioner's image)
    anchor_ids: Tensor  # (B, A) the token at each anchor
    anchor_pos: Tensor  # (B, A) anchor positions in the context
    labels: Tensor  # (B, A, K) block labels from the data
    valid: Tensor  # (B, A, K)

    def drafter_args(self) -> tuple[Tensor, ...]:
        """The drafter's inputs before its labels: features, positions, valid, anchors."""
        c = self.context
        return c.features, c.positions, c.valid, self.anchor_ids, self.anchor_pos


class DraftTarget:
    """The frozen target of `cfg` on `device`: ``model`` gives features (`HFTarget` or
    `CaptionerTarget`), ``decode_target`` decodes speculatively (the native forward where the
    model has one, as `vltrain generate` does), ``tokenizer`` and ``pad_id`` are its own."""

    def __init__(
        self, cfg: Config, device: torch.device, is_main: bool, vlm: tuple | None = None
    ) -> None:
        self.cfg, self.device, self.is_main = cfg, device, is_main
        m, d = cfg.model, cfg.drafter
        if m.kind == "hf_lm":
            model, self.tokenizer = load_hf_causal_lm(m.target)
            self.config_sha256 = config_sha256(model.config)  # before HFTarget sets switches
            model.requires_grad_(False)
            n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
            ids = list(d.layer_ids) or target_layer_ids(n_layers, d.target_layers)
            self.model: Any = HFTarget(model.to(device), ids)
            self.pad_id = self.model.pad_token_id
            # tau_decode runs the speculative loop the way `vltrain generate` does: through
            # the native forward where the model has one (same logits, fewer ms a round)
            self.decode_target: Any = causal_lm_target(self.model.model, ids, "auto", self.pad_id)
        elif m.kind == "hf_vlm":
            check_target(cfg)
            model, n_layers = self._load_vlm(m.target, vlm)
            ids = list(d.layer_ids) or target_layer_ids(n_layers, d.target_layers)
            self.model = self.decode_target = HFVLMTarget(model.to(device), ids)
            self.config_sha256 = config_sha256(model.config)
            self.pad_id = self.model.pad_token_id
        else:
            model, self.tokenizer, self.target_cfg = load_captioner(m.target)
            self.config_sha256 = run_config_sha256(self.target_cfg)
            n_layers = len(model.decoder.blocks)
            ids = list(d.layer_ids) or target_layer_ids(n_layers, d.target_layers)
            self.model = CaptionerTarget(model.to(device), ids)
            self.decode_target = self.model
            self.pad_id = self.tokenizer.pad_id
        self.caches: dict[str, FeatureCache] = {}
        self.last_decode: dict[str, float] = {}
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(
                f"'drafter.layer_ids' {bad} are not layers of a {n_layers}-layer target"
            )

    def _load_vlm(self, path: str, run: tuple | None) -> tuple[Any, int]:
        """(model, its language model's layer count) of an HF VLM directory, or of a caption
        run the stage resolved (``run``: its model, a folder with its processor and config, its
        visual-token budget); the tokenizer and prompt builder (``HFCollate``) go on ``self``."""
        from transformers import AutoTokenizer

        from vltrain.data.hf_collate import HFCollate

        model, folder, budget = run if run is not None else (None, path, None)
        self.collate = HFCollate(folder, "vlm", max_visual_tokens=budget)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = load_hf_vlm(path) if model is None else model
        return model, model.config.get_text_config(decoder=True).num_hidden_layers

    def records(self, path: str, train: bool) -> Any:
        """The records of `path` as the target reads them: chats in its template (hf_lm), or
        caption records at the captioner's image size and text length."""
        d = self.cfg.data
        if self.cfg.model.kind == "hf_lm":
            return ChatRecords(path, self.tokenizer, d.max_text_len)
        if self.cfg.model.kind == "hf_vlm":
            source = read_caption_source(path, d.image_column, d.text_column)
            instruction = self.cfg.caption.instruction
            return VLMCaptionRecords(
                source, self.collate, self.tokenizer, instruction, d.max_text_len
            )
        tc = self.target_cfg
        return CaptionDataset(
            read_caption_source(path, d.image_column, d.text_column),
            self.tokenizer,
            image_size=tc.data.image_size,
            max_len=min(d.max_text_len, tc.data.max_text_len),
            seed=self.cfg.run.seed,
            mode="pretrain" if tc.caption.mode == "sft" else tc.caption.mode,
            prompt=tc.caption.prompt,
            instruction=tc.caption.instruction,
            train=train,
        )

    # ---- one step ------------------------------------------------------------------------

    def _features(self, batch: DraftBatch, split: str) -> tuple:
        """(Context, the target's logits (B, T, V) or its top-k tokens (``soft_top_k``; None
        when cached without soft labels), greedy tokens (B, T), prefix length)."""
        d = self.cfg.drafter
        k = d.soft_top_k if d.soft_labels else 0
        if d.cache_target or d.cache_dir:
            if split not in self.caches:
                known = next((c.store.name for c in self.caches.values() if c.store), None)
                self.caches[split] = FeatureCache(self.model, d.cache_dir or None, known, k)
                if d.cache_dir and self.is_main and split == "train":
                    print(
                        f"vltrain: drafter: target features cached in {self.caches[split].store}",
                        file=sys.stderr,
                    )
            ctx, greedy, p, top = self.caches[split].features(batch)
            return ctx, top, greedy, p
        mask = batch["attention_mask"]
        if "vision" in batch:
            ctx, tlogits, p = self.model.features(batch["input_ids"], mask, **batch["vision"])
        elif "images" in batch:
            ctx, tlogits, p = self.model.features(batch["images"], batch["input_ids"], mask)
        else:
            ctx, tlogits, p = self.model.features(batch["input_ids"], mask)
        soft = top_logprobs(tlogits, mask, k) if k else tlogits
        return ctx, soft, greedy_tokens(tlogits, mask), p

    def inputs(self, batch: DraftBatch, split: str = "train") -> DraftInputs:
        """Target features and the drafter's inputs of one batch (target under no_grad)."""
        ctx, tlogits, greedy, p = self._features(batch, split)
        labels = batch["labels"]
        full = torch.cat([labels.new_full((labels.shape[0], p), IGNORE_INDEX), labels], 1)
        anchors, valid = batch["anchors"], batch["anchor_valid"]
        a_ids = batch["input_ids"].gather(1, anchors)
        lab, lab_valid = block_labels(full, anchors + p, valid, self.cfg.drafter.block_size)
        return DraftInputs(ctx, tlogits, greedy, p, a_ids, anchors + p, lab, lab_valid)

    def soft_labels(self, inp: DraftInputs) -> Any:
        """Soft labels, dense (B, A, K, V) from logits or sparse from the target's top-k; None
        without ``drafter.soft_labels``."""
        if not self.cfg.drafter.soft_labels:
            return None
        if inp.target is None:  # check_config keeps this from happening: never fall back silently
            raise RuntimeError("drafter.soft_labels is on but the target gave no distribution")
        return block_soft_labels(
            inp.target, inp.anchor_pos - inp.prefix, self.cfg.drafter.block_size
        )

    def greedy_labels(self, inp: DraftInputs) -> tuple[Tensor, Tensor]:
        """Block labels from the target's greedy tokens (token at t = argmax after t - 1)."""
        greedy, p = inp.greedy, inp.prefix
        g = torch.cat([greedy.new_full((greedy.shape[0], p + 1), IGNORE_INDEX), greedy[:, :-1]], 1)
        lab, ok = block_labels(g, inp.anchor_pos, inp.valid.any(-1), self.cfg.drafter.block_size)
        return lab, ok & inp.valid

    # ---- real decoding -------------------------------------------------------------------

    def decode_tau(self, drafter: Any, base: Any, rank: int, world_size: int) -> dict[str, float]:
        """tau of real speculative decoding of this rank's share of the first eval prompts
        (``tau_decode``; ``tau_decode_tree`` with ``drafter.eval_tree_budget``) and the tokens
        a round added to the output (``kept_decode``, ``kept_decode_tree``), all-reduced."""
        d = self.cfg.drafter
        n = min(d.eval_prompts, len(base))
        mine = list(range(n))[rank::world_size]
        out = {}
        for name, budget in (("", 0), ("_tree", d.eval_tree_budget)):
            if name and not budget:
                continue
            acc = torch.zeros(3, dtype=torch.float64)
            if mine:
                prompts = self.prompts(base, mine)
                _, stats = speculative_generate(
                    self.decode_target,
                    drafter,
                    prompts,
                    max_new_tokens=self._room(d.eval_max_new_tokens, prompts),
                    tree_budget=budget,
                )
                kept = sum(map(sum, stats.kept))
                acc += torch.tensor([sum(map(sum, stats.accepted)), stats.rounds, kept])
            acc = distributed.all_reduce_sum(acc.to(self.device)).cpu()
            out[f"tau_decode{name}"] = float(acc[0] / acc[1].clamp(min=1))
            # tokens each round added to the output (tau_decode counts past EOS / the limit)
            out[f"kept_decode{name}"] = float(acc[2] / acc[1].clamp(min=1))
        if isinstance(self.decode_target, NativeTarget):
            self.decode_target.release()  # ~2 copies of the target's weights until next eval
        if n:  # what `vltrain generate --spec auto` predicts from (drafter.json "eval")
            self.last_decode = {**out, "tree_budget": d.eval_tree_budget, "prompts": n}
        return out

    def prompts(self, base: Any, idx: list[int]) -> dict[str, Tensor]:
        """The prompts of records `idx` of `base`, left-padded, on the target's device."""
        dev = self.device
        if self.cfg.model.kind == "hf_lm":
            rows = [chat_prompt_ids(self.tokenizer, base.records[i]["prompt"]) for i in idx]
            ids, mask = left_pad(rows, self.pad_id)
            return {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        if self.cfg.model.kind == "hf_vlm":
            pils = []
            for i in idx:
                try:
                    pils.append(base.image(i))
                except BadSample:
                    continue
            inputs = vlm_inputs(self.collate, pils, self.cfg.caption.instruction)
            return {k: v.to(dev) for k, v in inputs.items()}
        samples = [base[(0, 0, i)] for i in idx]
        samples = [s for s in samples if "bad" not in s]
        prompt = [self.tokenizer.bos_id] + (
            self.tokenizer.encode(base.prompt) if getattr(base, "prompt", "") else []
        )
        ids, mask = left_pad([prompt] * len(samples), self.pad_id)
        images = torch.stack([s["image"] for s in samples])
        return {"images": images.to(dev), "input_ids": ids.to(dev), "attention_mask": mask.to(dev)}

    def _room(self, want: int, prompts: dict[str, Tensor]) -> int:
        if self.cfg.model.kind == "hf_lm":
            return want
        if self.cfg.model.kind == "hf_vlm":
            room = self.model.room(prompts["input_ids"].shape[1] + self.cfg.drafter.block_size)
            return want if room is None else max(1, min(want, room))
        m = self.model.model
        return max(1, min(want, m.max_text_len - 2 - self.cfg.drafter.block_size))


def noise_std(noise: float, warmup_steps: int, step: int) -> float:
    """Std of the feature noise at optimizer step ``step``: ramps linearly from 0 at step 0 to
    ``noise`` at ``warmup_steps`` (``noise`` throughout without a warmup)."""
    if warmup_steps <= 0:
        return noise
    return noise * min(1.0, step / warmup_steps)


class FeatureNoise:
    """Gaussian noise on the target's features the drafter reads in training
    (``drafter.noise``), its std ramped by `noise_std`. The clock counts forwarded
    micro-batches, so it is the optimizer step whatever ``optim.accum_steps`` (a step skipped
    because none of its micro-batches held a sample does not advance it) and it resumes with
    the stage state. Evaluation never calls it: it reads clean features."""

    def __init__(self, noise: float, warmup_steps: int, accum_steps: int) -> None:
        self.noise, self.warmup_steps, self.accum_steps = noise, warmup_steps, accum_steps
        self.micro_batches = 0

    def __call__(self, inp: DraftInputs) -> DraftInputs:
        step = self.micro_batches // self.accum_steps
        self.micro_batches += 1
        std = noise_std(self.noise, self.warmup_steps, step)
        if std == 0:
            return inp
        feats = inp.context.features
        noisy = feats + std * torch.randn_like(feats)  # (B, S, F)
        return replace(inp, context=replace(inp.context, features=noisy))

    def state_dict(self) -> dict[str, int]:
        return {"micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batches = int(state.get("micro_batches", 0))
