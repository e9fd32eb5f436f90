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

The contrastive model's two GradCache steps close the module: `dual_encoder_grad_cache` for
image-caption batches and `pair_grad_cache` for query/positive batches; their chunks come from
`vltrain.data.batches` (`split_rows`, `length_sorted_chunks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.data.batches import ImageTextBatch, PairBatch, length_sorted_chunks, split_rows
from vltrain.data.pairs import ROLES
from vltrain.models.contrastive import TEXT_SIDES

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
    `loss_fn` receives one list, a (rows, E) tensor per side, and returns (loss, metrics) (e.g.
    ``lambda views: loss(*views)``); it may hold
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
    model: nn.Module, batch: ImageTextBatch, chunk: int, scale: float
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


def pair_grad_cache(
    model: nn.Module, batch: PairBatch, chunk: int, scale: float
) -> tuple[Tensor, dict[str, Any]]:
    """GradCache over the query, positive and negative sides of a pair batch (each chunked by
    `chunk` rows, negatives too: memory is one chunk's graph, not batch x K; text sides
    length-sorted for towers that ignore trailing padding). `model` is plain, as above."""
    enc, loss = model.encoder, model.loss
    by_length = getattr(enc, "ignores_trailing_padding", False)
    encoders: list[Callable[..., Tensor]] = []
    chunks: list[list[Any]] = []
    orders: list[Tensor | None] = []
    for name in ROLES:  # query, positive, negatives: the order the loss takes them
        side = batch.get(name)
        if side is None:
            continue
        kind, inputs = side["modality"], side["inputs"]
        order = None
        if kind == "text":  # (ids (B, T), mask (B, T)), passed as two arguments per chunk
            encoders.append(enc.encode_text)
            if by_length:
                parts, order = length_sorted_chunks(tuple(inputs), chunk)
            else:
                parts = split_rows(tuple(inputs), chunk)
        else:  # pixels, or a VLM prompt dict (flattened patches split by image)
            encoders.append(enc.encode_image)
            parts = split_rows(inputs, chunk)
        chunks.append(parts)
        orders.append(order)

    def loss_fn(e: list[Tensor]) -> tuple[Tensor, dict[str, Any]]:
        return loss(e[0], e[1], e[2] if len(e) > 2 else None)

    return grad_cache(encoders, chunks, loss_fn, scale, orders=orders)
