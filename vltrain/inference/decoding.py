"""Batched greedy, beam and sampling decoding with a KV cache, matching HF `generate`.

Every strategy drives a `DecodeTarget` (`vltrain.inference.target`; the HF, native and
captioner targets implement it): `prefill` consumes the prompt (and images) once and returns the
next-token logits plus a cache, `step` feeds one token per row, and `reorder` selects/repeats
rows of the cache. Speculative decoding (`vltrain.inference.speculative`) drives the same
protocol's `verify` and `select`.

Semantics follow `transformers` 5.x `GenerationMixin` exactly (tests compare token for token):

- A row ends at any of the target's stop ids (`stop_ids`: HF's list of EOS ids; one for most
  models), and min-new-tokens bans them all.
- Greedy/sampling: logits -> no-repeat-ngram ban -> min-new-tokens EOS ban -> temperature ->
  top-k -> top-p -> argmax or multinomial. Finished rows emit `pad_token_id`. Greedy stops
  computing a row once it has emitted EOS (the cache drops it through `reorder`); sampling
  keeps the whole batch so that the random draws are HF's.
- Beam search: `log_softmax` then the same bans, `max(2, 1 + #stop ids) * num_beams`
  candidates per input, a finished hypothesis scores
  `sum(logprobs) / (generated_len ** length_penalty)` where `generated_len` counts the new
  tokens including EOS, and `early_stopping` True/False/"never" picks HF's stopping heuristic.
- `no_repeat_ngram_size` sees the prompt as HF does: the n-grams of `inputs["input_ids"]`
  (padding and image placeholder tokens included) are banned too.

Log-probabilities returned per token are always under the model's raw policy,
`log_softmax(logits)` at temperature 1 with no filtering or bans: the `log pi(token)` that RL
(REINFORCE / PPO ratios) needs, whatever temperature / top-k / top-p drew the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from vltrain.inference.target import DecodeTarget, stop_ids

Strategy = Literal["greedy", "beam", "sample"]
_NEG = -1.0e9  # HF's "impossible" score for beams; kept identical so tie-breaking matches


@dataclass
class GenerationOutput:
    """Result of `generate`; rows are grouped per input: input b owns rows [b*n, (b+1)*n).

    sequences: (B*n, L) new tokens only, EOS included, right-padded with `pad_token_id`.
    lengths: (B*n,) number of real new tokens per row (EOS counted).
    token_logprobs: (B*n, L) raw-policy log-prob of each token, 0.0 at padding.
    scores: (B*n,) beam: HF's length-penalised beam score; greedy/sample: sum of token_logprobs.
    """

    sequences: Tensor
    lengths: Tensor
    token_logprobs: Tensor
    scores: Tensor


# ----------------------------------------------------------------------------- logits processing


def ban_repeated_ngrams(history: Tensor, scores: Tensor, ngram_size: int) -> Tensor:
    """Set to -inf every token that would repeat an n-gram already in `history` (N, T).

    Same rule as HF's `NoRepeatNGramLogitsProcessor`: the last `n-1` tokens form a prefix; each
    earlier window starting with that prefix bans its last token.
    """
    cur_len = history.shape[1]
    if ngram_size <= 0 or cur_len < ngram_size:
        return scores
    prefix = history[:, cur_len + 1 - ngram_size :]  # (N, n-1)
    windows = history.unfold(1, ngram_size, 1)  # (N, W, n)
    matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1)  # (N, W)
    vocab = scores.shape[-1]
    banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
    spare = torch.full_like(windows[..., -1], vocab)
    banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), spare), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


def top_k_filter(scores: Tensor, top_k: int) -> Tensor:
    """Keep the `top_k` highest scores per row (ties with the k-th kept), the rest -> -inf."""
    if top_k <= 0:
        return scores
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]  # (N, 1)
    return scores.masked_fill(scores < kth, -float("inf"))


def top_p_filter(scores: Tensor, top_p: float, min_tokens_to_keep: int = 1) -> Tensor:
    """Nucleus filter: keep the smallest top set whose probability reaches `top_p`.

    HF's rule: sort ascending, drop tokens whose cumulative probability is <= 1 - top_p, always
    keep the `min_tokens_to_keep` most likely.
    """
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - top_p)
    drop_sorted[..., -min_tokens_to_keep:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, -float("inf"))


def _ban_eos(scores: Tensor, stops: Tensor, step: int, min_new_tokens: int) -> Tensor:
    """Every stop id banned before `min_new_tokens` (HF's MinNewTokensLengthLogitsProcessor)."""
    if step < min_new_tokens:
        scores = scores.clone()
        scores[:, stops] = -float("inf")
    return scores


def _stops(target: DecodeTarget, device: torch.device) -> Tensor:
    """The target's stop ids (`stop_ids`) as a tensor for ``isin``."""
    return torch.tensor(stop_ids(target), dtype=torch.long, device=device)


# ----------------------------------------------------------------------------- entry point


def generate(
    target: DecodeTarget,
    inputs: dict[str, Any],
    strategy: Strategy = "greedy",
    max_new_tokens: int = 20,
    min_new_tokens: int = 0,
    num_beams: int = 5,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    no_repeat_ngram_size: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    num_return_sequences: int = 1,
) -> GenerationOutput:
    """Decode a batch of inputs with `target` by greedy, beam search or sampling.

    `inputs` are passed to `target.prefill` unchanged; `inputs["input_ids"]` (if present) is the
    prompt history that `no_repeat_ngram_size` sees. Sampling draws from `generator` (the global
    torch RNG when None, which reproduces HF `generate(do_sample=True)` under the same seed).
    `num_return_sequences` = samples per input (sample) or best hypotheses per input (beam).
    """
    cfg = DecodeSettings(
        strategy,
        max_new_tokens,
        min_new_tokens,
        num_beams,
        length_penalty,
        early_stopping,
        no_repeat_ngram_size,
        temperature,
        top_k,
        top_p,
        num_return_sequences,
    )
    cfg.validate()
    with torch.no_grad():
        if strategy == "beam":
            return _beam_search(target, inputs, cfg)
        return _greedy_or_sample(target, inputs, cfg, generator)


@dataclass(frozen=True)
class DecodeSettings:
    """The arguments of `generate` (minus target, inputs and generator), validated once."""

    strategy: str
    max_new_tokens: int
    min_new_tokens: int
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    no_repeat_ngram_size: int
    temperature: float
    top_k: int
    top_p: float
    num_return_sequences: int

    def validate(self) -> None:
        """Raise ValueError naming the offending argument and its valid range."""
        s, n, beams = self.strategy, self.num_return_sequences, self.num_beams
        max_new, min_new = self.max_new_tokens, self.min_new_tokens
        if s not in ("greedy", "beam", "sample"):
            raise ValueError(f"strategy={s!r} is unknown; use 'greedy', 'beam' or 'sample'.")
        if max_new < 1:
            raise ValueError(f"max_new_tokens={max_new} must be >= 1.")
        if not 0 <= min_new <= max_new:
            raise ValueError(f"min_new_tokens={min_new} must be in [0, max_new_tokens={max_new}].")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping={self.early_stopping!r} must be True, False or 'never' (as in HF)."
            )
        if s == "beam" and not 1 <= n <= beams:
            raise ValueError(f"num_return_sequences={n} must be in [1, num_beams={beams}].")
        if n < 1 or (s == "greedy" and n != 1):
            raise ValueError(
                f"num_return_sequences={n}: greedy returns exactly one sequence per input; use "
                "strategy='sample' or 'beam' for several."
            )
        t, k, p = self.temperature, self.top_k, self.top_p
        if s == "sample" and not (t > 0 and k >= 0 and 0 < p <= 1):
            raise ValueError(
                f"need temperature > 0, top_k >= 0, 0 < top_p <= 1; got temperature={t}, "
                f"top_k={k}, top_p={p}."
            )


def _prompt_history(inputs: dict[str, Any], batch: int, device: torch.device) -> Tensor:
    ids = inputs.get("input_ids")
    if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[0] == batch:
        return ids.to(device=device, dtype=torch.long)
    return torch.zeros((batch, 0), dtype=torch.long, device=device)


def _expand(target: DecodeTarget, logits: Tensor, cache: Any, hist: Tensor, n: int):
    """Repeat each input's prefill state n times (rows b*n .. b*n+n-1 belong to input b)."""
    if n == 1:
        return logits, cache, hist
    index = torch.arange(logits.shape[0], device=logits.device).repeat_interleave(n)
    return logits[index], target.reorder(cache, index), hist[index]


# ----------------------------------------------------------------------------- greedy / sample


def _greedy_or_sample(
    target: DecodeTarget, inputs: dict[str, Any], cfg: DecodeSettings, gen: torch.Generator | None
) -> GenerationOutput:
    """Greedy drops a row from the batch once it emits EOS (``target.reorder`` keeps the
    live rows), so a batch costs the sum of its rows' lengths, not its longest times its size;
    sampling keeps every row to the end so the generator draws what HF's does."""
    max_new, min_new, ngram = cfg.max_new_tokens, cfg.min_new_tokens, cfg.no_repeat_ngram_size
    sample, temperature = cfg.strategy == "sample", cfg.temperature
    logits, cache, _ = target.prefill(**inputs)  # (B, V)
    hist = _prompt_history(inputs, logits.shape[0], logits.device)
    logits, cache, hist = _expand(target, logits, cache, hist, cfg.num_return_sequences)  # (N, V)
    stops, pad = _stops(target, logits.device), target.pad_token_id
    n = logits.shape[0]
    live = torch.arange(n, device=logits.device)  # the rows the cache holds, in its order
    unfinished = torch.ones(n, dtype=torch.bool, device=logits.device)
    toks: list[Tensor] = []
    lps: list[Tensor] = []
    for t in range(max_new):
        if t > 0:
            logits, cache = target.step(toks[-1][live], cache)  # (L, V): the live rows
        logits = logits.float()
        scores = ban_repeated_ngrams(hist[live], logits, ngram) if ngram > 0 else logits
        scores = _ban_eos(scores, stops, t, min_new)
        if sample:
            scores = scores / temperature if temperature != 1.0 else scores
            scores = top_p_filter(top_k_filter(scores, cfg.top_k), cfg.top_p)
            probs = torch.softmax(scores, dim=-1)
            picked = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # (L,)
        else:
            picked = scores.argmax(dim=-1)
        raw_lp = torch.log_softmax(logits, dim=-1).gather(1, picked[:, None]).squeeze(1)
        on = unfinished[live]
        nxt = torch.full((n,), pad, dtype=picked.dtype, device=picked.device)
        nxt[live] = torch.where(on, picked, torch.full_like(picked, pad))
        lp = torch.zeros(n, dtype=raw_lp.dtype, device=raw_lp.device)
        lp[live] = torch.where(on, raw_lp, torch.zeros_like(raw_lp))
        lps.append(lp)
        toks.append(nxt)
        if ngram > 0:
            hist = torch.cat([hist, nxt[:, None]], dim=1)
        unfinished = unfinished & ~torch.isin(nxt, stops)
        if not bool(unfinished.any()):
            break
        keep = unfinished[live]
        if not sample and not bool(keep.all()):
            cache = target.reorder(cache, keep.nonzero()[:, 0])
            live = live[keep]
    seqs = torch.stack(toks, dim=1)  # (N, L)
    token_lp = torch.stack(lps, dim=1)  # (N, L)
    lengths = _lengths(seqs, stops)
    return GenerationOutput(seqs, lengths, token_lp, token_lp.sum(dim=1))


def _lengths(seqs: Tensor, stops: Tensor) -> Tensor:
    """Tokens up to and including the first stop id, else the full width."""
    is_eos = torch.isin(seqs, stops)
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, seqs.shape[1])
    return first.long()


# ----------------------------------------------------------------------------- beam search


@dataclass
class _Beams:
    """Beam state, all (B, K, ...). `seqs` holds prompt history + new tokens (HF's layout)."""

    seqs: Tensor  # (B, K, P + max_new)
    tok_lp: Tensor  # (B, K, max_new)
    scores: Tensor  # (B, K)
    lengths: Tensor  # (B, K) new tokens so far (only meaningful for finished hypotheses)

    def take(self, index: Tensor) -> _Beams:
        """Rows (inputs) selected by `index` (bool mask or indices)."""
        return _Beams(self.seqs[index], self.tok_lp[index], self.scores[index], self.lengths[index])

    def put(self, index: Tensor, other: _Beams) -> None:
        """Write `other` into rows `index` (in place)."""
        self.seqs[index], self.tok_lp[index] = other.seqs, other.tok_lp
        self.scores[index], self.lengths[index] = other.scores, other.lengths


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """Gather along dim 1 of (B, K, ...) with index (B, K')."""
    while index.dim() < x.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(x, index, dim=1)


def _beam_search(
    target: DecodeTarget, inputs: dict[str, Any], cfg: DecodeSettings
) -> GenerationOutput:
    """HF beam search, except that inputs whose finished set can no longer change are dropped
    from the batch (HF keeps computing them); their output is unaffected, the work is saved."""
    max_new, min_new, ngram = cfg.max_new_tokens, cfg.min_new_tokens, cfg.no_repeat_ngram_size
    logits, cache, _ = target.prefill(**inputs)  # (B, V)
    batch, device, k = logits.shape[0], logits.device, cfg.num_beams
    hist = _prompt_history(inputs, batch, device)
    logits, cache, hist = _expand(target, logits, cache, hist, k)  # (B*K, V)
    plen = hist.shape[1]
    stops = _stops(target, device)
    run, fin = _init_beams(hist.view(batch, k, plen), max_new, target.pad_token_id)
    final = _Beams(*(x.clone() for x in (fin.seqs, fin.tok_lp, fin.scores, fin.lengths)))
    is_fin = torch.zeros((batch, k), dtype=torch.bool, device=device)
    improvable = torch.ones((batch, 1), dtype=torch.bool, device=device)
    active = torch.arange(batch, device=device)  # inputs still being decoded
    for t in range(max_new):
        if t > 0:
            logits, cache = target.step(run.seqs[:, :, plen + t - 1].reshape(-1), cache)
        lp = torch.log_softmax(logits.float(), dim=-1)  # (A*K, V)
        if ngram > 0:
            lp = ban_repeated_ngrams(run.seqs[:, :, : plen + t].flatten(0, 1), lp, ngram)
        lp = _ban_eos(lp, stops, t, min_new)
        cand, src, hits = _top_candidates(run, lp, t, plen, max_new, stops)
        run, rows = _next_running(cand, src, hits, k)  # rows: (A, K) cache rows to keep
        fin, is_fin = _update_finished(fin, is_fin, cand, hits, improvable, t, cfg)
        improvable = _still_improvable(improvable, run.scores, fin.scores, is_fin, t + 1, cfg)
        # An input is frozen once HF would add nothing more to its finished set.
        done = ~improvable[:, 0] | (is_fin.all(dim=-1) & (cfg.early_stopping is True))
        if bool(done.all()) or bool(hits.all()) or t + 1 == max_new:
            break
        if bool(done.any()):
            final.put(active[done], fin.take(done))
            keep = ~done
            active, run, fin, rows = active[keep], run.take(keep), fin.take(keep), rows[keep]
            is_fin, improvable = is_fin[keep], improvable[keep]
        cache = target.reorder(cache, rows.reshape(-1))
    final.put(active, fin)
    return _beam_output(final, plen, cfg.num_return_sequences, target.pad_token_id)


def _init_beams(prompt: Tensor, max_new: int, pad: int) -> tuple[_Beams, _Beams]:
    """Running and finished beams for prompt history (B, K, P); only beam 0 starts alive."""
    batch, k, plen = prompt.shape
    seqs = torch.full((batch, k, plen + max_new), pad, dtype=torch.long, device=prompt.device)
    seqs[:, :, :plen] = prompt
    scores = torch.zeros((batch, k), device=prompt.device)
    scores[:, 1:] = _NEG  # only beam 0 expands at step 0, so beams don't duplicate
    tok_lp = torch.zeros((batch, k, max_new), device=prompt.device)
    lens = torch.zeros((batch, k), dtype=torch.long, device=prompt.device)
    run = _Beams(seqs, tok_lp, scores, lens)
    fin = _Beams(seqs.clone(), tok_lp.clone(), torch.full_like(scores, _NEG), lens.clone())
    return run, fin


def _top_candidates(run: _Beams, lp: Tensor, t: int, plen: int, max_new: int, stops: Tensor):
    """Top C = max(2, 1 + #stop ids) * K continuations over all K beams x V tokens (HF
    `_get_top_k_continuations`: enough that K stay unfinished if the best all stop)."""
    batch, k = run.scores.shape
    vocab = lp.shape[-1]
    step_lp = lp.view(batch, k * vocab)  # (B, K*V) this step's log-probs
    acc = (lp.view(batch, k, vocab) + run.scores[:, :, None]).view(batch, k * vocab)
    top_scores, top_idx = torch.topk(acc, max(2, 1 + stops.numel()) * k)  # (B, C)
    src = top_idx // vocab  # source beam
    tok = top_idx % vocab
    seqs = _gather(run.seqs, src)
    seqs[:, :, plen + t] = tok
    tok_lp = _gather(run.tok_lp, src)
    tok_lp[:, :, t] = step_lp.gather(1, top_idx)
    lengths = torch.full_like(src, t + 1)
    hits = torch.isin(tok, stops) | (t + 1 >= max_new)  # (B, C) a stop id or max length
    return _Beams(seqs, tok_lp, top_scores, lengths), src, hits


def _next_running(cand: _Beams, src: Tensor, hits: Tensor, k: int) -> tuple[_Beams, Tensor]:
    """Best K unfinished candidates continue; returns them and the (A, K) cache rows to gather."""
    masked = cand.scores + hits.to(torch.float32) * _NEG
    keep = torch.topk(masked, k=k)[1]  # (B, K)
    run = _Beams(
        _gather(cand.seqs, keep),
        _gather(cand.tok_lp, keep),
        _gather(masked, keep),
        _gather(cand.lengths, keep),
    )
    offset = torch.arange(src.shape[0], device=src.device)[:, None] * k
    return run, _gather(src, keep) + offset


def _update_finished(
    fin: _Beams,
    is_fin: Tensor,
    cand: _Beams,
    hits: Tensor,
    improvable: Tensor,
    t: int,
    cfg: DecodeSettings,
) -> tuple[_Beams, Tensor]:
    """Merge newly finished top-K candidates into the K best finished hypotheses (HF rules)."""
    batch, k = fin.scores.shape
    top_mask = torch.zeros(cand.scores.shape[1], dtype=torch.bool, device=hits.device)
    top_mask[:k] = True  # only the top K candidates may finish; the rest are backups
    just_done = hits & top_mask[None, :]
    s = cand.scores / ((t + 1) ** cfg.length_penalty)  # generated length incl. EOS
    full = torch.all(is_fin, dim=-1, keepdim=True) & (cfg.early_stopping is True)
    s = s + full.to(torch.float32) * _NEG
    s = s + (~improvable).to(torch.float32) * _NEG
    s = s + (~just_done) * _NEG
    pairs = ((fin.seqs, cand.seqs), (fin.tok_lp, cand.tok_lp), (fin.scores, s))
    merged = _Beams(
        *(torch.cat(p, dim=1) for p in pairs), torch.cat([fin.lengths, cand.lengths], 1)
    )
    best = torch.topk(merged.scores, k=k)[1]
    new_fin = _Beams(
        *(_gather(x, best) for x in (merged.seqs, merged.tok_lp, merged.scores, merged.lengths))
    )
    return new_fin, _gather(torch.cat([is_fin, just_done], dim=1), best)


def _still_improvable(
    improvable: Tensor,
    run_scores: Tensor,
    fin_scores: Tensor,
    is_fin: Tensor,
    gen_len: int,
    cfg: DecodeSettings,
) -> Tensor:
    """HF `_check_early_stop_heuristic`: can the best running beam still beat the worst finished?"""
    lp = cfg.length_penalty
    best_len = cfg.max_new_tokens if cfg.early_stopping == "never" and lp > 0.0 else gen_len
    best_running = run_scores[:, :1] / (best_len**lp)
    worst_fin = torch.where(is_fin, torch.min(fin_scores, dim=1, keepdim=True)[0], _NEG)
    return improvable & torch.any(best_running > worst_fin, dim=-1, keepdim=True)


def _beam_output(fin: _Beams, plen: int, n: int, pad: int) -> GenerationOutput:
    batch, k = fin.scores.shape
    lengths = fin.lengths[:, :n].reshape(-1)  # (B*n,)
    width = int(lengths.max())
    seqs = fin.seqs[:, :n, plen : plen + width].reshape(batch * n, width)
    tok_lp = fin.tok_lp[:, :n, :width].reshape(batch * n, width)
    valid = torch.arange(width, device=seqs.device)[None, :] < lengths[:, None]
    seqs = seqs.masked_fill(~valid, pad)
    tok_lp = tok_lp.masked_fill(~valid, 0.0)
    return GenerationOutput(seqs, lengths, tok_lp, fin.scores[:, :n].reshape(-1))


def rollouts(
    policy: torch.nn.Module,
    target: DecodeTarget,
    inputs: dict[str, Any],
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    greedy: bool = False,
) -> tuple[GenerationOutput, GenerationOutput | None]:
    """RL rollouts: ``k`` nucleus samples per prompt from ``target`` (the ``policy`` in eval
    mode, no dropout; its training mode restored after), and the greedy decode too when
    ``greedy`` (a self-critical baseline)."""
    was_training = policy.training
    policy.eval()
    try:
        out = generate(
            target,
            dict(inputs),
            "sample",
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            num_return_sequences=k,
            generator=generator,
        )
        best = None
        if greedy:
            best = generate(target, dict(inputs), "greedy", max_new_tokens=max_new_tokens)
    finally:
        policy.train(was_training)
    return out, best
