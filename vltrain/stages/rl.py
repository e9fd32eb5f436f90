"""The rl stage: REINFORCE fine-tuning of a trained captioner (``stage: rl``, configs/rl.yaml).

Everything but the loss is the caption stage's: data, tokenizer reuse and model building from
``model.init_from``, sharded evaluation (greedy BLEU/CIDEr-D, plus beam as ``eval_beam_*``),
``checkpoints/best`` by ``eval_CIDEr-D``. Per step (math in ``vltrain/objectives/reinforce.py``,
wiring rules in docs/rl.md):

1. sample ``rl.k`` captions per image on the unwrapped policy (no grad), from a generator seeded
   by (run.seed, rank, rollout number): every rank draws its own noise, and resume is exact
   on every rank (the rollout count rides in the trainer state); for ``baseline=greedy`` one
   greedy caption per image too;
2. reward each against all references of its image (CIDEr-D df from the training references,
   computed once in :meth:`RLStage.prepare`) minus the optional ``rl.length_penalty``;
3. advantages from the baseline; the ema baseline then folds in the all-reduced mean reward;
4. teacher-forced logits of the policy through the (DDP-wrapped) model the engine passes, and of
   the frozen reference (no grad); ``reinforce_loss``; the engine's backward of ``loss * scale``.

The reference is rebuilt at every start (also on resume) from the checkpoint the run first
started from (``init_from.json``, `resolve_init`), lives on the
stage (never inside the trained module), is never saved and has no optimizer state. A policy
with peft (LoRA) adapters has none: its reference is itself with the adapters disabled.
The HF kinds (hf_vlm, llava) sample, teacher-force and build the reference in `rl_hf`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.data.batches import CaptionBatch
from vltrain.data.images import BadSample
from vltrain.data.loaders import Loader
from vltrain.data.samplers import ShardedBatchSampler
from vltrain.engine.parallel import ParallelModel
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import StepOutput
from vltrain.eval.captions import metric_names
from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.inference.captioning import left_pad
from vltrain.inference.decoding import rollouts
from vltrain.models.backbones import build_captioner, load_initial_weights
from vltrain.objectives.caption_shaping import caption_stats, length_penalty
from vltrain.objectives.reference import (
    check_frozen_reference,
    frozen_reference,
    has_adapters,
    reference_logits,
)
from vltrain.objectives.reinforce import (
    CaptionReward,
    advantages,
    build_baseline,
    ends_with_eos,
    policy_terms,
    reinforce_loss,
    sequence_logits,
    sequence_mask,
)
from vltrain.stages.caption import CAPTION_KEYS, CaptionCore, check_captioner_config
from vltrain.stages.caption_hf import HF_CAPTION_KINDS, HFCaptionCore, owning_config
from vltrain.stages.rl_hf import HFRollouts, check_hf_rl_config

#: metrics logged every step (all-reduced means over ranks), in this order
RL_METRICS = (
    "reward_mean",
    "reward_std",
    "adv_mean",
    "adv_std",
    "kl",
    "entropy",
    "length_mean",
    "eos_frac",
    "pg_loss",
    "rep4_rate",
    "caption_words",
)


class RLStage:
    """REINFORCE on a captioner started from ``model.init_from``; eval as the caption stage."""

    best_metric = "eval_CIDEr-D"
    best_mode = "max"

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        hf = cfg.model.kind in HF_CAPTION_KINDS  # rollouts of the HF kinds: stages/rl_hf.py
        self.core: Any = (HFCaptionCore if hf else CaptionCore)(cfg, out_dir, ctx)
        self.core.pin_init = out_dir  # the KL reference: the start, whatever the init run does
        self.hf = HFRollouts(cfg, self.core) if hf else None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """The captioner's (or the HF kinds') rules plus RL's own."""
        if cfg.model.kind in HF_CAPTION_KINDS:
            check_hf_rl_config(cfg)
        else:
            used = tuple(k for k in CAPTION_KEYS if k != "data.*") + ("rl.*",)
            data = ("train", "eval", "test", "batch_size", "max_train_samples", "eval_batch_size")
            data += ("num_workers", "image_cache_mb", "image_size", "max_text_len")
            data += ("tokenizer_vocab", "max_bad_fraction", "image_column", "text_column")
            check_captioner_config(cfg, "rl", used + tuple(f"data.{k}" for k in data))
        r = cfg.rl
        if cfg.train.parallel == "fsdp":
            raise ConfigError(
                "stage 'rl' with train.parallel=fsdp: its rollouts sample outside the sharded "
                "forward; use train.parallel=ddp (or auto) for RL"
            )
        if not cfg.model.init_from and cfg.model.kind != "hf_vlm":
            raise ConfigError(
                "stage 'rl' needs 'model.init_from' (a trained caption run or checkpoint): RL "
                "fine-tunes a captioner and anchors the KL to those starting weights"
            )
        if r.baseline in ("loo", "rloo", "grpo") and r.k < 2:
            raise ConfigError(f"'rl.baseline' {r.baseline} needs 'rl.k' >= 2, got rl.k={r.k}")
        if r.scale_rewards != "group" and r.baseline != "grpo":
            raise ConfigError(
                f"'rl.scale_rewards' applies to rl.baseline=grpo, not {r.baseline!r}; drop it"
            )
        if r.length_target and not r.length_penalty:
            raise ConfigError("'rl.length_target' needs 'rl.length_penalty' > 0 (its weight)")
        if r.reward_weights and r.reward != "mix":
            raise ConfigError(f"'rl.reward_weights' applies to rl.reward=mix, not {r.reward!r}")
        unknown = sorted(set(r.reward_weights) - {"cider", "bleu4"})
        if unknown:
            raise ConfigError(f"'rl.reward_weights' keys {unknown} are unknown; use cider, bleu4")

    @classmethod
    def eval_metrics(cls, cfg: Config) -> tuple[str, ...]:
        return metric_names(("", "beam_") if cfg.caption.eval_beam else ("",))

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def prepare(self) -> None:
        """Tokenizer (from init_from), reward df from the training refs, the baseline."""
        self.core.prepare()
        self._check_mode()
        r = self.cfg.rl
        self.reward = CaptionReward(
            self._training_refs(), kind=r.reward, weights=r.reward_weights or None
        )
        kwargs = {"ema": {"decay": r.ema_decay}, "grpo": {"scale": r.scale_rewards}}
        self.baseline = build_baseline(r.baseline, **kwargs.get(r.baseline, {}))
        self.rollouts = 0  # forward_backward() calls so far; seeds the sampling generator

    def _check_mode(self) -> None:
        """caption.mode decides the prompt format (sft: the chat template; pretrain and finetune:
        the caption prompt): it must be the one the start was trained in."""
        ckpt, mode = self.core.init_ckpt, self.cfg.caption.mode
        was = (owning_config(ckpt).get("caption") or {}).get("mode") if ckpt else None
        if was and (was == "sft") != (mode == "sft"):  # pretrain and finetune prompt alike
            raise ConfigError(
                f"caption.mode={mode}, but model.init_from ({ckpt}) trained with caption.mode="
                f"{was}: RL would sample from prompts it never saw; set caption.mode={was}"
            )

    def rollout_generator(self) -> torch.Generator:
        """The sampling RNG of this rank's next rollout, from (run.seed, rank, rollout number).

        Not the global RNG: every rank starts it from the same seed, so all ranks would draw
        the same noise and roll out correlated samples. Stateless given the rollout count, so a
        resumed run (any rank) continues the stream exactly.
        """
        key = [self.cfg.run.seed, self.ctx.rank, self.rollouts]
        seed = int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0])
        return torch.Generator(device=self.ctx.device).manual_seed(seed)

    def _training_refs(self) -> dict[int, list[str]]:
        """``{index: references}`` of the training records (no image decoding)."""
        if self.hf is not None:
            return self.hf.training_refs()
        ds = self.core.train_dataset(train=False)
        refs: dict[int, list[str]] = {}
        for i, rec in enumerate(ds.records):
            try:
                refs[i] = ds.prompt_and_refs(rec)[1]
            except BadSample:  # bad text: the loader skips and counts it; no df from it
                continue
        return refs

    def build_model(self) -> nn.Module:
        """The policy, and its reference: None for a peft policy (its adapters disabled), else
        a frozen copy built from the starting checkpoint (never from a resumed policy), off the
        global RNG so the policy's RNG stream is the same whether or not a copy is built."""
        model = self.core.build_model()
        self.reference = None
        if self.hf is not None:
            self.reference = self.hf.reference(model)
        elif not has_adapters(model):
            with torch.random.fork_rng(devices=[]):
                ref = build_captioner(self.cfg, self.tokenizer)
            load_initial_weights(ref, self.core.init_ckpt)
            self.reference = frozen_reference(ref).to(self.ctx.device)
            check_frozen_reference(self.reference, model)
        return model

    def build_loader(self) -> Loader:
        """Training records as eval-style samples: prompt ids and all references per image."""
        d, ctx = self.cfg.data, self.ctx
        dataset = self.core.train_dataset(train=False)
        sampler = ShardedBatchSampler(
            len(dataset), d.batch_size, ctx.rank, ctx.world_size, self.cfg.run.seed
        )
        return self.core.loader(dataset, sampler)

    # ---- one step -----------------------------------------------------------------------

    def _sample(
        self, policy: nn.Module, batch: CaptionBatch, gen: torch.Generator
    ) -> dict[str, Tensor]:
        """K samples per image drawn with `gen` (+ greedy captions for the greedy baseline)."""
        r, k = self.cfg.rl, self.cfg.rl.k
        dev = batch["images"].device
        ids, pmask = left_pad(batch["prompt_ids"], self.tokenizer.pad_id)  # (B, P)
        ids, pmask = ids.to(dev), pmask.to(dev)
        room = policy.max_text_len - ids.shape[1]
        if room < 1:
            raise ValueError(
                f"the prompt takes {ids.shape[1]} of the decoder's {policy.max_text_len} text "
                "positions; shorten caption.prompt or raise data.max_text_len"
            )
        inputs = {"images": batch["images"], "input_ids": ids, "attention_mask": pmask}
        new, greedy_too = min(r.max_new_tokens, room), r.baseline == "greedy"
        target = CaptionerTarget(policy)
        out, greedy = rollouts(
            policy, target, inputs, k, new, r.temperature, r.top_p, gen, greedy_too
        )
        res = {"ids": ids, "pmask": pmask, "seq": out.sequences, "len": out.lengths}
        if greedy is not None:
            res["greedy_texts"] = self._decode(greedy.sequences, greedy.lengths)
        return res

    def _decode(self, seq: Tensor, lengths: Tensor) -> list[str]:
        rows = [s[: int(n)].tolist() for s, n in zip(seq, lengths, strict=True)]
        return self.tokenizer.decode_batch(rows)

    def _rewards(self, texts: list[str], refs: list[list[str]], k: int) -> Tensor:
        """Rewards (B*k,) of captions grouped per image against that image's references."""
        return self.reward(texts, [rs for rs in refs for _ in range(k)])

    def forward_backward(
        self, model: ParallelModel, batch: CaptionBatch, scale: float
    ) -> StepOutput:
        """REINFORCE on one batch: sample on the plain policy, score, then the teacher-forced
        policy forward through `model` (its backward syncs gradients) and ``loss * scale``."""
        r, k, hf = self.cfg.rl, self.cfg.rl.k, self.hf
        s = (hf.sample if hf else self._sample)(model.module, batch, self.rollout_generator())
        self.rollouts += 1
        seq, lengths = s["seq"], s["len"]  # (B*K, L), (B*K,)
        texts = (hf.decode if hf else self._decode)(seq, lengths)
        rewards = self._rewards(texts, batch["refs"], k).to(seq.device)  # (B*K,)
        eos = ends_with_eos(seq, lengths, hf.eos_ids if hf else self.tokenizer.eos_id)
        pen = length_penalty(lengths - eos.long(), r.length_penalty, r.length_target)
        shaped = rewards - pen if r.length_penalty else rewards  # what the policy maximises
        g = s.get("greedy_texts")
        greedy = None if g is None else self._rewards(g, batch["refs"], 1).to(seq.device)
        adv = advantages(shaped, k, self.baseline, greedy)
        self.baseline.update(distributed.all_reduce_mean(shaped.mean().double()))
        if hf is not None:
            fn = hf.logits_fn(model.module, batch, s, k)
        else:
            images = batch["images"].repeat_interleave(k, 0)  # (B*K, 3, S, S)
            ids, pmask = s["ids"].repeat_interleave(k, 0), s["pmask"].repeat_interleave(k, 0)
            fn = lambda m: sequence_logits(m, images, ids, pmask, seq, lengths)  # noqa: E731
        logits = fn(model)  # (B*K, L, V), through the DDP wrapper
        ref_logits = reference_logits(fn, model.module, self.reference)
        terms = policy_terms(logits, ref_logits, seq, sequence_mask(lengths, seq.shape[1]))
        loss, m = reinforce_loss(
            terms, adv, r.kl_coeff, r.entropy_coeff, r.normalize, rewards, lengths, eos
        )
        m.update(caption_stats(texts), length_penalty=pen.mean())
        names = RL_METRICS + (("length_penalty",) if r.length_penalty else ())
        local = torch.stack([m[name].detach().double().cpu() for name in names])
        glob = distributed.all_reduce_mean(local.to(seq.device)).cpu()  # one collective
        metrics = {name: float(v) for name, v in zip(names, glob, strict=True)}
        if r.baseline == "ema":
            metrics["baseline"] = float(self.baseline.value)
        (loss * scale).backward()
        return StepOutput(loss.detach(), metrics)

    # ---- evaluation and state -----------------------------------------------------------

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Caption-stage eval with greedy decoding, plus beam search as ``beam_*``."""
        strategies = {"": "greedy"}
        if self.cfg.caption.eval_beam:
            strategies["beam_"] = "beam"
        return self.core.evaluate_decoding(model, split, strategies)

    def checkpoint_files(self) -> dict[str, Path]:
        return self.core.checkpoint_files()

    def export(self, model: nn.Module, folder: Path) -> None:
        """Nothing beyond the weights and the tokenizer (the reference is never saved)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "baseline_kind": self.cfg.rl.baseline,
            "baseline": self.baseline.state_dict(),
            "rollouts": self.rollouts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("baseline_kind") == self.cfg.rl.baseline:
            self.baseline.load_state_dict(state["baseline"])
        self.rollouts = int(state.get("rollouts", 0))
