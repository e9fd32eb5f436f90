"""Assistant-only SFT labels: vltrain's caption-stage collate vs TRL's VLM collator.

For a tiny Qwen2-VL and a tiny LLaVA built from config objects, each with the real chat
template TRL knows how to train (``qwen2_5_vl``, byte-identical to Qwen2-VL's, and
``llava_next``; the LLaVA twice, with a byte-level and a SentencePiece-style tokenizer), the
same chat records (shape captions: one-turn chats, and two-turn chats with
two assistant turns) go through

- vltrain: `VLMCaptionCollate` in ``chat`` format, as the caption stage builds it for
  ``model.kind=hf_vlm`` (labels by `vlm_sft_labels`), with the model's own template;
- TRL: ``DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True,
  chat_template=get_training_chat_template(processor))``, what ``SFTTrainer`` builds for a
  conversational dataset with ``assistant_only_loss=True`` (its ``{% generation %}`` variant of
  the template; completion-only loss is for prompt-completion data and refuses ``messages``).

and the script reports, per model, whether the input ids agree row by row and how many label
positions differ (and, for the first few, which tokens and whose rule).

Needs trl (a bench venv with torch, transformers, trl):
``PYTHONPATH=. /work/venv-trl/bin/python bench/trl_sft_label_parity.py --data DIR``
where DIR is a ``vltrain data synth`` folder (made in a temp folder when omitted).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vltrain.data.vlm_caption_data import IGNORE_INDEX, VLMCaptionCollate

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
    "</s>",
]
QUESTIONS = ("describe the image.", "what do you see?", "caption this picture.")


# ---- tiny models -------------------------------------------------------------------------


def tokenizer(texts: list[str], eos: str, chat_template: str, metaspace: bool = False) -> Any:
    """A BPE tokenizer trained on `texts`, with the chat specials: byte-level (GPT-2 / Qwen
    style), or with `metaspace` SentencePiece-style (Llama / Mistral: spaces become ``▁``, one
    prepended to the text, pieces split at words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if metaspace:
        kw = {"replacement": "\u2581", "prepend_scheme": "first", "split": True}
        tok.pre_tokenizer = pre_tokenizers.Metaspace(**kw)
        tok.decoder = decoders.Metaspace(**kw)
        alphabet = []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>", chat_template=chat_template
    )


def build_qwen2vl(out: Path, texts: list[str], hidden: int = 32, layers: int = 2) -> Path:
    """A random Qwen2-VL (patch 4, merge 2: a 32x32 image is 16 visual tokens) saved with its
    tokenizer (Qwen2-VL's chat template) and image processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from trl.chat_template_utils import qwen2_5_vl_chat_template

    tok = tokenizer(texts, "<|im_end|>", qwen2_5_vl_chat_template)
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    heads = max(2, hidden // 32)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    rope["mrope_section"] = [hidden // heads // 8, hidden // heads // 16 * 3]
    rope["mrope_section"].append(hidden // heads // 2 - sum(rope["mrope_section"]))
    text = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=0,
    )
    vision = dict(
        depth=1,
        embed_dim=16,
        hidden_size=hidden,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=32 * 32
    ).save_pretrained(out)
    return out


def build_llava(
    out: Path, texts: list[str], hidden: int = 32, layers: int = 1, metaspace: bool = False
) -> Path:
    """A random LLaVA (CLIP tower 32 px / patch 8: 16 image tokens; Qwen2 LM) saved with its
    LlavaProcessor and LLaVA-NeXT's chat template (``[INST] ... [/INST] answer</s>``); a
    SentencePiece-style tokenizer with `metaspace` (as LLaVA-NeXT-Mistral's), else byte-level."""
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from trl.chat_template_utils import llava_next_chat_template

    if metaspace:  # the template's words are in a real tokenizer's vocabulary (``▁[INST]``)
        texts = texts + ["[INST] [/INST] answer</s> [INST] question [/INST]"] * 50
    tok = tokenizer(texts, "</s>", llava_next_chat_template, metaspace)
    cfg = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(2, hidden // 32),
            num_key_value_heads=1,
            pad_token_id=0,
            eos_token_id=tok.convert_tokens_to_ids("</s>"),
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(cfg).save_pretrained(out)
    ip = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=llava_next_chat_template,
    ).save_pretrained(out)
    return out


def trl_processor(path: Path, model_type: str) -> Any:
    """The processor TRL's collator calls; Qwen2-VL's without its video half (no torchvision
    here), which images-only chats never use."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if model_type != "qwen2_vl":
        return AutoProcessor.from_pretrained(path)
    from transformers import Qwen2VLProcessor

    tok = AutoTokenizer.from_pretrained(path)
    ip = AutoImageProcessor.from_pretrained(path, backend="pil")

    class _NoVideo:  # the processor's constructor only stores it
        pass

    proc = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    proc.tokenizer, proc.image_processor, proc.video_processor = tok, ip, _NoVideo()
    proc.chat_template = tok.chat_template
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = tok.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(proc.video_token)
    return proc


# ---- records -----------------------------------------------------------------------------


def chat_records(data: Path, n: int = 100) -> list[dict[str, Any]]:
    """`n` chats over a shapes split: every third a one-turn caption chat, the others two user
    and two assistant turns (caption, then a follow-up answered from the record)."""
    lines = (data / "train.jsonl").read_text().splitlines()[:n]
    out = []
    for i, line in enumerate(lines):
        r = json.loads(line)
        msgs = [
            {"role": "user", "content": QUESTIONS[i % 3]},
            {"role": "assistant", "content": r["text"][i % len(r["text"])]},
        ]
        if i % 3:
            shapes = ", ".join(o["shape"] for o in r["objects"])
            follow = ("which shapes are there?", shapes) if i % 3 == 1 else None
            follow = follow or ("how are they placed?", f"one is {r['relation']} the other.")
            msgs += [{"role": "user", "content": follow[0]}]
            msgs += [{"role": "assistant", "content": follow[1]}]
        out.append({"image": str(data / r["image"]), "messages": msgs})
    return out


# ---- the two collates ----------------------------------------------------------------------


def vltrain_batch(path: Path, model_type: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    collate = VLMCaptionCollate(str(path), model_type, "chat", max_text_len=100_000)
    samples = [
        {"image": Image.open(r["image"]).convert("RGB"), "messages": r["messages"], "index": i}
        for i, r in enumerate(recs)
    ]
    return collate(samples)


def trl_collator(path: Path, model_type: str) -> Any:
    from trl.chat_template_utils import get_training_chat_template
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    proc = trl_processor(path, model_type)
    proc.tokenizer.padding_side = "right"
    template = get_training_chat_template(proc)
    return DataCollatorForVisionLanguageModeling(
        proc, assistant_only_loss=True, chat_template=template
    )


def trl_batch(collator: Any, recs: list[dict[str, Any]]) -> dict[str, Any]:
    examples = [
        {"images": [Image.open(r["image"]).convert("RGB")], "messages": r["messages"]} for r in recs
    ]
    return collator(examples)


def compare(path: Path, model_type: str, recs: list[dict[str, Any]], batch: int = 8) -> dict:
    """Rows whose input ids differ, and label positions that differ on rows whose ids agree;
    `examples` shows the first few differences as (token, vltrain label?, TRL label?)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    collator = trl_collator(path, model_type)
    res: dict[str, Any] = {"rows": 0, "ids_differ": 0, "positions": 0, "label_mismatch": 0}
    res["labelled_vltrain"] = res["labelled_trl"] = 0
    res["examples"] = []
    for s in range(0, len(recs), batch):
        chunk = recs[s : s + batch]
        a, b = vltrain_batch(path, model_type, chunk), trl_batch(collator, chunk)
        for i in range(len(chunk)):
            n_a, n_b = int(a["attention_mask"][i].sum()), int(b["attention_mask"][i].sum())
            ids_a, ids_b = a["input_ids"][i, :n_a], b["input_ids"][i, :n_b]
            res["rows"] += 1
            if n_a != n_b or not torch.equal(ids_a, ids_b):
                res["ids_differ"] += 1
                if len(res["examples"]) < 6:
                    k = next(
                        (j for j in range(min(n_a, n_b)) if ids_a[j] != ids_b[j]), min(n_a, n_b)
                    )
                    res["examples"].append(
                        {
                            "row": s + i,
                            "ids_differ_at": k,
                            "vltrain": tok.decode(ids_a[max(0, k - 3) : k + 3]),
                            "trl": tok.decode(ids_b[max(0, k - 3) : k + 3]),
                        }
                    )
                continue
            la, lb = a["labels"][i, :n_a], b["labels"][i, :n_b]
            res["positions"] += n_a
            res["labelled_vltrain"] += int((la != IGNORE_INDEX).sum())
            res["labelled_trl"] += int((lb != IGNORE_INDEX).sum())
            bad = (la != lb).nonzero().flatten().tolist()
            res["label_mismatch"] += len(bad)
            for j in bad[: max(0, 6 - len(res["examples"]))]:
                res["examples"].append(
                    {
                        "row": s + i,
                        "pos": j,
                        "token": tok.convert_ids_to_tokens(int(ids_a[j])),
                        "vltrain_labels": bool(la[j] != IGNORE_INDEX),
                        "trl_labels": bool(lb[j] != IGNORE_INDEX),
                    }
                )
    return res


def texts_of(recs: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for r in recs for m in r["messages"]] * 3


def label_parity(data: Path, work: Path, n: int = 100) -> dict[str, dict]:
    """The comparison for both tiny models over `n` records of `data`."""
    recs = chat_records(data, n)
    texts = texts_of(recs)
    out = {}
    for name, build, model_type, kw in (
        ("qwen2_vl", build_qwen2vl, "qwen2_vl", {}),
        ("llava", build_llava, "llava", {}),
        ("llava_metaspace", build_llava, "llava", {"metaspace": True}),
    ):
        path = work / name
        path.mkdir(parents=True, exist_ok=True)
        build(path, texts, **kw)
        out[name] = compare(path, model_type, recs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a `vltrain data synth` folder")
    ap.add_argument("--n", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            from vltrain.data.synth import write_shapes_dataset

            data = Path(tmp) / "shapes"
            write_shapes_dataset(data, n_train=args.n, n_val=2, n_test=2, image_size=32)
        res = label_parity(data, Path(tmp) / "models", args.n)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
