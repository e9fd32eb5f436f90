"""The drafter stage: train a DFlash-style block drafter against a frozen target.

Targets (``model.kind``): ``hf_lm`` (a local HF causal LM directory or ``.gguf`` file:
Llama, Qwen2, Qwen3 families) or ``captioner`` (a vltrain caption/rl run; the image prefix is
in the context, text is drafted). ``model.target`` names it. The target's features are computed
online under ``no_grad`` in every step, or once per sequence with ``drafter.cache_target`` (kept
in memory, 3 x 576 x 4 B = 7 KB per token for SmolLM2; anchors are still drawn per epoch, over
the cached features; vltrain.inference.feature_cache), and also on disk for later runs of the
same target with ``drafter.cache_dir``. Data should be the target's own
answers (``vltrain data regenerate``): the drafter must predict the target, and evaluation
flags data whose labels are not the target's greedy tokens.

Evaluation (docs/drafters.md): per-slot and top-4/top-8 accuracy, the exact per-block
acceptance length against the data labels (``tau``) and against the target's greedy tokens
(``tau_target``), the marginal-product estimate (``tau_marginal``), streaks, and ``tau_decode``
from real speculative decoding of held-out prompts with the target.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError, check_choice
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.data.caption_data import CaptionDataset, read_caption_source
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.draft_data import ChatRecords, DraftCollate, DraftDataset, chat_prompt_ids
from vltrain.data.loaders import Loader, MapLoader
from vltrain.data.records import split_bad
from vltrain.data.samplers import EvalShardSampler, LengthBucketBatchSampler, ShardedBatchSampler
from vltrain.engine.parallel import ParallelModel
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import StepOutput
from vltrain.inference.captioning import left_pad
from vltrain.inference.feature_cache import (
    FeatureCache,
    TopK,
    greedy_tokens,
    top_logprobs,
)
from vltrain.inference.native_llama import NativeTarget
from vltrain.inference.spec_targets import (
    CaptionerTarget,
    HFTarget,
    causal_lm_target,
    load_captioner,
    load_hf_causal_lm,
)
from vltrain.inference.speculative import speculative_generate
from vltrain.models.drafter import (
    Drafter,
    DrafterConfig,
    SharedParts,
    draft_vocab_ids,
    save_drafter_meta,
    target_layer_ids,
)
from vltrain.objectives.drafter import (
    BlockDraftLoss,
    block_labels,
    block_soft_labels,
    default_gamma,
    summarize_metrics,
)

TARGET_KINDS = ("hf_lm", "captioner")
DRAFTER_ARCHS = {  # drafter.arch -> the DrafterConfig fields it sets
    "vltrain": {},
    "dflash": {"qk_norm": True, "learned_mask": False, "norm_eps": 1e-6},
}
MAX_CACHED_TOP_K = 1024  # soft labels kept per position in a feature store
EVAL_METRICS = (
    "eval_loss",
    "eval_tau",
    "eval_tau_target",
    "eval_tau_marginal",
    "eval_tau_decode",
    "eval_tau_gap",
    "eval_acc",
    "eval_acc_*",
    "eval_top4",
    "eval_top8",
    "eval_streak4",
    "eval_streak8",
    "eval_label_agreement",
    "eval_vocab_coverage",
    "eval_labels_not_target",
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

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        check_choice("model.kind", cfg.model.kind, TARGET_KINDS, "stage drafter")
        if not cfg.model.target:
            raise ConfigError("stage drafter needs 'model.target' (the frozen target model)")
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

    # ---- target and data -------------------------------------------------------------------

    def prepare(self) -> None:
        m, d = self.cfg.model, self.cfg.drafter
        if m.kind == "hf_lm":
            model, self.tokenizer = load_hf_causal_lm(m.target)
            model.requires_grad_(False)
            n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
            ids = list(d.layer_ids) or target_layer_ids(n_layers, d.target_layers)
            self.target: Any = HFTarget(model.to(self.ctx.device), ids)
            self.pad_id = self.target.pad_token_id
            # tau_decode runs the speculative loop the way `vltrain generate` does: through
            # the native forward where the model has one (same logits, fewer ms a round)
            self.decode_target: Any = causal_lm_target(self.target.model, ids, "auto", self.pad_id)
        else:
            model, self.tokenizer, self.target_cfg = load_captioner(m.target)
            n_layers = len(model.decoder.blocks)
            ids = list(d.layer_ids) or target_layer_ids(n_layers, d.target_layers)
            self.target = CaptionerTarget(model.to(self.ctx.device), ids)
            self.decode_target = self.target
            self.pad_id = self.tokenizer.pad_id
        self.caches: dict[str, FeatureCache] = {}
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(
                f"'drafter.layer_ids' {bad} are not layers of a {n_layers}-layer target"
            )

    def _base(self, path: str, train: bool) -> Any:
        d = self.cfg.data
        if self.cfg.model.kind == "hf_lm":
            return ChatRecords(path, self.tokenizer, d.max_text_len)
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

    def build_model(self) -> nn.Module:
        d, t = self.cfg.drafter, self.target
        heads = d.heads or max(2, t.width // 64)
        dcfg = DrafterConfig(
            width=t.width,
            vocab_size=t.vocab_size,
            target_layer_ids=t.layer_ids,
            layers=d.layers,
            heads=heads,
            mlp_ratio=d.mlp_ratio,
            block_size=d.block_size,
            mask_token_id=t.pad_token_id,
            draft_vocab=self._vocab_size(),
            **DRAFTER_ARCHS[d.arch],
        )
        torch.manual_seed(self.cfg.run.seed)
        drafter = Drafter(dcfg).share(SharedParts(t.embed, t.head, t.head_params))
        drafter.init_mask_embed()
        self._drafter = drafter  # its draft vocabulary is chosen from the data (build_loader)
        return BlockDraftLoss(drafter, gamma_of(self.cfg), d.chunk_blocks, d.dpace)

    def _vocab_size(self) -> int:
        """``drafter.draft_vocab``, or 0 (the whole vocabulary, said once) when it is not
        below the target's vocabulary (a preset's 8192 on a small test target)."""
        n, v = self.cfg.drafter.draft_vocab, self.target.vocab_size
        if n < v:
            return n
        if self.ctx.is_main:
            print(
                f"vltrain: drafter: 'drafter.draft_vocab' {n} is not below the target's "
                f"vocabulary ({v}): the drafter scores the whole vocabulary",
                file=sys.stderr,
            )
        return 0

    def _draft_vocab(self, base: Any, n: int) -> Tensor:
        """The n most frequent label tokens of the whole training set (EOS always kept):
        every rank counts the same records, so every rank picks the same ids. Chosen when the
        training data is built (not in build_model: export and loading need no data, and a
        resumed run takes the checkpoint's ids, loaded after this)."""
        t = self.target
        labels = [tok for i in range(len(base)) for tok in base.label_ids(i)]
        counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=t.vocab_size)
        ids = draft_vocab_ids(counts, n, always=(t.eos_token_id,))
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
        base = self._base(d.train, train=True)
        if d.max_train_samples:
            base.records = base.records[: d.max_train_samples]
        if self._drafter.cfg.draft_vocab:
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
            data, sampler, DraftCollate(self.pad_id), num_workers=d.num_workers, seed=c.run.seed
        )

    # ---- one step --------------------------------------------------------------------------

    def _target(self, batch: dict[str, Any], split: str) -> tuple:
        """(Context, the target's logits (B, T, V) or its top-k tokens (``soft_top_k``; None
        when cached without soft labels), greedy tokens (B, T), prefix length)."""
        d = self.cfg.drafter
        k = d.soft_top_k if d.soft_labels else 0
        if d.cache_target or d.cache_dir:
            if split not in self.caches:
                known = next((c.store.name for c in self.caches.values() if c.store), None)
                self.caches[split] = FeatureCache(self.target, d.cache_dir or None, known, k)
                if d.cache_dir and self.ctx.is_main and split == "train":
                    print(
                        f"vltrain: drafter: target features cached in {self.caches[split].store}",
                        file=sys.stderr,
                    )
            ctx, greedy, p, top = self.caches[split].features(batch)
            return ctx, top, greedy, p
        mask = batch["attention_mask"]
        if "images" in batch:
            ctx, tlogits, p = self.target.features(batch["images"], batch["input_ids"], mask)
        else:
            ctx, tlogits, p = self.target.features(batch["input_ids"], mask)
        soft = top_logprobs(tlogits, mask, k) if k else tlogits
        return ctx, soft, greedy_tokens(tlogits, mask), p

    def _inputs(self, batch: dict[str, Any], split: str = "train") -> tuple:
        """Target features and the drafter's inputs of one batch (target under no_grad)."""
        ctx, tlogits, greedy, p = self._target(batch, split)
        labels = batch["labels"]
        full = torch.cat([labels.new_full((labels.shape[0], p), IGNORE_INDEX), labels], 1)
        anchors, valid = batch["anchors"], batch["anchor_valid"]
        a_ids = batch["input_ids"].gather(1, anchors)
        lab, lab_valid = block_labels(full, anchors + p, valid, self.cfg.drafter.block_size)
        return ctx, tlogits, greedy, p, a_ids, anchors + p, lab, lab_valid

    @staticmethod
    def _agreement(labels: Tensor, greedy: Tensor) -> Tensor:
        """(labels equal to the target's greedy token, supervised labels) of a batch."""
        sup = labels[:, 1:] != IGNORE_INDEX
        same = (labels[:, 1:] == greedy[:, :-1]) & sup
        return torch.stack([same.sum(), sup.sum()]).double()

    def _soft(self, target: Tensor | TopK | None, a_pos: Tensor, p: int) -> Any:
        """Soft labels, dense (B, A, K, V) from logits or sparse from the target's top-k; None
        without ``drafter.soft_labels``."""
        if not self.cfg.drafter.soft_labels:
            return None
        if target is None:  # check_config keeps this from happening: never fall back silently
            raise RuntimeError("drafter.soft_labels is on but the target gave no distribution")
        return block_soft_labels(target, a_pos - p, self.cfg.drafter.block_size)

    def forward_backward(
        self, model: ParallelModel, batch: dict[str, Any], scale: float
    ) -> StepOutput:
        """sum(CE * w) / sum(w) over the global batch, whatever the world size."""
        ctx, tlogits, greedy, p, a_ids, a_pos, lab, valid = self._inputs(batch)
        loss, weight, sums = model(
            ctx.features,
            ctx.positions,
            ctx.valid,
            a_ids,
            a_pos,
            lab,
            valid,
            self._soft(tlogits, a_pos, p),
        )
        agree = self._agreement(batch["labels"], greedy)
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
        base = self._base(path, train=True)
        data = DraftDataset(base, 0, self.cfg.run.seed)
        collate = DraftCollate(self.pad_id)
        sums: dict[str, Tensor] = {}
        loss_w = torch.zeros(4, dtype=torch.float64)  # loss sum, weight, agree, supervised
        bs = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        dev = self.ctx.device
        for keys in EvalShardSampler(len(data), bs, self.ctx.rank, self.ctx.world_size):
            good, _ = split_bad([data[k] for k in keys])
            if not good:
                continue
            batch = {k: v.to(dev) for k, v in collate(good).items()}
            ctx, tlogits, greedy, p, a_ids, a_pos, lab, valid = self._inputs(batch, split)
            loss, weight, s = model(
                ctx.features,
                ctx.positions,
                ctx.valid,
                a_ids,
                a_pos,
                lab,
                valid,
                self._soft(tlogits, a_pos, p),
            )
            _, _, st = model(
                ctx.features,
                ctx.positions,
                ctx.valid,
                a_ids,
                a_pos,
                *self._greedy_labels(greedy, a_pos, p, valid),
            )
            loss_w += torch.stack(
                [
                    loss.double().cpu(),
                    weight.double().cpu(),
                    *self._agreement(batch["labels"], greedy).cpu(),
                ]
            )
            for k, v in s.items():
                sums[k] = sums.get(k, 0) + v.cpu()
            for k, v in st.items():
                sums[f"t_{k}"] = sums.get(f"t_{k}", 0) + v.cpu()
        return self._summarize(model, sums, loss_w, base)

    def _greedy_labels(self, greedy: Tensor, a_pos: Tensor, p: int, valid: Tensor):  # noqa: ANN202
        """Block labels from the target's greedy tokens (token at t = argmax after t - 1)."""
        g = torch.cat([greedy.new_full((greedy.shape[0], p + 1), IGNORE_INDEX), greedy[:, :-1]], 1)
        lab, ok = block_labels(g, a_pos, valid.any(-1), self.cfg.drafter.block_size)
        return lab, ok & valid

    def _summarize(self, model, sums, loss_w, base) -> dict[str, float]:  # noqa: ANN001
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
        m.update(self._decode_tau(model, base))
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

    def _prompts(self, base: Any, idx: list[int]) -> dict[str, Tensor]:
        dev = self.ctx.device
        if self.cfg.model.kind == "hf_lm":
            rows = [chat_prompt_ids(self.tokenizer, base.records[i]["prompt"]) for i in idx]
            ids, mask = left_pad(rows, self.pad_id)
            return {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        samples = [base[(0, 0, i)] for i in idx]
        samples = [s for s in samples if "bad" not in s]
        prompt = [self.tokenizer.bos_id] + (
            self.tokenizer.encode(base.prompt) if getattr(base, "prompt", "") else []
        )
        ids, mask = left_pad([prompt] * len(samples), self.pad_id)
        images = torch.stack([s["image"] for s in samples])
        return {"images": images.to(dev), "input_ids": ids.to(dev), "attention_mask": mask.to(dev)}

    def _decode_tau(self, model: nn.Module, base: Any) -> dict[str, float]:
        """tau of real speculative decoding of this rank's share of the first eval prompts."""
        d = self.cfg.drafter
        n = min(d.eval_prompts, len(base))
        mine = list(range(n))[self.ctx.rank :: self.ctx.world_size]
        drafter = model.drafter
        out = {}
        for name, budget in (("", 0), ("_tree", d.eval_tree_budget)):
            if name and not budget:
                continue
            acc = torch.zeros(2, dtype=torch.float64)
            if mine:
                _, stats = speculative_generate(
                    self.decode_target,
                    drafter,
                    self._prompts(base, mine),
                    max_new_tokens=self._room(d.eval_max_new_tokens),
                    tree_budget=budget,
                )
                acc += torch.tensor([sum(map(sum, stats.accepted)), stats.rounds])
            acc = distributed.all_reduce_sum(acc.to(self.ctx.device)).cpu()
            out[f"tau_decode{name}"] = float(acc[0] / acc[1].clamp(min=1))
        if isinstance(self.decode_target, NativeTarget):
            self.decode_target.release()  # ~2 copies of the target's weights until next eval
        return out

    def _room(self, want: int) -> int:
        if self.cfg.model.kind == "hf_lm":
            return want
        m = self.target.model
        return max(1, min(want, m.max_text_len - 2 - self.cfg.drafter.block_size))

    # ---- checkpoints -----------------------------------------------------------------------

    def checkpoint_files(self) -> dict[str, Path]:
        return {}

    def export(self, model: nn.Module, folder: Path) -> None:
        """drafter.json: the drafter config and its target, read by ``--draft``."""
        target = {"kind": self.cfg.model.kind, "path": str(Path(self.cfg.model.target).resolve())}
        save_drafter_meta(folder, model.drafter.cfg, target)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state besides the weights."""
