"""GradCache (Gao et al. 2021): contrastive batches far larger than activation memory allows.

A contrastive loss couples every pair in the batch, so the batch cannot simply be split into
accumulation steps. GradCache splits the *encoding* instead:

1. encode every chunk without building a graph (saving each chunk's RNG state first);
2. compute the loss over the whole batch from those embeddings (as leaves) and backpropagate
   it to them -- this also gives the loss's own parameters (temperature, bias) their gradient,
   and runs the cross-rank gathers of the loss exactly as the uncached step would;
3. re-encode each chunk with a graph, RNG replayed so dropout draws the same masks, and
   backpropagate the cached embedding gradient into the encoder.

Peak activation memory is that of one chunk; the cost is one extra no-grad forward of every
chunk but the last, whose graph from step 1 is kept and used directly in step 3.

Under DDP the chunks run on the *plain* module (a text-only chunk would leave the vision
tower "unused" in DDP's eyes, and the loss's parameters get their gradient outside any DDP
forward); the caller then asks the parallel layer to reduce the accumulated gradients once
(``ParallelModel.reduce_gradients``, a no-op on accumulation micro-steps). That is exactly
DDP's arithmetic: local gradients summed over micro-steps, averaged over ranks once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

LossFn = Callable[[list[Tensor]], tuple[Tensor, dict[str, Any]]]


@dataclass
class RngState:
    """The CPU and (for CUDA inputs) CUDA generator states before one chunk's forward."""

    cpu: Tensor
    cuda: list[tuple[int, Tensor]]

    @classmethod
    def capture(cls, devices: Iterable[int]) -> RngState:
        return cls(torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices])

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda:
            torch.cuda.set_rng_state(state, d)


def _cuda_devices(x: Any) -> list[int]:
    """CUDA device indices of the tensors in a (nested) chunk."""
    if torch.is_tensor(x):
        return [x.device.index or 0] if x.is_cuda else []
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (list, tuple)) else []
    return sorted({d for item in items for d in _cuda_devices(item)})


def _rows(x: Any) -> set[int]:
    """Leading sizes of the tensors in a (nested) input."""
    if torch.is_tensor(x):
        return {x.shape[0]}
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (list, tuple)) else []
    return {n for item in items for n in _rows(item)}


def _split_patch_grid(x: Mapping[str, Any], chunk: int) -> list[dict[str, Any]]:
    """Qwen-VL style inputs: `pixel_values` holds every image's patches back to back
    (sum of t*h*w over images, D); split it by the images' patch counts, the rest by row."""
    counts = x["image_grid_thw"].prod(-1)  # (B,) patches per image
    rest = {k: v for k, v in x.items() if k != "pixel_values"}
    sizes = [int(c.sum()) for c in counts.split(chunk)]
    pixels = x["pixel_values"].split(sizes)
    return [
        {**part, "pixel_values": px}
        for part, px in zip(split_rows(rest, chunk), pixels, strict=True)
    ]


def split_rows(x: Any, chunk: int) -> list[Any]:
    """Split a tensor, or a tuple/dict of tensors with the same rows, into row chunks.

    Dict entries that are not tensors (nor containers of them) are copied into every chunk.
    Tensors whose first dimension is not the batch (e.g. Qwen-VL's flattened patches) cannot
    be chunked by row: that raises instead of silently mis-splitting.
    """
    if chunk < 1:
        raise ValueError(f"GradCache chunk size must be >= 1, got {chunk}")
    if isinstance(x, Mapping) and "image_grid_thw" in x and "pixel_values" in x:
        return _split_patch_grid(x, chunk)
    if len(_rows(x)) > 1:
        raise ValueError(
            f"GradCache: the inputs to chunk have different leading sizes {sorted(_rows(x))}, "
            "so they cannot be split by row (inputs with flattened per-image patches are not "
            "supported); set objective.grad_cache_chunk=0 for this model"
        )
    if torch.is_tensor(x):
        return list(x.split(chunk))
    if isinstance(x, Mapping):  # non-tensor entries (e.g. a "modality" string) go to every chunk
        parts = {
            k: split_rows(v, chunk)
            for k, v in x.items()
            if torch.is_tensor(v) or isinstance(v, (Mapping, tuple, list))
        }
        n = len(next(iter(parts.values())))
        return [{k: parts[k][i] if k in parts else v for k, v in x.items()} for i in range(n)]
    if isinstance(x, (tuple, list)):
        return list(zip(*(split_rows(v, chunk) for v in x), strict=True))
    raise TypeError(
        f"split_rows: cannot split a {type(x).__name__}; pass tensors, tuples or dicts of tensors"
    )


def length_sorted_chunks(
    x: Mapping[str, Tensor] | tuple[Tensor, ...], chunk: int, mask_key: str | int = 1
) -> tuple[list[Any], Tensor]:
    """Right-padded token inputs in chunks of `chunk` rows, longest rows first, each chunk cut
    to its own longest row; also the row order (pass it to `grad_cache` as ``orders[s]``).

    GradCache may group the batch's rows into chunks any way it likes (the loss sees the whole
    batch), so grouping rows of similar length drops most of the padding work: with lengths
    spread like 8-20 words, about a quarter of the token positions. `x` is a dict (mask under
    "attention_mask") or a tuple (mask at index `mask_key`); every 2-D tensor as wide as the mask
    is cut. Only for encoders that ignore trailing padding (not ones that pool the last
    position of a fixed-length input, like SigLIP's text tower).
    """
    mask = x["attention_mask"] if isinstance(x, Mapping) else x[mask_key]  # (B, T)
    if mask.dim() != 2 or bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("length_sorted_chunks needs a right-padded (B, T) attention mask")
    lengths = mask.sum(1)  # (B,)
    # One chunk: keep the batch order (then it is exactly the uncached forward, dropout too).
    if mask.shape[0] <= chunk:
        order = torch.arange(mask.shape[0], device=mask.device)  # (B,)
    else:
        order = lengths.argsort(descending=True, stable=True)  # (B,)
    width = mask.shape[1]

    def rows(v: Any) -> Any:
        return v[order] if torch.is_tensor(v) else v

    sorted_x = (
        {k: rows(v) for k, v in x.items()}
        if isinstance(x, Mapping)
        else x.__class__(rows(v) for v in x)
    )
    out = []
    for c, n in zip(split_rows(sorted_x, chunk), lengths[order].split(chunk), strict=True):
        keep = max(int(n.max()), 1)

        def cut(v: Any, keep: int = keep) -> Any:
            return v[:, :keep] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == width else v

        out.append(
            {k: cut(v) for k, v in c.items()} if isinstance(c, Mapping) else tuple(map(cut, c))
        )
    return out, order


#: a contrastive batch's text sides, (ids key, mask key): captions, hard negatives, and second
#: captions (objective.caption_contrast)
TEXT_SIDES = (
    ("input_ids", "attention_mask"),
    ("neg_ids", "neg_mask"),
    ("pair_ids", "pair_mask"),
)


def encode_text_sets(encoder: nn.Module, sets: Sequence[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """``encoder.encode_text(ids, mask)`` of each right-padded (ids, mask) set, e.g. a batch's
    captions, second captions and hard negatives, in that order.

    An encoder that ignores trailing padding (``ignores_trailing_padding``) gets all rows in
    one length-sorted pass, in chunks as large as the first set and each cut to its longest
    row (`length_sorted_chunks`): with captions of 8-20 tokens that drops about a third of the
    token positions padding each set to its own longest row computes (the quickstart's three
    sets of 128: text forward + backward 0.17 -> 0.14 s, AMD EPYC). The embeddings are the
    per-set ones up to float rounding. Other encoders, and any while text dropout draws masks
    (``text_dropout_active``: the draws would follow the sorted rows), get one call per set.
    """
    grouped = getattr(encoder, "ignores_trailing_padding", False)
    if len(sets) < 2 or not grouped or getattr(encoder, "text_dropout_active", True):
        return [encoder.encode_text(ids, mask) for ids, mask in sets]
    width = max(ids.shape[1] for ids, _ in sets)

    def widen(t: Tensor) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))  # (B, width), zeros after

    ids = torch.cat([widen(i) for i, _ in sets])  # (N, width)
    mask = torch.cat([widen(m) for _, m in sets])  # (N, width)
    chunks, order = length_sorted_chunks((ids, mask), sets[0][0].shape[0])
    emb = torch.cat([encoder.encode_text(*c) for c in chunks])  # (N, E), sorted rows
    emb = emb[order.argsort()]  # (N, E), the input order
    return list(emb.split([i.shape[0] for i, _ in sets]))


def _call(encode: Callable[..., Tensor], chunk: Any) -> Tensor:
    return encode(*chunk) if isinstance(chunk, tuple) else encode(chunk)


def grad_cache(
    encoders: Sequence[Callable[..., Tensor]],
    chunks: Sequence[Sequence[Any]],
    loss_fn: LossFn,
    scale: float = 1.0,
    replay_rng: bool = True,
    orders: Sequence[Tensor | None] | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """Backpropagate ``loss_fn(embeddings) * scale`` through chunked encoders; return the loss.

    `encoders[s]` maps one chunk of side `s` (a tensor, a dict, or a tuple unpacked as
    arguments) to embeddings (rows, E); `chunks[s]` lists side s's chunks in row order.
    `loss_fn` receives one (rows, E) tensor per side and returns (loss, metrics); it may hold
    parameters and gather across ranks. Gradients accumulate into ``.grad`` like ``backward``.
    `replay_rng=False` exists for tests: without it dropout differs between the two passes.
    `orders[s]` (from `length_sorted_chunks`): side s's chunks hold rows ``orders[s]`` of the
    batch in that order; `loss_fn` still receives the rows in batch order.
    """
    if len(encoders) != len(chunks):
        raise ValueError(f"grad_cache: {len(encoders)} encoders but {len(chunks)} chunk lists")
    embs: list[list[Tensor]] = []
    states: list[list[RngState]] = []
    # The very last chunk is encoded WITH its graph and backpropagated from that graph, not
    # re-encoded: one forward less per step, and no more memory (the peak is one chunk's
    # graph either way; this one is merely held while the loss runs).
    live: Tensor | None = None
    last_side = len(chunks) - 1
    with torch.no_grad():
        for s, (encode, side) in enumerate(zip(encoders, chunks, strict=True)):
            embs.append([])
            states.append([])
            for i, c in enumerate(side):
                states[-1].append(RngState.capture(_cuda_devices(c)))
                if s == last_side and i == len(side) - 1:
                    with torch.enable_grad():
                        live = _call(encode, c)  # (rows, E), graph kept
                    embs[-1].append(live.detach())
                else:
                    embs[-1].append(_call(encode, c))  # (rows, E)
    end_state = RngState.capture(sorted({d for st in states for x in st for d, _ in x.cuda}))
    leaves = [torch.cat(e).detach().requires_grad_(True) for e in embs]  # (N_s, E) per side
    sizes = [[e.shape[0] for e in side] for side in embs]
    del embs
    views = [
        leaf if orders is None or orders[s] is None else leaf[orders[s].argsort()]
        for s, leaf in enumerate(leaves)
    ]  # batch order for the loss
    with torch.enable_grad():
        loss, metrics = loss_fn(views)
        (loss * scale).backward()
    del views
    for s in range(len(chunks)):
        if leaves[s].grad is None:
            raise ValueError(
                f"grad_cache: loss_fn did not use side {s}'s embeddings; drop "
                "that side instead of encoding it for nothing"
            )
    for s in reversed(range(len(chunks))):  # the live chunk first: its graph is freed at once
        grads = leaves[s].grad.split(sizes[s])
        for i in reversed(range(len(chunks[s]))):
            g = grads[i]
            if live is not None and s == last_side and i == len(chunks[s]) - 1:
                if live.requires_grad:
                    live.backward(g.to(live.dtype))
                live = None
                continue
            if replay_rng:
                states[s][i].restore()
            with torch.enable_grad():
                out = _call(encoders[s], chunks[s][i])  # (rows, E), with graph this time
                if out.requires_grad:  # a side with no trainable parameters has nothing to do
                    out.backward(g.to(out.dtype))
    if replay_rng:  # leave the generators where one pass over the chunks left them
        end_state.restore()
    return loss.detach(), metrics


def dual_encoder_grad_cache(
    model: nn.Module, batch: dict[str, Any], chunk: int, scale: float
) -> tuple[Tensor, dict[str, Any]]:
    """GradCache step of a contrastive model (``.encoder`` dual encoder + ``.loss``).

    Sides: images, texts, and (when the batch has them) hard-negative texts and second captions
    (``pair_ids``, for ``objective.caption_contrast``), each chunked by
    `chunk` rows; text chunks are length-sorted (`length_sorted_chunks`) for encoders that
    declare ``ignores_trailing_padding``. `model` is the plain module (never a DDP wrapper):
    the caller reduces gradients across ranks afterwards.
    """
    enc, loss = model.encoder, model.loss
    # Text chunks group rows of similar length when the tower ignores trailing padding.
    by_length = getattr(enc, "ignores_trailing_padding", False)
    encoders: list[Callable[..., Tensor]] = [enc.encode_image]
    chunks: list[list[Any]] = [split_rows(batch["images"], chunk)]
    orders: list[Tensor | None] = [None]
    sides = ["images"]
    for ids, mask in TEXT_SIDES:
        if batch.get(ids) is None:
            continue
        sides.append(ids)
        encoders.append(enc.encode_text)
        if by_length:
            side, order = length_sorted_chunks((batch[ids], batch[mask]), chunk)
        else:
            side, order = split_rows((batch[ids], batch[mask]), chunk), None
        chunks.append(side)
        orders.append(order)

    def loss_fn(e: list[Tensor]) -> tuple[Tensor, dict[str, Any]]:
        got = dict(zip(sides, e, strict=True))
        if "pair_ids" in got:
            return loss(got["images"], got["input_ids"], got.get("neg_ids"), pairs=got["pair_ids"])
        return loss(got["images"], got["input_ids"], got.get("neg_ids"))

    return grad_cache(encoders, chunks, loss_fn, scale, orders=orders)
