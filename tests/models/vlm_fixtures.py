"""Tiny random generative VLMs and their parts, built from config objects and saved to a folder
like hub models (weights + tokenizer with a chat template + image processor), for the hf_vlm and
llava model kinds of the caption stage. Not part of the package."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures import make_tiny_qwen3vl
from tests.inference.vlm_helpers import make_tiny_qwen2vl
from tests.models.test_hf_embedders import _save, _tokenizer, tiny_llava

# a chat template for string contents (a text LM's): role header, content, end of turn
TEXT_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2vl(out: Path) -> str:
    """The decoding tests' tiny Qwen2-VL (tests/inference/vlm_helpers.py), images up to 32 x 32
    px, transformers' default text positions."""
    return make_tiny_qwen2vl(out, max_pixels=32 * 32, max_positions=None)


def tiny_qwen3vl(out: Path) -> str:
    """The shared tiny Qwen3-VL (tests/fixtures.py)."""
    return make_tiny_qwen3vl(out)


def tiny_hf_llava(out: Path, processor_patch: int = 8) -> str:
    """A tiny LlavaForConditionalGeneration (CLIP tower reading layer -2 of 2, Qwen2 LM) with
    its LlavaProcessor; `processor_patch` other than the tower's 8 makes the processor's
    image-token count disagree with the model's features."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor

    path = tiny_llava(out, vision_layers=2, feature_layer=-2)
    tok = AutoTokenizer.from_pretrained(path)
    ip = AutoImageProcessor.from_pretrained(path, backend="pil")
    LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=processor_patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    ).save_pretrained(path)
    return path


def tiny_idefics3(out: Path) -> str:
    """A tiny Idefics3 (SmolVLM-style: SigLIP tower, pixel-shuffle connector, Llama LM),
    images resized to 32 px without splitting: 4 image tokens each."""
    from transformers import (
        AddedToken,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
    )

    tok = _tokenizer("<image>")
    extra = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in extra]}
    )
    tok.chat_template = (
        "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:"
        "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}"
        "{{ c['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    text = dict(
        model_type="llama",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=None,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    cfg = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    ip = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": 32},
        max_image_size={"longest_edge": 32},
    )
    path = _save(Idefics3ForConditionalGeneration(cfg), tok, ip, out)
    from transformers import Idefics3Processor

    Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4).save_pretrained(path)
    return path


def tiny_clip_vision(out: Path, image_size: int = 32, patch: int = 8) -> str:
    """A tiny CLIPVisionModel directory with its image processor (no text side)."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch,
    )
    torch.manual_seed(1)
    CLIPVisionModel(cfg).save_pretrained(out)
    size = {"height": image_size, "width": image_size}
    CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=size).save_pretrained(out)
    return str(out)


def tiny_siglip_vision(out: Path, image_size: int = 32, patch: int = 8) -> str:
    """A tiny SiglipVisionModel directory with its image processor (no class token)."""
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch,
    )
    torch.manual_seed(3)
    SiglipVisionModel(cfg).save_pretrained(out)
    SiglipImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(out)
    return str(out)


def tiny_causal_lm_dir(out: Path, chat_template: bool = True) -> str:
    """A tiny Qwen2 causal LM with a byte-level BPE tokenizer (and a string-content chat
    template unless `chat_template=False`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = _tokenizer()
    tok.chat_template = TEXT_CHAT if chat_template else None
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def tiny_gguf_lm(out: Path) -> str:
    """`tiny_causal_lm_dir` converted to an F32 GGUF file (``out/lm.gguf``, llama.cpp's
    qwen2 tensor names and tokenizer keys); needs the ``gguf`` package."""
    import json

    import gguf
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    src = out / "hf"
    src.mkdir()
    tiny_causal_lm_dir(src)
    model = Qwen2ForCausalLM.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(src)
    c = model.config
    w = gguf.GGUFWriter(str(out / "lm.gguf"), "qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["content"] for t in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in added else 1 for t, _ in vocab])
    merges = spec["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for key, value in model.state_dict().items():
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, layer, rest = key.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            name = f"blk.{layer}.{names[module]}.{leaf}"
        w.add_tensor(name, value.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out / "lm.gguf")
