"""SFT labels of the HF VLM kinds, re-derived independently of the implementation: each
assistant turn's tokens are found by rendering the conversation's prefixes with the model's own
chat template, tokenising each rendering whole and diffing the token counts (what a reader would
do by hand), on a Qwen2-VL-style template (content lists) and a LLaVA-style one (an ``<image>``
line in a text LM's template)."""

from __future__ import annotations

import pytest

from tests.models import vlm_fixtures
from vltrain.data.vlm_caption_data import IGNORE_INDEX, vlm_sft_labels

CHAT = [
    {"role": "user", "content": "what do you see?"},
    {"role": "assistant", "content": "a red cat on a mat"},
    {"role": "user", "content": "is it red?"},
    {"role": "assistant", "content": "yes"},
]


def _conversation(messages, markup):
    out = []
    for i, m in enumerate(messages):
        if markup is None:
            content = ([{"type": "image"}] if i == 0 else []) + [
                {"type": "text", "text": m["content"]}
            ]
        else:
            content = (markup if i == 0 else "") + m["content"]
        out.append({"role": m["role"], "content": content})
    return out


def _by_hand(tok, image_token: str, replacement: str, markup):
    """(ids, labelled positions) from whole renderings of the chat's prefixes."""
    conv = _conversation(CHAT, markup)

    def ids(k: int, gen: bool) -> list[int]:
        text = tok.apply_chat_template(conv[:k], tokenize=False, add_generation_prompt=gen)
        text = text.replace(image_token, replacement)
        return tok(text, add_special_tokens=False)["input_ids"]

    labelled: set[int] = set()
    for i, m in enumerate(CHAT):
        if m["role"] == "assistant":
            labelled |= set(range(len(ids(i, True)), len(ids(i + 1, False))))
    return ids(len(CHAT), False), labelled


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("sft_tok")
    out = {}
    for name in ("qwen2vl", "causal_lm_dir"):
        (root / name).mkdir()
        out[name] = AutoTokenizer.from_pretrained(
            getattr(vlm_fixtures, f"tiny_{name}")(root / name)
        )
    return out


@pytest.mark.parametrize(
    ("name", "image_token", "n", "markup"),
    [("qwen2vl", "<|image_pad|>", 6, None), ("causal_lm_dir", "<image>", 4, "<image>\n")],
)
def test_assistant_mask_equals_the_prefix_rendering_rule(
    tokenizers: dict, name: str, image_token: str, n: int, markup
) -> None:
    tok = tokenizers[name]
    ids, labels = vlm_sft_labels(tok, CHAT, image_token, image_token * n, markup)
    want_ids, labelled = _by_hand(tok, image_token, image_token * n, markup)
    assert ids == want_ids
    assert [i for i, t in enumerate(labels) if t != IGNORE_INDEX] == sorted(labelled)
    assert all(labels[i] == ids[i] for i in labelled)
    # controls: both answers (and only assistant text) are learned; the image never is
    image_id = tok.convert_tokens_to_ids(image_token)
    assert ids.count(image_id) == n and image_id not in labels
    learned = tok.decode([t for t in labels if t != IGNORE_INDEX])
    assert "a red cat on a mat" in learned and "yes" in learned
    assert "what do you see" not in learned and "is it red" not in learned


def test_a_template_that_rewrites_history_is_refused(tokenizers: dict) -> None:
    tok = tokenizers["causal_lm_dir"]
    old = tok.chat_template
    # drops every assistant turn but the last (like templates that strip past reasoning)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' or loop.last %}<|im_start|>"
        "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        with pytest.raises(ValueError, match="prefixes"):
            vlm_sft_labels(tok, CHAT, "<image>", "<image>", "<image>\n")
    finally:
        tok.chat_template = old


def test_ids_are_the_whole_chat_under_a_sentencepiece_style_tokenizer() -> None:
    """LLaVA-NeXT's template writes ``</s> `` after an answer; a Metaspace (Llama / Mistral)
    tokenizer reads ``</s> [INST]`` as ``</s>``, ``▁[INST]``. Tokenising turn by turn gave an
    extra ``▁`` before every later user turn (ids unlike decoding's and transformers'); the
    ids are the whole chat's, and the boundary token is no target."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    kw = {"replacement": "\u2581", "prepend_scheme": "first", "split": True}
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(**kw)
    corpus = [m["content"] for m in CHAT] + ["[INST] q [/INST] a</s> [INST] <image>\n"]
    raw.train_from_iterator(corpus * 20, trainers.BpeTrainer(special_tokens=["</s>", "<image>"]))
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %} {{ m['content'] }}</s> {% endif %}{% endfor %}"
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", chat_template=template)
    ids, labels = vlm_sft_labels(tok, CHAT, "<image>", "<image>" * 3, "<image>\n")
    whole = tok.apply_chat_template(_conversation(CHAT, "<image>\n"), tokenize=False)
    assert (
        ids == tok(whole.replace("<image>", "<image>" * 3), add_special_tokens=False)["input_ids"]
    )
    inst = tok.convert_tokens_to_ids("\u2581[INST]")
    assert ids.count(inst) == 2 and inst not in labels  # the second follows "</s>" directly
    assert ids[ids.index(tok.eos_token_id) + 1] == inst
    learned = "".join(tok.convert_ids_to_tokens([t for t in labels if t != IGNORE_INDEX]))
    assert learned.startswith("\u2581a\u2581red\u2581cat\u2581on\u2581a\u2581mat</s>")
    assert "\u2581yes</s>" in learned and "see" not in learned and "INST" not in learned
