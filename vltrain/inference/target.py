"""One decode target: the protocol every decoding loop of vltrain drives.

A ``DecodeTarget`` is a frozen model seen the way decoding needs it. ``decoding.generate``
(greedy, beam, sampling) drives ``prefill``, ``step`` and ``reorder``; ``speculative``
(chain and tree verification with a block drafter) drives ``prefill``, ``verify``, ``select``
and ``next_positions``, and the drafter shares the target's ``embed`` and ``head``. Three
classes implement it, each directly:

- ``hf_target.HFTarget``: an HF ``*ForCausalLM`` / ``*ForConditionalGeneration`` model through
  its own forward, fed what HF ``generate`` feeds it (bit-identical logits), and
  ``vlm_target.HFVLMTarget``, the same for ``AutoModelForImageTextToText`` models (images at
  the prefill, M-RoPE positions kept per channel);
- ``native_llama.NativeTarget``: an HF Llama-family causal LM through vltrain's lean forward
  over the same weights (``native_llama.causal_lm_target`` picks native or HF);
- ``captioner_target.CaptionerTarget``: the built-in captioner, either connector.

Shapes: B rows, T prompt positions, N fed nodes, V vocabulary, W width,
F = ``len(layer_ids) * W`` features (0 without a drafter). Logits are float32.

- ``prefill(**inputs)`` -> ``(logits (B, V), cache, Context)``: runs the left-padded prompt
  (and images) once; the logits are those after the last prompt position, the ``Context`` holds
  the drafter's features of every prompt position ((B, T, F); a captioner's visual prefix
  included).
- ``step(tokens (B,), cache)`` -> ``(logits (B, V), cache)``: one token per row.
- ``verify(tokens (B, N), parents (B, N), cache, logits=True)`` -> ``(scores, cache, Context)``:
  N nodes of a tree after the cache in one forward; ``parents[b, i]`` is node i's parent among
  the N (``-1``: the cache's last token), so a chain is ``parents = [-1, 0, 1, ...]``. Each node
  sees the cache and its ancestors and sits at ``next_positions + depth``; its scores are the
  logits after its root-to-node path (B, N, V), or with ``logits=False`` the final (normed)
  hidden states (B, N, W) for a caller that applies the head itself. All N enter the cache.
- ``select(cache, index (B, M), valid (B, M) | None)`` -> cache: keeps cached positions
  ``index`` per row, in that order (a verified tree compacted to its accepted path); entries
  with ``valid`` False become padding (never attended to, not counted in ``next_positions``).
  The one verb for cache compaction.
- ``crop(cache, n)`` -> cache: the first ``n`` cached positions (exact when the dropped ones
  were a chain).
- ``reorder(cache, rows (B',))`` -> cache: rows along the batch (row i <- row ``rows[i]``;
  beam search; greedy and speculative decoding dropping their finished rows).
- ``next_positions(cache)`` -> (B,): the position of each row's next real token.
- ``embed(ids)``, ``head(hidden)``, ``head_params()`` (the head's weight and bias): the frozen
  token embedding and LM head a drafter shares; ``num_layers``, ``width``, ``vocab_size`` and
  ``layer_ids`` (the blocks whose outputs the features concatenate) size it.
- ``features(...)`` (optional; the HF, HF VLM and captioner targets): ``(Context, logits (B, T, V),
  prefix length)`` of whole training sequences, without a cache (drafter training).

Stop tokens: ``eos_token_ids`` is every id that ends a row (HF ``generate``'s list: a
generation config may name several, Qwen2-VL-Instruct's ``[151645, 151643]``), ``eos_token_id``
its first (what padding falls back to); a target with one stop id may define only
``eos_token_id`` (`stop_ids` reads either). Every loop stops a row at any of them.

Caches are each target's own (``HFCache``, ``NativeCache``, ``CaptionerCache``) and opaque to
the loops. A call may update the cache it is given in place: use the one it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


@dataclass
class Context:
    """Target features of some positions, with their positions and realness."""

    features: Tensor  # (B, S, F)
    positions: Tensor  # (B, S) long
    valid: Tensor  # (B, S) bool

    def extend(self, other: Context) -> Context:
        """Append positions (along S)."""
        return Context(
            torch.cat([self.features, other.features], 1),
            torch.cat([self.positions, other.positions], 1),
            torch.cat([self.valid, other.valid], 1),
        )


class DecodeTarget(Protocol):
    """What greedy / beam / sampled decoding and speculative decoding drive (module doc)."""

    eos_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    bos_token_id: int
    num_layers: int
    width: int
    vocab_size: int
    layer_ids: list[int]

    def prefill(self, **inputs: Any) -> tuple[Tensor, Any, Context]: ...

    def step(self, tokens: Tensor, cache: Any) -> tuple[Tensor, Any]: ...

    def verify(
        self, tokens: Tensor, parents: Tensor, cache: Any, logits: bool = True
    ) -> tuple[Tensor, Any, Context]: ...

    def select(self, cache: Any, index: Tensor, valid: Tensor | None = None) -> Any: ...

    def crop(self, cache: Any, n: int) -> Any: ...

    def reorder(self, cache: Any, rows: Tensor) -> Any: ...

    def next_positions(self, cache: Any) -> Tensor: ...

    def embed(self, ids: Tensor) -> Tensor: ...

    def head(self, hidden: Tensor) -> Tensor: ...

    def head_params(self) -> tuple[Tensor, Tensor | None]: ...


class StopIds:
    """``eos_token_ids`` (every id that ends a row) with ``eos_token_id`` as its first; setting
    ``eos_token_id`` makes it the only one."""

    eos_token_ids: tuple[int, ...]

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @eos_token_id.setter
    def eos_token_id(self, value: int) -> None:
        self.eos_token_ids = (int(value),)


def stop_ids(target: Any) -> tuple[int, ...]:
    """The ids that end a row of `target`: its ``eos_token_ids``, else its one ``eos_token_id``."""
    ids = tuple(getattr(target, "eos_token_ids", ()) or ())
    return ids or (int(target.eos_token_id),)
