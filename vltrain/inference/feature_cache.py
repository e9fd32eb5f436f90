"""Target features kept per record: a frozen target's forward computed once, not every epoch.

A drafter step needs the target's hidden states at a few layers for every position of its
sequences. The target is frozen, so a record gets the same features in every epoch; on a CPU
that forward (a 135M target over the whole sequence, its LM head included) costs more than the
drafter's own forward and backward. ``FeatureCache`` computes a sequence's features the first
time it is met, alone and unpadded (so the cached values do not depend on which batch first
met it, and a resumed run reads the same features), keeps them with the target's greedy
tokens, and assembles later batches from memory. The logits are not kept (49k floats a token);
for ``drafter.soft_labels`` a cache made with ``top_k`` keeps the target's k largest
log-probabilities per position and their token ids (``drafter.soft_top_k``; 32 of them cost
256 bytes a token, ~4% of SmolLM2's features). A stored row without them, or with fewer, gets
them the first time a run asks (the target runs again; the stored features are kept, so runs
reading the row keep reading the same values); a row with more is cut.

Keys are the content of the row (its token ids, and its image for a captioner), not the
record's index: a captioner record with several captions trains on another caption in another
epoch, and must not be handed the features of the first one.

With a ``store`` folder the features also go to disk (SpecForge's and speculators' "offline"
hidden states): ``store/<target fingerprint>/<row digest>.safetensors``, written atomically,
read back by any later run of the same target and layers (another block size, gamma or
vocabulary; a resumed run; another rank). The fingerprint hashes the target's kind, the layers
read, this module's feature format and every tensor of the target's state dict, so features of
another target, other weights or other layers are never read.

Memory: (P + T) x n x W floats per sequence (SmolLM2, 3 layers: 7 KB a token, ~1.7 MB for a
250-token answer); the features live on the CPU and move to the batch's device when used. On
disk the same bytes. With a store nothing is kept in memory: every batch reads its rows back
(the OS caches the files; a few ms a step), so memory does not grow with the dataset. Without
one, each kept row is copied into storage of its own and freed memory is handed back to the
OS after each target forward (glibc's ``malloc_trim``): the forward's large temporaries freed
around small long-lived rows fragmented the heap, and a run caching 3,200 SmolLM2 answers
(4 GB of features) was killed at 24 GB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from vltrain.data.chat import IGNORE_INDEX
from vltrain.inference.target import Context

FORMAT = 1  # bump when what a cached row holds, or how it is computed, changes
Row = dict[str, Tensor]  # FIELDS, plus TOP_FIELDS in a cache with top_k
FIELDS = ("features", "positions", "valid", "greedy")
TOP_FIELDS = ("top_ids", "top_logp")


class TopK(NamedTuple):
    """The target's k most likely next tokens after each position: ids and log-probabilities
    under its whole distribution, (B, T, k) each, most likely first; padding holds id 0, 0.0."""

    ids: Tensor
    logp: Tensor


def _libc_trim() -> Any:
    """glibc's ``malloc_trim`` (None elsewhere: macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def greedy_tokens(logits: Tensor, text_mask: Tensor) -> Tensor:
    """The target's token after each real position (B, T); IGNORE_INDEX after padding."""
    return logits.argmax(-1).masked_fill(~text_mask.bool(), IGNORE_INDEX)


def top_logprobs(logits: Tensor, text_mask: Tensor, k: int) -> TopK:
    """The k most likely tokens after each real position of logits (B, T, V)."""
    logp, ids = torch.log_softmax(logits.float(), -1).topk(min(k, logits.shape[-1]), -1)
    pad = ~text_mask.bool()[..., None]
    return TopK(ids.masked_fill(pad, 0), logp.masked_fill(pad, 0.0))


def _update(h: Any, t: Tensor) -> None:
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def target_fingerprint(target: Any) -> str:
    """A digest of what the features depend on: the target's kind, the layers read, the
    feature format and every tensor of the target's state dict (one pass over the weights:
    about a second for a 135M target)."""
    h = hashlib.blake2b(digest_size=16)
    head = {"kind": type(target).__name__, "layers": list(target.layer_ids), "format": FORMAT}
    if getattr(target, "reads_last", False):  # stores from before it read the raw last block
        head["last_block"] = "raw"
    h.update(json.dumps(head, sort_keys=True).encode())
    for name, t in sorted(target.model.state_dict().items()):
        h.update(name.encode())
        _update(h, t)
    return h.hexdigest()


class FeatureCache:
    """Per-sequence target features of one split, in memory, or on disk in `store`."""

    def __init__(
        self,
        target: Any,
        store: str | Path | None = None,
        fingerprint: str | None = None,
        top_k: int = 0,
    ) -> None:
        """``fingerprint``: the target's, when the caller has it (another split's cache);
        ``top_k``: also keep the target's k most likely tokens per position (soft labels)."""
        self.target = target
        self.top_k = min(top_k, target.vocab_size) if top_k > 0 else 0
        self.rows: dict[str, Row] = {}
        self.computed = 0  # target forwards run (a test counts them)
        self.loaded = 0  # rows read from the store
        self.store: Path | None = None
        if store:
            self.store = Path(store) / (fingerprint or target_fingerprint(target))
            self.store.mkdir(parents=True, exist_ok=True)
            about = self.store / "target.json"
            if not about.is_file():
                info = {"kind": type(target).__name__, "layers": list(target.layer_ids)}
                info.update(format=FORMAT, width=target.width, vocab_size=target.vocab_size)
                _atomic(about, lambda p: p.write_text(json.dumps(info, indent=1) + "\n"))

    @staticmethod
    def key(batch: dict[str, Tensor], i: int) -> str:
        """The digest of row i's content: its unpadded token ids (and image)."""
        n = int(batch["attention_mask"][i].sum())
        h = hashlib.blake2b(digest_size=16)
        _update(h, batch["input_ids"][i, :n])
        if "images" in batch:
            _update(h, batch["images"][i])
        return h.hexdigest()

    def _compute(self, batch: dict[str, Tensor], i: int) -> Row:
        """Row i's (features, positions, valid, greedy), computed alone at its own length."""
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i : i + 1, :n]
        ones = torch.ones_like(ids)
        if "images" in batch:
            ctx, logits, _ = self.target.features(batch["images"][i : i + 1], ids, ones)
        else:
            ctx, logits, _ = self.target.features(ids, ones)
        self.computed += 1
        parts = [ctx.features[0], ctx.positions[0], ctx.valid[0], greedy_tokens(logits, ones)[0]]
        if self.top_k:
            top = top_logprobs(logits, ones, self.top_k)
            parts += [top.ids[0].int(), top.logp[0]]  # int32 ids: half the bytes
        # storage of its own (fresh contiguous copies)
        names = (FIELDS + TOP_FIELDS)[: len(parts)]
        row = {f: t.detach().to("cpu", copy=True) for f, t in zip(names, parts, strict=True)}
        del ctx, logits
        if _TRIM is not None:
            _TRIM(0)
        return row

    def _row(self, batch: dict[str, Tensor], i: int, key: str) -> Row:
        if self.store is None:
            return self._compute(batch, i)
        path = self.store / f"{key}.safetensors"
        if path.is_file():
            t = load_file(str(path))
            have = t["top_ids"].shape[-1] if "top_ids" in t else 0
            if have >= self.top_k:  # enough soft labels (or none asked for): cut to top_k
                self.loaded += 1
                row = {f: t[f] for f in FIELDS}
                if self.top_k:
                    row.update({f: t[f][:, : self.top_k] for f in TOP_FIELDS})
                return row
            row = self._compute(batch, i)  # stored without the soft labels asked for
            row.update({f: t[f] for f in FIELDS})  # keep the stored features: runs read those
        else:
            row = self._compute(batch, i)
        _atomic(path, lambda p: save_file(row, str(p)))
        return row

    def features(self, batch: dict[str, Tensor]) -> tuple[Context, Tensor, int, TopK | None]:
        """(Context (B, P + T, F), greedy (B, T), prefix length P, the target's top-k tokens
        (B, T, k) or None without ``top_k``) of a right-padded batch."""
        keys = [self.key(batch, i) for i in range(batch["input_ids"].shape[0])]
        got: dict[str, Row] = {}
        for i, key in enumerate(keys):
            if key not in got:
                got[key] = self.rows.get(key) or self._row(batch, i, key)
        if self.store is None:
            self.rows.update(got)
        rows = [got[k] for k in keys]
        b, t = batch["input_ids"].shape
        first = rows[0]["features"]
        p = first.shape[0] - rows[0]["greedy"].shape[0]  # prefix = context rows - text rows
        dev = batch["input_ids"].device
        feats = first.new_zeros(b, p + t, first.shape[1])
        pos = torch.zeros(b, p + t, dtype=torch.long)
        valid = torch.zeros(b, p + t, dtype=torch.bool)
        greedy = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        k = self.top_k
        top_ids = torch.zeros(b, t, k, dtype=torch.long)
        top_logp = torch.zeros(b, t, k)
        for i, r in enumerate(rows):
            n, m = len(r["features"]), len(r["greedy"])
            feats[i, :n], pos[i, :n], valid[i, :n] = r["features"], r["positions"], r["valid"]
            greedy[i, :m] = r["greedy"]
            if k:
                top_ids[i, :m], top_logp[i, :m] = r["top_ids"], r["top_logp"]
        ctx = Context(feats.to(dev), pos.to(dev), valid.to(dev))
        top = TopK(top_ids.to(dev), top_logp.to(dev)) if k else None
        return ctx, greedy.to(dev), p, top


def _atomic(path: Path, write: Any) -> None:
    """Write through a temporary name in the same folder, then rename: a reader (another
    rank, a concurrent run) sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
