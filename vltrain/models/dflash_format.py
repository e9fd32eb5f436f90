"""vltrain drafters in the serving engines' DFlash formats, and back.

Two formats describe the same network (Qwen3 decoder layers whose keys/values are [context;
block], ``fc`` over the concatenated target layers, ``hidden_norm``, a final ``norm``, the
target's embedding and LM head shared):

- speculators (vLLM; ``speculators_model_type: "dflash"``): weights ``layers.N.self_attn.
  q_proj.weight`` ..., a reduced draft vocabulary as ``d2t`` (offsets: target id = draft index
  + d2t[index]), ``t2d`` (a bool mask over the target vocabulary) and ``lm_head.weight`` (the
  target head's rows in ascending id order). ``aux_hidden_state_layer_ids`` count the
  *input* of a target layer (vLLM collects ``hidden_states`` before layer i): vltrain's block
  i output is speculators' id ``i + 1`` (``SPECULATORS_LAYER_OFFSET``), and the last layer is
  not an aux layer (speculators splits it off as the verifier's own last hidden state).
- DFlash (z-lab; SGLang ``--speculative-algorithm DFLASH``, transformers): a Qwen3 config with
  ``architectures: ["DFlashDraftModel"]``, ``block_size`` and ``dflash_config: {target_layer_ids,
  mask_token_id}``; the drafter reads ``hidden_states[layer_id + 1]``, so its ids are
  vltrain's. No draft vocabulary map: the drafter scores the target's whole vocabulary.

Both feed the mask slots the target's embedding of ``mask_token_id`` (by position: slot 0 is
the anchor) and put q/k RMSNorm in every layer, so only a drafter with ``qk_norm`` and without
a learned mask embedding converts (``drafter.arch: dflash``); ``differences`` names the rest.
Slot k of a block predicts token anchor + k, the anchor itself is the bonus token:
``sample_from_anchor: false``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vltrain.config.core import ConfigError
from vltrain.models.drafter import Drafter, DrafterConfig

SPECULATORS_LAYER_OFFSET = 1
"""speculators' aux layer id of vltrain's (and z-lab's) target layer id i is i + 1."""
TORCH_RMS_EPS = float(torch.finfo(torch.float32).eps)
"""What ``nn.RMSNorm(eps=None)`` uses in fp32: written as ``rms_norm_eps`` for such drafters."""
LAYER_KEYS = {  # vltrain DraftLayer key -> the formats' Qwen3DFlashDecoderLayer key
    "norm1.weight": "input_layernorm.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "q.weight": "self_attn.q_proj.weight",
    "k.weight": "self_attn.k_proj.weight",
    "v.weight": "self_attn.v_proj.weight",
    "o.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    "gate.weight": "mlp.gate_proj.weight",
    "up.weight": "mlp.up_proj.weight",
    "down.weight": "mlp.down_proj.weight",
}
TOP_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")


@dataclass
class TargetInfo:
    """What an export says about the drafter's target (the verifier)."""

    name_or_path: str
    """Its HF id, or its path relative to the export folder (never absolute)."""
    architectures: list[str]
    model_type: str
    num_layers: int
    vocab_size: int
    width: int
    max_positions: int
    tie_word_embeddings: bool
    config_sha256: str
    """sha256 of the target's config.json (of its config dict for a GGUF file)."""


def differences(cfg: DrafterConfig, target_layers: int) -> list[str]:
    """What keeps ``cfg`` from being the DFlash formats' network; [] when it converts."""
    out = []
    if cfg.learned_mask:
        out.append(
            "a learned mask embedding (the formats feed mask slots the target's embedding of "
            "mask_token_id; train with drafter.arch=dflash)"
        )
    if not cfg.qk_norm:
        out.append("no q/k norm in its layers (the formats' Qwen3 layers have one)")
    last = [i for i in cfg.target_layer_ids if i >= target_layers - 1]
    if last:
        out.append(
            f"target layer ids {last} read the last layer's output, which the formats read "
            "after the target's final norm (speculators: not an aux layer)"
        )
    return out


def transformer_layer_config(cfg: DrafterConfig, target: TargetInfo) -> dict[str, Any]:
    """The Qwen3 decoder config both formats build the draft layers from."""
    eps = TORCH_RMS_EPS if cfg.norm_eps is None else cfg.norm_eps
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.width,
        "intermediate_size": int(cfg.width * cfg.mlp_ratio),
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.heads,
        "head_dim": cfg.width // cfg.heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.layers,
        "max_position_embeddings": target.max_positions,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": target.tie_word_embeddings,
    }


def provenance(cfg: DrafterConfig, target: TargetInfo) -> dict[str, Any]:
    """The ``vltrain`` entry of an export's config.json: the drafter config and its target."""
    return {"drafter": cfg.to_dict(), "target": asdict(target)}


def speculators_config(
    cfg: DrafterConfig,
    target: TargetInfo,
    layer_offset: int = SPECULATORS_LAYER_OFFSET,
    sample_from_anchor: bool = False,
) -> dict[str, Any]:
    """config.json of a speculators ``dflash`` checkpoint (the arguments exist for the
    negative controls: a drafter exported with another offset or anchor rule is wrong)."""
    speculative = cfg.block_size if sample_from_anchor else cfg.block_size - 1
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": transformer_layer_config(cfg, target),
        "draft_vocab_size": cfg.draft_vocab or target.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + layer_offset for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": sample_from_anchor,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target.name_or_path,
                "architectures": target.architectures,
            },
        },
        "dtype": "float32",
        "vltrain": provenance(cfg, target),
    }


def dflash_config(cfg: DrafterConfig, target: TargetInfo) -> dict[str, Any]:
    """config.json of a z-lab DFlash checkpoint (a Qwen3 config + ``dflash_config``)."""
    return {
        **transformer_layer_config(cfg, target),
        "architectures": ["DFlashDraftModel"],
        "block_size": cfg.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
        "dtype": "float32",
        "vltrain": provenance(cfg, target),
    }


def body_state(drafter: Drafter) -> dict[str, Tensor]:
    """The draft network's weights under the formats' names (no vocabulary, no embedding)."""
    out = {}
    for key, t in drafter.state_dict().items():
        if key in TOP_KEYS:
            out[key] = t
        elif key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            out[f"layers.{i}.{LAYER_KEYS[rest]}"] = t
        elif key != "vocab_ids":
            raise ConfigError(f"drafter weight '{key}' has no place in the DFlash formats")
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def speculators_state(drafter: Drafter) -> dict[str, Tensor]:
    """The speculators checkpoint's tensors; a reduced vocabulary adds d2t, t2d, lm_head."""
    out = body_state(drafter)
    if drafter.cfg.draft_vocab:
        ids = drafter.vocab_ids.detach().cpu().long()  # ascending (draft_vocab_ids sorts)
        n = len(ids)
        out["d2t"] = ids - torch.arange(n)
        t2d = torch.zeros(drafter.cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
        w, _ = drafter.head_rows()
        out["lm_head.weight"] = w.detach().cpu().contiguous().clone()
    return out


def _config_of(path: str | Path) -> dict:
    """config.json of ``path`` as a dict ({} when there is none or it is not JSON)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return {}
    try:
        c = json.loads(cfg.read_text())
    except json.JSONDecodeError:
        return {}
    return c if isinstance(c, dict) else {}


def is_speculators(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a speculators DFlash checkpoint."""
    return _config_of(path).get("speculators_model_type") == "dflash"


def is_dflash(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a z-lab DFlash checkpoint."""
    c = _config_of(path)
    return "DFlashDraftModel" in (c.get("architectures") or []) and "dflash_config" in c


def _import_refusals(tl: dict) -> list[str]:
    """What a DFlash decoder config holds that a vltrain drafter cannot compute."""
    heads, width = tl["num_attention_heads"], tl["hidden_size"]
    rope = tl.get("rope_parameters") or {}
    checks = [
        (tl.get("num_key_value_heads", heads) != heads, "grouped key/value heads"),
        (tl.get("head_dim", width // heads) != width // heads, "head_dim != hidden / heads"),
        (bool(tl.get("attention_bias")), "attention biases"),
        (tl.get("hidden_act", "silu") != "silu", f"hidden_act {tl.get('hidden_act')}"),
        (rope.get("rope_type", "default") != "default", f"rope_type {rope.get('rope_type')}"),
        (
            any(t != "full_attention" for t in tl.get("layer_types") or []),
            "sliding-window layers",
        ),
    ]
    return [what for bad, what in checks if bad]


def _speculators_refusals(c: dict) -> list[str]:
    """What a speculators config holds beyond its decoder that vltrain cannot run."""
    methods = c.get("speculators_config", {}).get("proposal_methods") or [{}]
    n = methods[0].get("speculative_tokens", c.get("block_size", 0) - 1)
    checks = [
        (bool(c.get("sample_from_anchor")), "sample_from_anchor: true"),
        (
            min(c.get("aux_hidden_state_layer_ids") or [0]) < SPECULATORS_LAYER_OFFSET,
            "an aux layer id 0 (the embedding output)",
        ),
        (
            n != c.get("block_size", 0) - 1,
            f"speculative_tokens {n} with block_size {c.get('block_size')} (a block drafts "
            "block_size - 1 tokens)",
        ),
    ]
    return [what for bad, what in checks if bad]


def _check_block_and_mask(folder: Path, block: Any, mask: Any, vocab: int) -> None:
    """block_size a whole number >= 2, mask_token_id a token of the vocabulary."""
    if not isinstance(block, int) or block < 2:
        raise ConfigError(f"{folder}: block_size {block!r} is not a block (a whole number >= 2)")
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise ConfigError(
            f"{folder}: mask_token_id {mask!r} is not a token of its vocabulary ({vocab} tokens)"
        )


def _drafter_from(
    folder: Path, tl: dict, layer_ids: list[int], block: int, mask: int, n_draft: int
) -> tuple[Drafter, dict[str, Tensor]]:
    """The drafter a DFlash decoder config ``tl`` describes, loaded from ``folder``'s
    safetensors (strict); also returns those tensors (the caller reads d2t / t2d)."""
    width, vocab = tl["hidden_size"], tl["vocab_size"]
    rope = tl.get("rope_parameters") or {}
    cfg = DrafterConfig(
        width=width,
        vocab_size=vocab,
        target_layer_ids=layer_ids,
        layers=tl["num_hidden_layers"],
        heads=tl["num_attention_heads"],
        mlp_ratio=tl["intermediate_size"] / width,
        block_size=block,
        rope_theta=float(rope.get("rope_theta", tl.get("rope_theta", 10000.0))),
        mask_token_id=mask,
        draft_vocab=0 if n_draft == vocab else n_draft,
        qk_norm=True,
        learned_mask=False,
        norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
    )
    if int(cfg.width * cfg.mlp_ratio) != tl["intermediate_size"]:
        raise ConfigError(f"{folder}: intermediate_size {tl['intermediate_size']} is not exact")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors: the drafter's weights are missing")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(read_weights(f))
    inverse = {v: k for k, v in LAYER_KEYS.items()}
    own = {k: state[k] for k in TOP_KEYS if k in state}
    for key, t in state.items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            own[f"layers.{i}.{inverse.get(rest, rest)}"] = t
    if cfg.draft_vocab:
        own["vocab_ids"] = _vocab_ids(folder, state, n_draft, vocab)
    drafter = Drafter(cfg)
    want = set(drafter.state_dict())
    missing, extra = sorted(want - own.keys()), sorted(own.keys() - want)
    if missing or extra:
        raise ConfigError(
            f"{folder}: weights do not match its config.json: "
            + "; ".join(
                f"{what} {len(keys)} ({', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''})"
                for what, keys in (("missing", missing), ("unexpected", extra))
                if keys
            )
        )
    try:
        drafter.load_state_dict(own, strict=True)
    except RuntimeError as e:  # shapes: torch names each mismatched key on its own line
        lines = [x.strip() for x in str(e).splitlines()[1:] if x.strip()]
        raise ConfigError(
            f"{folder}: weights do not match its config.json: {'; '.join(lines[:3])}"
        ) from None
    return drafter.eval(), state


def read_weights(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors; a file that cannot be read (truncated, not safetensors)
    is a one-line error naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path} cannot be read as safetensors ({e}): copy it again") from None


def _relative_to(folder: Path, name: str) -> str:
    """A verifier path relative to the checkpoint resolved (a hub id, or nothing, as is)."""
    return str((folder / name).resolve()) if name and (folder / name).exists() else name


def load_speculators(path: str | Path) -> tuple[Drafter, dict]:
    """(vltrain drafter in eval mode, its target dict) of a speculators DFlash checkpoint."""
    folder = Path(path)
    c = _config_of(folder)
    tl = c["transformer_layer_config"]
    bad = _import_refusals(tl) + _speculators_refusals(c)
    if c.get("mask_token_id") is None:
        bad.append("no mask_token_id")
    if bad:
        raise ConfigError(f"{folder}: a speculators drafter vltrain cannot run: {', '.join(bad)}")
    vocab, n_draft = tl["vocab_size"], c["draft_vocab_size"]
    if n_draft > vocab:
        raise ConfigError(
            f"{folder}: draft_vocab_size {n_draft} is larger than the target's vocabulary {vocab}"
        )
    _check_block_and_mask(folder, c.get("block_size"), c["mask_token_id"], vocab)
    ids = [i - SPECULATORS_LAYER_OFFSET for i in c["aux_hidden_state_layer_ids"]]
    drafter, _ = _drafter_from(folder, tl, ids, c["block_size"], c["mask_token_id"], n_draft)
    verifier = c["speculators_config"]["verifier"]
    target = {
        "kind": "hf_lm",
        "path": _relative_to(folder, verifier.get("name_or_path") or ""),
        "format": "speculators",
        "verifier": {"architectures": list(verifier.get("architectures") or []), "vocab": vocab},
        "config_sha256": ((c.get("vltrain") or {}).get("target") or {}).get("config_sha256"),
    }
    return drafter, _with_measured(target, c)


def load_dflash(path: str | Path) -> tuple[Drafter, dict]:
    """(vltrain drafter in eval mode, its target dict) of a z-lab DFlash checkpoint: a Qwen3
    config whose ``dflash_config`` names the target layers (read as ``hidden_states[id + 1]``:
    vltrain's ids) and the mask token. The verifier's architecture is known only from a
    vltrain export's provenance; its vocabulary and layer count from the config."""
    folder = Path(path)
    c = _config_of(folder)
    dc = c["dflash_config"]
    bad = _import_refusals(c)
    if dc.get("mask_token_id") is None:
        bad.append("no dflash_config.mask_token_id")
    if bad:
        raise ConfigError(f"{folder}: a DFlash drafter vltrain cannot run: {', '.join(bad)}")
    block, vocab = c.get("block_size"), c["vocab_size"]
    if "block_size" in dc and dc["block_size"] != block:
        raise ConfigError(
            f"{folder}: block_size {block!r} and dflash_config.block_size "
            f"{dc['block_size']!r} disagree"
        )
    _check_block_and_mask(folder, block, dc["mask_token_id"], vocab)
    ids = list(dc["target_layer_ids"])
    drafter, _ = _drafter_from(folder, c, ids, block, dc["mask_token_id"], vocab)
    made = (c.get("vltrain") or {}).get("target") or {}
    target = {
        "kind": "hf_lm",
        "path": _relative_to(folder, made.get("name_or_path", "")),
        "format": "dflash",
        "verifier": {
            "architectures": list(made.get("architectures") or []),
            "vocab": vocab,
            "layers": c.get("num_target_layers"),
        },
        "config_sha256": made.get("config_sha256"),
    }
    return drafter, _with_measured(target, c)


def _with_measured(target: dict, config: dict) -> dict:
    """``target`` with the decoding a vltrain export carries (``vltrain.eval``: tau_decode,
    ...), as ``load_drafter`` reads it from a run's ``drafter.json``."""
    measured = (config.get("vltrain") or {}).get("eval")
    return {**target, "eval": measured} if measured else target


def check_verifier(target: dict, model: Any, where: str, option: str = "--model") -> None:
    """Refuse an imported drafter whose verifier is not the HF ``model`` it is to draft for
    (architecture, vocabulary size, layer count where the checkpoint names them)."""
    verifier = target.get("verifier")
    if not verifier:
        return  # a vltrain checkpoint: attach() checks width, vocabulary and layers
    archs = set(getattr(model.config, "architectures", None) or [])
    vocab = model.get_output_embeddings().weight.shape[0]
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    named = set(verifier.get("architectures") or [])
    diff = []
    if named and archs and not named & archs:
        diff.append(f"architecture {sorted(named)} (the model is {sorted(archs)})")
    if verifier.get("vocab") not in (None, vocab):
        diff.append(f"a vocabulary of {verifier['vocab']} tokens (the model has {vocab})")
    if verifier.get("layers") not in (None, layers):
        diff.append(f"{verifier['layers']} layers (the model has {layers})")
    if diff:
        raise ConfigError(
            f"the drafter {where} was made for another verifier: {'; '.join(diff)}; set "
            f"{option} to the model it names"
        )


def _vocab_ids(folder: Path, state: dict[str, Tensor], n: int, vocab: int) -> Tensor:
    """Draft index -> target id from ``d2t``, checked against ``t2d`` and ``lm_head``."""
    if "d2t" not in state or "t2d" not in state:
        raise ConfigError(f"{folder}: a draft vocabulary of {n} needs d2t and t2d")
    ids = torch.arange(n) + state["d2t"].long()
    t2d = state["t2d"].bool()
    if t2d.shape != (vocab,) or not torch.equal(t2d.nonzero()[:, 0], ids):
        raise ConfigError(f"{folder}: d2t and t2d name different draft vocabularies")
    if "lm_head.weight" in state and state["lm_head.weight"].shape[0] != n:
        raise ConfigError(f"{folder}: lm_head.weight has {state['lm_head.weight'].shape[0]} rows")
    return ids
