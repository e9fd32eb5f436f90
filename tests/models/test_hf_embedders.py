"""HF embedders on tiny random models built from configs, saved locally and loaded back by path."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from vltrain.data.hf_collate import HFCollate  # noqa: E402
from vltrain.models.hf_embedders import (  # noqa: E402
    EMBEDDERS,
    HFClipEmbedder,
    HFSiglipEmbedder,
    VLMEmbedder,
    build_embedder,
    last_token_pool,
)
from vltrain.objectives.contrastive import InfoNCELoss, build_loss  # noqa: E402

SPECIALS = [
    "<|endoftext|>",
    "<|startoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ image_markup }}{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
CAPTIONS = [
    "a red cat on a mat",
    "a dog runs on green grass",
    "two birds in a blue sky",
    "a small boat on the sea",
    "a photo of a yellow car",
    "an old man reads a book",
]


def _tokenizer(
    chat_markup: str | None = None, eos_template: bool = False
) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CAPTIONS * 3, trainer)
    if eos_template:  # CLIP pools at the first EOS: every text must end with one
        tok.post_processor = processors.TemplateProcessing(
            single="<|startoftext|> $A <|endoftext|>",
            special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 0)],
        )
    kw = {"chat_template": CHAT.replace("{{ image_markup }}", chat_markup)} if chat_markup else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", **kw
    )


def _images(n: int, seed: int = 0, sizes: tuple[tuple[int, int], ...] = ((24, 40),)) -> list:
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 255, (*sizes[i % len(sizes)], 3), dtype=np.uint8))
        for i in range(n)
    ]


def _save(model, tok, ip, path: Path) -> str:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    ip.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    tok = _tokenizer(eos_template=True)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            eos_token_id=0,
            bos_token_id=1,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        projection_dim=24,
    )
    torch.manual_seed(0)
    ip = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return _save(CLIPModel(cfg), tok, ip, tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import SiglipConfig, SiglipImageProcessorPil, SiglipModel

    tok = _tokenizer()
    cfg = SiglipConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
    )
    torch.manual_seed(0)
    ip = SiglipImageProcessorPil(size={"height": 16, "width": 16})
    return _save(SiglipModel(cfg), tok, ip, tmp_path_factory.mktemp("siglip"))


def _qwen_ids(tok: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


@pytest.fixture(scope="module")
def qwen2vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer("<|vision_start|><|image_pad|><|vision_end|>")
    cfg = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            bos_token_id=None,
            eos_token_id=0,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        **_qwen_ids(tok),
    )
    torch.manual_seed(0)
    ip = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=64 * 64
    )
    return _save(Qwen2VLForConditionalGeneration(cfg), tok, ip, tmp_path_factory.mktemp("q2vl"))


def tiny_llava(out: Path, vision_layers: int = 1, feature_layer: int = -1) -> str:
    """A tiny LLaVA (CLIP vision tower, Qwen2 text model) saved to `out`; the projector reads
    vision layer `feature_layer` (LLaVA-1.5 reads -2)."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration

    tok = _tokenizer("<image>")
    cfg = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=vision_layers,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            pad_token_id=0,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    torch.manual_seed(0)
    ip = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return _save(LlavaForConditionalGeneration(cfg), tok, ip, out)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llava(tmp_path_factory.mktemp("llava"))


def _samples(n: int, negatives: bool = False) -> list[dict]:
    imgs = _images(n, sizes=((24, 40), (40, 24), (32, 32)))
    return [
        {
            "image": imgs[i],
            "text": CAPTIONS[i % len(CAPTIONS)],
            "index": i,
            "negatives": [CAPTIONS[(i + 1) % len(CAPTIONS)]] if negatives else [],
        }
        for i in range(n)
    ]


# ---- CLIP / SigLIP ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hf_clip", "hf_siglip"])
def test_dual_tower_embeddings_match_hf_forward(kind: str, clip_dir: str, siglip_dir: str) -> None:
    path = clip_dir if kind == "hf_clip" else siglip_dir
    emb = build_embedder(kind, path).eval()
    batch = HFCollate(path, kind, max_text_len=16)(_samples(3))
    with torch.no_grad():
        img, txt = emb(batch["images"], batch["input_ids"], batch["attention_mask"])
        ref = emb.model(
            pixel_values=batch["images"],
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
        )
    assert img.shape == (3, emb.embed_dim) and txt.shape == (3, emb.embed_dim)
    assert img.dtype == torch.float32
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    # parity with transformers' own contrastive head (normalised embeds)
    torch.testing.assert_close(img, F.normalize(ref.image_embeds, dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(txt, F.normalize(ref.text_embeds, dim=-1), atol=1e-5, rtol=1e-5)
    scale = float(emb.model.logit_scale.detach().exp())
    assert emb.loss_init("infonce")["temperature"] == pytest.approx(1.0 / scale)
    if kind == "hf_siglip":
        init = emb.loss_init()  # siglip by default: the loss reproduces the model's logits
        loss = build_loss("siglip", **init, gather=False)
        assert float(loss.scale()) == pytest.approx(scale, rel=1e-5)
        assert float(loss.logit_bias) == pytest.approx(float(emb.model.logit_bias.detach()))
        assert batch["input_ids"].shape[1] == 16  # padded to max_length: SigLIP pools the end
        with torch.no_grad():  # a trained SigLIP's scale (~117) is above the default clamp
            emb.model.logit_scale.fill_(np.log(117.0))
        loss = build_loss("siglip", **emb.loss_init(), gather=False)
        assert float(loss.scale()) == pytest.approx(117.0, rel=1e-5)
    assert batch["visual_tokens"].tolist() == [4, 4, 4]


def test_siglip_text_length_must_be_the_padding_hf_uses(
    siglip_dir: str, shapes_dir: Path, tmp_path: Path
) -> None:
    """SigLIP embeds a text as its last position: trained at a data.max_text_len other than
    the length HF pads to (the tokenizer's model_max_length, else the text positions), the
    embeddings transformers computes differ from the trained ones (0.6 apart, a reviewer's
    run); refused at load."""
    from tests.conftest import tiny_overrides
    from vltrain.config.core import ConfigError
    from vltrain.stages import load_run_config

    base = tiny_overrides(shapes_dir, tmp_path / "r", **{"model.kind": "hf_siglip"})
    base += [f"model.path={siglip_dir}", "objective.loss=siglip"]
    with pytest.raises(ConfigError, match="set data.max_text_len=16"):
        load_run_config(None, [*base, "data.max_text_len=12"])
    load_run_config(None, [*base, "data.max_text_len=16"])  # control: HF's own length
    tok = PreTrainedTokenizerFast.from_pretrained(siglip_dir)
    texts = ["a red circle", "two small blue squares next to a large triangle"]
    hf = tok(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    ours, _ = HFCollate(siglip_dir, "hf_siglip", max_text_len=16).text_batch(texts)
    assert torch.equal(ours, hf["input_ids"])


def test_wrong_kind_and_missing_dir_are_clear_errors(clip_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expects siglip"):
        HFSiglipEmbedder(clip_dir)
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        HFClipEmbedder(tmp_path / "nope")
    with pytest.raises(KeyError, match="known"):
        build_embedder("clip", clip_dir)
    with pytest.raises(ValueError, match="fixed image size"):
        HFCollate(clip_dir, "hf_clip", max_visual_tokens=16)(_samples(1))


def test_clip_training_reduces_infonce_and_save_round_trip(clip_dir: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    emb = HFClipEmbedder(clip_dir)
    collate = pickle.loads(pickle.dumps(HFCollate(clip_dir, "hf_clip", max_text_len=16)))
    batch = collate(_samples(6))
    loss_fn = InfoNCELoss(**emb.loss_init(), gather=False)
    opt = torch.optim.AdamW(list(emb.parameters()) + list(loss_fn.parameters()), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = loss_fn(*emb(batch["images"], batch["input_ids"], batch["attention_mask"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1
    unused = [n for n, p in emb.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused  # DDP would fail on these
    assert not emb.model.logit_scale.requires_grad  # the loss owns the temperature
    out = emb.save_pretrained(tmp_path / "saved")
    back = HFClipEmbedder(out).eval()
    emb.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            back.encode_image(batch["images"]), emb.encode_image(batch["images"])
        )
        plain = transformers.CLIPModel.from_pretrained(out, local_files_only=True)
        ref = plain(
            pixel_values=batch["images"],
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
        )
    torch.testing.assert_close(
        F.normalize(ref.text_embeds, dim=-1),
        emb.encode_text(batch["input_ids"], batch["attention_mask"]),
    )


# ---- VLMs ------------------------------------------------------------------------------------


def test_vlm_collate_and_embeddings(qwen2vl_dir: str) -> None:
    emb = VLMEmbedder(qwen2vl_dir, instruction_doc="Describe the image.").eval()
    collate = HFCollate(
        qwen2vl_dir,
        "vlm",
        max_text_len=16,
        max_visual_tokens=6,
        instruction_doc=emb.instruction_doc,
    )
    batch = collate(_samples(3, negatives=True))
    images = batch["images"]
    # processor/forward contract in transformers 5.x: M-RoPE needs mm_token_type_ids
    assert set(images) == {
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        "mm_token_type_ids",
    }
    counts = batch["visual_tokens"]
    assert counts.dtype == torch.long and (counts <= 6).all() and (counts >= 1).all()
    assert images["mm_token_type_ids"].sum(1).tolist() == counts.tolist()
    assert (images["image_grid_thw"].prod(1) // 4).tolist() == counts.tolist()
    with torch.no_grad():
        img, txt = emb(images, batch["input_ids"], batch["attention_mask"])
        neg = emb.encode_text(batch["neg_ids"], batch["neg_mask"])
    assert img.shape == txt.shape == neg.shape == (3, 32)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    # negative control: without mm_token_type_ids the Qwen2-VL forward refuses image inputs
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        emb.encode_image({k: v for k, v in images.items() if k != "mm_token_type_ids"})


def test_system_instruction_role_renders_qwen3vl_embeddings_layout(qwen2vl_dir: str) -> None:
    """model.instruction_role=system: the instruction is a system message before the user turn
    (Qwen3-VL-Embedding's own prompt: "Represent the user's input." as system, then the image
    and text), where `user` puts it at the head of the user turn's text."""
    kw = {"max_text_len": 16, "instruction_query": "Find it.", "instruction_doc": "Represent it."}
    system = HFCollate(qwen2vl_dir, "vlm", instruction_role="system", **kw)
    user = HFCollate(qwen2vl_dir, "vlm", **kw)
    tok = system._load()["tok"]
    image_token = system._load()["image_token"]

    def chat(sys_text: str, *content: dict) -> str:
        msgs = [{"role": "system", "content": [{"type": "text", "text": sys_text}]}]
        msgs.append({"role": "user", "content": list(content)})
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    ids, mask = system.text_batch(["a red circle"])
    assert tok.decode(ids[0][mask[0].bool()]) == chat(
        "Find it.", {"type": "text", "text": "a red circle"}
    )
    inputs, counts = system.image_batch(_images(1))
    want = chat("Represent it.", {"type": "image"}).replace(
        image_token, image_token * int(counts[0])
    )
    assert tok.decode(inputs["input_ids"][0]) == want
    # negative control: the user layout renders another prompt (its own system default)
    ids_user, _ = user.text_batch(["a red circle"])
    assert "Find it.a red circle" in tok.decode(ids_user[0]) and not torch.equal(ids, ids_user)
    with pytest.raises(ValueError, match="instruction_role"):
        HFCollate(qwen2vl_dir, "vlm", instruction_role="assistant")


@pytest.mark.parametrize("pooling", ["eos", "mean"])
def test_left_and_right_padding_give_the_same_embedding(qwen2vl_dir: str, pooling: str) -> None:
    emb = VLMEmbedder(qwen2vl_dir, pooling=pooling).eval()
    collate = HFCollate(qwen2vl_dir, "vlm")
    tok = collate._load()["tok"]
    texts = ["a cat", "a dog runs on green grass in a blue sky"]
    outs = {}
    for side in ("left", "right"):
        tok.padding_side = side
        ids, mask = collate.text_batch(texts)
        with torch.no_grad():
            outs[side] = emb.encode_text(ids, mask)
        with torch.no_grad():  # the short text alone, unpadded
            alone = emb.encode_text(*collate.text_batch(texts[:1]))
        torch.testing.assert_close(outs[side][0], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["left"], outs["right"], atol=1e-5, rtol=1e-5)


def test_eos_pooling_picks_last_non_pad_token() -> None:
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)  # (B, T, D)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert last_token_pool(hidden, right).flatten().tolist() == [1.0, 7.0]
    assert last_token_pool(hidden, left).flatten().tolist() == [3.0, 7.0]


def test_full_finetune_leaves_no_unused_trainable_parameters(qwen2vl_dir: str) -> None:
    """DDP fails on trainable parameters without a gradient: every one must get one."""
    emb = VLMEmbedder(qwen2vl_dir)
    batch = HFCollate(qwen2vl_dir, "vlm", max_visual_tokens=6)(_samples(2))
    img, txt = emb(batch["images"], batch["input_ids"], batch["attention_mask"])
    InfoNCELoss(gather=False)(img, txt)[0].backward()
    trainable = [n for n, p in emb.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in emb.parameters() if p.requires_grad)
    assert not emb.model.lm_head.weight.requires_grad  # frozen: never used by the embedding
    assert emb.trainable_params < emb.total_params


def test_vlm_lora_trains_only_adapters_and_round_trips(qwen2vl_dir: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    emb = VLMEmbedder(qwen2vl_dir, lora={"r": 4, "alpha": 8, "dropout": 0.0})
    assert 0 < emb.trainable_params < emb.total_params
    assert "trainable" in emb.describe()
    names = [n for n, p in emb.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    before = {n: p.detach().clone() for n, p in emb.named_parameters()}
    batch = HFCollate(qwen2vl_dir, "vlm", max_visual_tokens=6)(_samples(4))
    loss_fn = InfoNCELoss(temperature=0.05, learn_temperature=False, gather=False)
    opt = torch.optim.AdamW([p for p in emb.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(8):
        loss, _ = loss_fn(*emb(batch["images"], batch["input_ids"], batch["attention_mask"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1
    changed = {n for n, p in emb.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)  # the backbone did not move
    emb.eval()
    with torch.no_grad():
        ref = emb.encode_image(batch["images"])
    out = emb.save_pretrained(tmp_path / "merged")
    assert not (out / "adapter_config.json").exists() and (out / "chat_template.jinja").exists()
    back = VLMEmbedder(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back.encode_image(batch["images"]), ref, atol=1e-5, rtol=1e-5)
    plain = transformers.AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    assert type(plain).__name__ == "Qwen2VLForConditionalGeneration"
    adapter = emb.save_pretrained(tmp_path / "adapter", merge_lora=False)
    assert (adapter / "adapter_config.json").exists()


def test_matryoshka_truncation(qwen2vl_dir: str) -> None:
    emb = VLMEmbedder(qwen2vl_dir, matryoshka_dims=[16, 8]).eval()
    x = F.normalize(torch.randn(5, 32), dim=-1)
    prefixes = emb.matryoshka(x)
    assert sorted(prefixes) == [8, 16, 32]
    for d, t in prefixes.items():
        assert t.shape == (5, d)
        torch.testing.assert_close(t.norm(dim=-1), torch.ones(5))
        torch.testing.assert_close(t, F.normalize(x[:, :d], dim=-1))
    assert x[:, :8].norm(dim=-1).max() < 0.99  # the re-normalisation is not a no-op
    with pytest.raises(ValueError, match="matryoshka_dims"):
        VLMEmbedder(qwen2vl_dir, matryoshka_dims=[64])


def test_llava_embeds(llava_dir: str) -> None:
    emb = VLMEmbedder(llava_dir).eval()
    batch = HFCollate(llava_dir, "vlm")(_samples(2))
    assert batch["visual_tokens"].tolist() == [4, 4]  # (16 / 8)^2 patches, CLS dropped
    with torch.no_grad():
        img, txt = emb(batch["images"], batch["input_ids"], batch["attention_mask"])
    assert img.shape == txt.shape == (2, 32)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(2))
    with pytest.raises(ValueError, match="fixed image size"):
        HFCollate(llava_dir, "vlm", max_visual_tokens=4)(_samples(1))


def test_registry_keys() -> None:
    assert EMBEDDERS == {
        "hf_clip": HFClipEmbedder,
        "hf_siglip": HFSiglipEmbedder,
        "vlm": VLMEmbedder,
    }


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_newer_qwen_vl_families_embed_within_budget(family: str, tmp_path: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer("<|vision_start|><|image_pad|><|vision_end|>")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if family == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLForConditionalGeneration
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config={**vision, "window_size": 16, "fullatt_block_indexes": [0]},
            **_qwen_ids(tok),
        )
    else:
        cls = transformers.Qwen3VLForConditionalGeneration
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
        cfg = transformers.Qwen3VLConfig(
            text_config={**text, "head_dim": 16},
            vision_config={
                **vision,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            **_qwen_ids(tok),
        )
    torch.manual_seed(0)
    ip = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096
    )
    path = _save(cls(cfg), tok, ip, tmp_path)
    emb = VLMEmbedder(path).eval()
    batch = HFCollate(path, "vlm", max_visual_tokens=5)(_samples(3))
    assert (batch["visual_tokens"] <= 5).all()
    with torch.no_grad():
        img, txt = emb(batch["images"], batch["input_ids"], batch["attention_mask"])
    assert img.shape == txt.shape == (3, 32)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
