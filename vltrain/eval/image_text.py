"""Retrieval evaluation of a contrastive encoder on image-caption records, sharded over ranks.

Each rank embeds its contiguous shard of the records (images, every caption, hard negatives)
through the stage's batcher, the shards are gathered once, and every rank computes the same
metrics, so no rank waits at a barrier on work only one rank does and no number depends on the
eval batch size or the world size:

- COCO-protocol retrieval both ways (`image_text_retrieval`) and ``R@1_mean``, their mean;
- the R@1 a perfect model expects (`vltrain.eval.ceiling`), when the records say what their
  captions describe (the synthetic data's scene);
- the loss and accuracy over fixed chunks of the global eval batch (first caption per image);
- hard-negative accuracy (how often the first caption outscores each negative), also per kind
  of negative (``negative_kinds``);
- R@K of truncated embeddings (``model.matryoshka_dims``).

`vltrain mine` and curation embed through `ImageTextEvaluator.embed_shard` as well, so a mined
embedding is exactly an evaluation embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from vltrain.core import distributed
from vltrain.data.batches import to_device
from vltrain.data.readers import DataError
from vltrain.data.records import ImageTextDataset, split_bad
from vltrain.data.samplers import EvalShardSampler
from vltrain.data.synth import scene_key
from vltrain.eval.ceiling import retrieval_ceiling
from vltrain.eval.corpus import metric_suffix
from vltrain.eval.protocols import Batcher, Encoder, Placement
from vltrain.eval.retrieval import image_text_retrieval

#: the loss of (image (N, E), text (N, E)) embeddings, without cross-rank gathering:
#: (loss, metrics with ``acc_i2t``)
PairLoss = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Any]]]

#: metrics `ImageTextEvaluator.evaluate` returns (patterns: per-kind and per-k keys)
METRICS = (
    "eval_loss",
    "eval_acc_i2t",
    "eval_R@1_mean",
    "eval_i2t_*",
    "eval_t2i_*",
    "eval_i2t_R@1_ceiling",
    "eval_t2i_R@1_ceiling",
    "eval_hardneg_acc",
    "eval_hardneg_acc_*",
    "eval_bad_samples",
    "eval_n_images",
)


class ImageTextEvaluator:
    """Sharded image<->text retrieval through a backbone's batcher; `batch_size` per rank;
    ``matryoshka_dims``: also evaluate embeddings truncated to these widths (``d{dim}_*``);
    `loss_chunk`: images per chunk of the eval loss, a number the world size does not change
    (0: `batch_size` x world size)."""

    def __init__(
        self,
        batcher: Batcher,
        where: Placement,
        batch_size: int,
        matryoshka_dims: Sequence[int] = (),
        loss_chunk: int = 0,
    ) -> None:
        self.batcher, self.where, self.batch_size = batcher, where, batch_size
        self.matryoshka_dims = tuple(matryoshka_dims)
        self.loss_chunk = loss_chunk

    def evaluate(self, encoder: Encoder, ds: ImageTextDataset, loss: PairLoss) -> dict[str, float]:
        """Sharded embedding, gathered once; every rank then computes the same metrics."""
        where = self.where
        shard, shard_kind_hits, _ = self.embed_shard(encoder, ds, where.rank, where.world_size)
        g = {k: distributed.all_gather_no_grad(v) for k, v in shard.items()}
        img, idx, txt, owner = g["img"], g["idx"], g["txt"], g["owner"]
        if img.shape[0] == 0:  # every rank alike (gathered)
            raise DataError(
                f"{ds.path}: none of its {len(ds)} evaluation records has an image that decodes "
                "and a valid caption (missing files, paths relative to the wrong folder?): "
                "nothing to evaluate"
            )
        pos = torch.searchsorted(idx, owner)  # text -> row of its image in `img`
        metrics = image_text_retrieval(img, txt, pos)
        metrics["R@1_mean"] = 0.5 * (metrics["i2t_R@1"] + metrics["t2i_R@1"])
        metrics.update(self._ceiling(ds, idx, pos))
        metrics.update(self._eval_loss(loss, img, txt, pos))
        total = float(g["hn_total"].sum())
        if total:
            metrics["hardneg_acc"] = float(g["hn_correct"].sum()) / total
        kind_hits: dict[str, list[int]] = {}
        for part in distributed.all_gather_object(shard_kind_hits):  # every rank, same order
            for kind, (c, t) in part.items():
                acc = kind_hits.setdefault(kind, [0, 0])
                acc[0], acc[1] = acc[0] + c, acc[1] + t
        for kind in sorted(kind_hits):  # accuracy per kind of negative (`negative_kinds`)
            c, t = kind_hits[kind]
            metrics[f"hardneg_acc_{metric_suffix(kind)}"] = c / t
        for dim in self.matryoshka_dims:  # truncated embeddings, evaluated separately
            small = image_text_retrieval(
                encoder.truncate(img, dim), encoder.truncate(txt, dim), pos
            )
            metrics.update({f"d{dim}_{k}": v for k, v in small.items() if "R@" in k})
        metrics["bad_samples"] = float(g["n_bad"].sum())
        metrics["n_images"] = float(img.shape[0])
        return metrics

    def embed_shard(
        self,
        encoder: Encoder,
        ds: ImageTextDataset,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 0,
    ) -> tuple[dict[str, Tensor], dict[str, list[int]], list[str]]:
        """Embeddings of the shard `rank` of `ds` through the batcher.

        Returns tensors (img (I, E), idx (I,), txt (T, E), owner (T,), hard-negative hit
        counts, n_bad), hard-negative hits per negative kind ({kind: [correct, total]}), and
        the caption strings in `txt` order.
        """
        bs = batch_size or self.batch_size
        dev = self.where.device
        out: dict[str, list[Tensor]] = {
            k: [] for k in ("img", "idx", "txt", "owner", "hn_correct", "hn_total")
        }
        n_bad, kind_hits, all_texts = 0, {}, []
        for keys in EvalShardSampler(len(ds), bs, rank, world_size):
            good, bad = split_bad([ds[k] for k in keys])
            n_bad += len(bad)
            if not good:
                continue
            images, _ = self.batcher.image_batch([s["image"] for s in good])
            img = encoder.encode_image(to_device(images, dev))  # (b, E)
            texts = [t for s in good for t in s["texts"]]
            owner = torch.tensor([s["index"] for s in good for _ in s["texts"]])
            txt = self.encode_texts(encoder, texts)  # (sum captions, E)
            out["img"].append(img.float().cpu())
            out["idx"].append(torch.tensor([s["index"] for s in good]))
            out["txt"].append(txt.float().cpu())
            out["owner"].append(owner)
            all_texts += texts
            c, t = self._hard_negative_hits(encoder, img, txt, good, kind_hits)
            out["hn_correct"].append(c)
            out["hn_total"].append(t)
        cat = {k: (torch.cat(v) if v else torch.zeros(0)) for k, v in out.items()}
        cat["n_bad"] = torch.tensor([n_bad])
        return cat, kind_hits, all_texts

    def encode_texts(self, encoder: Encoder, texts: list[str]) -> Tensor:
        """Unit-norm text embeddings (N, E) through the batcher."""
        ids, mask = self.batcher.text_batch(texts)
        dev = self.where.device
        return encoder.encode_text(ids.to(dev), mask.to(dev))

    def _hard_negative_hits(
        self,
        encoder: Encoder,
        img: Tensor,
        txt: Tensor,
        good: list[dict],
        kind_hits: dict[str, list[int]],
    ) -> tuple[Tensor, Tensor]:
        """How often the first caption outscores each negative; adds per-kind counts to
        `kind_hits` for samples with `negative_kinds`."""
        negs = [n for s in good for n in s["negatives"]]
        if not negs:
            return torch.zeros(1), torch.zeros(1)
        neg = self.encode_texts(encoder, negs).float()  # (M, E)
        first = torch.tensor([0] + [len(s["texts"]) for s in good[:-1]]).cumsum(0)
        owner = torch.tensor([i for i, s in enumerate(good) for _ in s["negatives"]])
        pos_score = (img.float() * txt[first].float()).sum(-1)  # (b,)
        neg_score = (img.float()[owner] * neg).sum(-1)  # (M,)
        hit = (pos_score[owner] > neg_score).cpu()  # (M,)
        kinds = [k for s in good for k in s.get("negative_kinds") or [None] * len(s["negatives"])]
        for kind, h in zip(kinds, hit.tolist(), strict=True):
            if kind is not None:
                c = kind_hits.setdefault(kind, [0, 0])
                c[0] += int(h)
                c[1] += 1
        return hit.sum().float().reshape(1), torch.tensor([float(len(negs))])

    @staticmethod
    def _ceiling(ds: ImageTextDataset, idx: Tensor, pos: Tensor) -> dict[str, float]:
        """The R@1 a perfect model expects on these images (`vltrain.eval.ceiling`), when the
        records say what their captions describe (the synthetic data's scene); else nothing."""
        keys = [scene_key(ds.records[i]) for i in idx.tolist()]
        if not keys or all(k is None for k in keys):
            return {}
        n_captions = torch.bincount(pos, minlength=len(keys)).tolist()  # captions per image
        return {f"{k}_ceiling": v for k, v in retrieval_ceiling(keys, n_captions).items()}

    def _eval_loss(self, loss: PairLoss, img: Tensor, txt: Tensor, pos: Tensor) -> dict[str, float]:
        """The loss over fixed chunks of the eval set (first caption per image), world-size
        free."""
        first = torch.full((img.shape[0],), -1, dtype=torch.long)
        first.scatter_reduce_(0, pos, torch.arange(len(pos)), reduce="amin", include_self=False)
        # fixed-size chunks, so the value does not depend on the world size
        bs = self.loss_chunk or self.batch_size * self.where.world_size
        dev = self.where.device
        loss_sum = acc_sum = 0.0
        for s in range(0, img.shape[0], bs):
            image, text = img[s : s + bs].to(dev), txt[first[s : s + bs]].to(dev)
            value, m = loss(image, text)
            loss_sum += float(value) * image.shape[0]
            acc_sum += float(m["acc_i2t"]) * image.shape[0]
        n = max(img.shape[0], 1)
        return {"loss": loss_sum / n, "acc_i2t": acc_sum / n}
