"""The drafter stage: train a DFlash-style block drafter against a frozen target.

The target, its records, its features (online, or cached per sequence: ``drafter.cache_target``
/ ``drafter.cache_dir``) and real decoding with it are the stage's `DraftTarget`
(`vltrain.inference.draft_target`); the drafter and its loss are `vltrain.models.drafter` and
`vltrain.objectives.drafter`. Data should be the target's own answers (``vltrain data
regenerate``): the drafter must predict the target, and evaluation flags data whose labels are
not the target's greedy tokens.

Evaluation (docs/drafters.md): per-slot and top-4/top-8 accuracy, the exact per-block
acceptance length against the data labels (``tau``) and against the target's greedy tokens
(``tau_target``), the marginal-product estimate (``tau_marginal``), streaks, and ``tau_decode``
from real speculative decoding of held-out prompts with the target.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError, check_choice
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.core.checkpoint import has_weights
from vltrain.data.batches import DraftBatch, to_device
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.draft_data import DraftCollate, DraftDataset
from vltrain.data.loaders import Loader, MapLoader
from vltrain.data.records import split_bad
from vltrain.data.samplers import EvalShardSampler, LengthBucketBatchSampler, ShardedBatchSampler
from vltrain.engine.parallel import ParallelModel
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import StepOutput
from vltrain.inference.draft_target import (
    TARGET_KINDS,
    DraftTarget,
    FeatureNoise,
    check_target,
)
from vltrain.inference.target import stop_ids
from vltrain.models.drafter import (
    Drafter,
    DrafterConfig,
    SharedParts,
    arch_fields,
    draft_vocab_ids,
    save_drafter_meta,
    target_record,
)
from vltrain.models.drafter_checkpoint import drafter_to_continue
from vltrain.objectives.drafter import BlockDraftLoss, default_gamma, summarize_metrics

MAX_CACHED_TOP_K = 1024  # soft labels kept per position in a feature store
EVAL_METRICS = (
    *("eval_loss", "eval_tau", "eval_tau_target", "eval_tau_marginal", "eval_tau_decode"),
    *("eval_tau_gap", "eval_acc", "eval_acc_*", "eval_top4", "eval_top8", "eval_streak4"),
    *("eval_streak8", "eval_label_agreement", "eval_vocab_coverage", "eval_labels_not_target"),
    "eval_*",
)


def gamma_of(cfg: Config) -> float:
    """The configured gamma, or the one derived from the block size."""
    d = cfg.drafter
    return d.gamma if d.gamma > 0 else default_gamma(d.block_size)


class DrafterStage:
    """Block-drafter training against a frozen target; best checkpoint by ``eval_tau``."""

    best_metric = "eval_tau"
    best_mode = "max"

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.out_dir, self.ctx = cfg, Path(out_dir), ctx
        d = cfg.drafter  # noise on the target's features in training (drafter.noise)
        self.noise = FeatureNoise(d.noise, d.noise_warmup_steps, cfg.optim.accum_steps)

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        check_choice("model.kind", cfg.model.kind, TARGET_KINDS, "stage drafter")
        if not cfg.model.target:
            raise ConfigError("stage drafter needs 'model.target' (the frozen target model)")
        if cfg.model.init_from and not Path(cfg.model.init_from).exists():
            raise ConfigError(f"'model.init_from' {cfg.model.init_from} does not exist")
        check_target(cfg)
        d = cfg.drafter
        if (d.cache_target or d.cache_dir) and d.soft_labels and not d.soft_top_k:
            which = "cache_dir' (it implies cache_target)" if d.cache_dir else "cache_target'"
            raise ConfigError(
                f"'drafter.{which} keeps the target's k most likely tokens per position, not "
                "its whole distribution: set 'drafter.soft_top_k' (e.g. 32) for "
                "'drafter.soft_labels' on cached features, or turn one of them off"
            )
        if (d.cache_target or d.cache_dir) and d.soft_labels and d.soft_top_k > MAX_CACHED_TOP_K:
            raise ConfigError(
                f"'drafter.soft_top_k={d.soft_top_k}' on cached features stores 8 bytes a "
                f"position for each kept token (at {MAX_CACHED_TOP_K}, 8 KB: more than "
                f"SmolLM2's features): keep it <= {MAX_CACHED_TOP_K}, or train online"
            )
        if d.soft_top_k and not d.soft_labels:
            raise ConfigError(
                f"'drafter.soft_top_k={d.soft_top_k}' only shapes soft labels, and "
                "'drafter.soft_labels' is off: turn it on, or drop soft_top_k"
            )

    @classmethod
    def eval_metrics(cls, cfg: Config) -> tuple[str, ...]:
        return EVAL_METRICS

    # ---- target, model and data ------------------------------------------------------------

    def prepare(self) -> None:
        """Load the frozen target (and its tokenizer) onto this rank's device."""
        from vltrain.stages.caption_hf import run_target

        vlm = run_target(self.cfg) if self.cfg.model.kind == "hf_vlm" else None
        self.target = DraftTarget(self.cfg, self.ctx.device, self.ctx.is_main, vlm)
        self.tokenizer = self.target.tokenizer

    def build_model(self) -> nn.Module:
        d, t = self.cfg.drafter, self.target.model
        heads, init = d.heads or max(2, t.width // 64), self.cfg.model.init_from
        dcfg = DrafterConfig(
            width=t.width,
            vocab_size=t.vocab_size,
            target_layer_ids=t.layer_ids,
            layers=d.layers,
            heads=heads,
            mlp_ratio=d.mlp_ratio,
            block_size=d.block_size,
            mask_token_id=t.pad_token_id,
            draft_vocab=0 if init else self._vocab_size(),  # an import's own (below)
            **arch_fields(d.arch, self.cfg.model.kind),
        )
        imported = drafter_to_continue(init, dcfg, self.target) if init else None
        if imported is not None:  # its mask token and draft vocabulary are its own
            c = imported.cfg
            dcfg = replace(dcfg, mask_token_id=c.mask_token_id, draft_vocab=c.draft_vocab)
        torch.manual_seed(self.cfg.run.seed)
        drafter = Drafter(dcfg).share(SharedParts(t.embed, t.head, t.head_params))
        drafter.init_mask_embed()
        if imported is not None:
            drafter.load_state_dict(imported.state_dict(), strict=True)
        self._drafter = drafter  # its draft vocabulary is chosen from the data (build_loader)
        return BlockDraftLoss(drafter, gamma_of(self.cfg), d.chunk_blocks, d.dpace)

    def _vocab_size(self) -> int:
        """``drafter.draft_vocab``, or 0 (the whole vocabulary, said once) when it is not
        below the target's vocabulary (a preset's 8192 on a small test target)."""
        n, v = self.cfg.drafter.draft_vocab, self.target.model.vocab_size
        if n < v:
            return n
        if self.ctx.is_main and not has_weights(self.out_dir):  # not when loading a checkpoint
            print(
                f"vltrain: drafter: 'drafter.draft_vocab' {n} is not below the target's "
                f"vocabulary ({v}): the drafter scores the whole vocabulary",
                file=sys.stderr,
            )
        return 0

    def _draft_vocab(self, base: Any, n: int) -> Tensor:
        """The n most frequent label tokens of the whole training set (the stop ids always kept):
        every rank counts the same records, so every rank picks the same ids. Chosen when the
        training data is built (not in build_model: export and loading need no data, and a
        resumed run takes the checkpoint's ids, loaded after this)."""
        t = self.target.model
        labels = [tok for i in range(len(base)) for tok in base.label_ids(i)]
        counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=t.vocab_size)
        ids = draft_vocab_ids(counts, n, always=stop_ids(t))
        kept = float(counts[ids].sum() / counts.sum().clamp(min=1))
        if self.ctx.is_main:
            print(
                f"vltrain: drafter: draft vocabulary of {n} of {t.vocab_size} tokens covers "
                f"{kept:.2%} of the training labels ({int(counts.sum())} tokens)",
                file=sys.stderr,
            )
        return ids

    def build_loader(self) -> Loader:
        c, d, ctx = self.cfg, self.cfg.data, self.ctx
        base = self.target.records(d.train, train=True)
        if d.max_train_samples:
            base.records = base.records[: d.max_train_samples]
        if self._drafter.cfg.draft_vocab and not c.model.init_from:  # imported: kept
            self._drafter.set_vocab(self._draft_vocab(base, self._drafter.cfg.draft_vocab))
        data = DraftDataset(base, c.drafter.anchors, c.run.seed)
        if d.length_buckets > 0:
            lengths = [data.token_length(i) for i in range(len(data))]
            sampler: Any = LengthBucketBatchSampler(
                lengths,
                d.batch_size,
                ctx.rank,
                ctx.world_size,
                c.run.seed,
                n_buckets=d.length_buckets,
                max_same_bucket_run=d.max_same_bucket_run,
            )
        else:
            sampler = ShardedBatchSampler(
                len(data), d.batch_size, ctx.rank, ctx.world_size, c.run.seed
            )
        return MapLoader(
            data,
            sampler,
            DraftCollate(self.target.pad_id),
            num_workers=d.num_workers,
            seed=c.run.seed,
        )

    # ---- one step --------------------------------------------------------------------------

    @staticmethod
    def _agreement(labels: Tensor, greedy: Tensor) -> Tensor:
        """(labels equal to the target's greedy token, supervised labels) of a batch."""
        sup = labels[:, 1:] != IGNORE_INDEX
        same = (labels[:, 1:] == greedy[:, :-1]) & sup
        return torch.stack([same.sum(), sup.sum()]).double()

    def forward_backward(self, model: ParallelModel, batch: DraftBatch, scale: float) -> StepOutput:
        """sum(CE * w) / sum(w) over the global batch, whatever the world size."""
        inp = self.noise(self.target.inputs(batch))
        soft = self.target.soft_labels(inp)
        loss, weight, sums = model(*inp.drafter_args(), inp.labels, inp.valid, soft)
        agree = self._agreement(batch["labels"], inp.greedy)
        local = torch.stack([loss.detach().double(), weight.double(), *agree])
        total = distributed.all_reduce_sum(local)
        w_all = total[1].clamp(min=1e-12)
        (loss * (self.ctx.world_size / w_all).float() * scale).backward()
        m = summarize_metrics({k: v.cpu() for k, v in sums.items()})
        metrics = {
            "tau": m["tau"],
            "acc": m["acc"],
            "label_agreement": float(total[2] / total[3].clamp(min=1)),
        }
        return StepOutput((total[0] / w_all).float(), metrics)

    # ---- evaluation ------------------------------------------------------------------------

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Block metrics over every anchor of this rank's shard, then real decoding."""
        path = self.cfg.data.eval if split == "val" else self.cfg.data.test
        base = self.target.records(path, train=True)
        data = DraftDataset(base, 0, self.cfg.run.seed)
        collate = DraftCollate(self.target.pad_id)
        sums: dict[str, Tensor] = {}
        loss_w = torch.zeros(4, dtype=torch.float64)  # loss sum, weight, agree, supervised
        bs = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        dev = self.ctx.device
        for keys in EvalShardSampler(len(data), bs, self.ctx.rank, self.ctx.world_size):
            good, _ = split_bad([data[k] for k in keys])
            if not good:
                continue
            batch = to_device(collate(good), dev)
            inp = self.target.inputs(batch, split)
            soft = self.target.soft_labels(inp)
            loss, weight, s = model(*inp.drafter_args(), inp.labels, inp.valid, soft)
            _, _, st = model(*inp.drafter_args(), *self.target.greedy_labels(inp))
            agree = self._agreement(batch["labels"], inp.greedy).cpu()
            loss_w += torch.stack([loss.double().cpu(), weight.double().cpu(), *agree])
            for k, v in s.items():
                sums[k] = sums.get(k, 0) + v.cpu()
            for k, v in st.items():
                sums[f"t_{k}"] = sums.get(f"t_{k}", 0) + v.cpu()
        return self._summarize(model, sums, loss_w, base)

    def _summarize(
        self, model: nn.Module, sums: dict[str, Tensor], loss_w: Tensor, base: Any
    ) -> dict[str, float]:
        """Every rank's sums reduced in one all-reduce, then the metrics and real decoding."""
        keys = sorted(sums)
        flat = torch.cat([sums[k].reshape(-1).double() for k in keys] + [loss_w])
        flat = distributed.all_reduce_sum(flat.to(self.ctx.device)).cpu()
        out, i = {}, 0
        for k in keys:
            n = sums[k].numel()
            out[k] = flat[i : i + n].reshape(sums[k].shape)
            i += n
        loss_w = flat[i:]
        m = summarize_metrics({k: v for k, v in out.items() if not k.startswith("t_")})
        mt = summarize_metrics({k[2:]: v for k, v in out.items() if k.startswith("t_")})
        m["tau_target"] = mt["tau"]
        m["loss"] = float(loss_w[0] / loss_w[1].clamp(min=1e-12))
        m["label_agreement"] = float(loss_w[2] / loss_w[3].clamp(min=1))
        flagged = m["label_agreement"] < self.cfg.drafter.min_label_agreement
        m["labels_not_target"] = float(flagged)
        m.update(self.target.decode_tau(model.drafter, base, self.ctx.rank, self.ctx.world_size))
        m["tau_gap"] = m["tau"] - m["tau_decode"]
        if flagged and self.ctx.is_main:
            print(
                f"vltrain: drafter eval: only {m['label_agreement']:.1%} of the labels are the "
                f"target's greedy tokens: training tau {m['tau']:.2f} is not deployment tau "
                f"({m['tau_decode']:.2f} measured); regenerate the data with the target "
                "(vltrain data regenerate)",
                file=sys.stderr,
            )
        return m

    # ---- checkpoints -----------------------------------------------------------------------

    def checkpoint_files(self) -> dict[str, Path]:
        return {}

    def export(self, model: nn.Module, folder: Path) -> None:
        """drafter.json: the drafter config and its target, read by ``--draft``."""
        m = self.cfg.model
        target = target_record(m.kind, m.target, folder, self.target.config_sha256)
        save_drafter_meta(folder, model.drafter.cfg, target, self.target.last_decode)

    def state_dict(self) -> dict[str, Any]:
        return self.noise.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The noise schedule's clock (a run saved before it existed starts it at 0)."""
        self.noise.load_state_dict(state)
