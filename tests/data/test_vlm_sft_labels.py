"""SFT labels of the HF VLM kinds, re-derived independently of the implementation: TRL trains
assistant tokens as the ``{% generation %}`` blocks of a training variant of the model's chat
template mark them (transformers' ``return_assistant_tokens_mask``). Each case here is a model
template and its training variant, the blocks placed as TRL's training templates place them
(Qwen's ``answer<|im_end|>\\n`` whole; LLaVA-NeXT's `` answer</s>`` with the space before
``[INST]`` outside); vltrain's labels under the plain template equal transformers' mask under
the training one, on byte-level and SentencePiece-style tokenizers, for content-list (VLM) and
string (text-LM, LLaVA kind) templates. The training variant itself gives the same labels."""

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
LIST_BODY = (
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
)
QWEN = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ BODY }}<|im_end|>\n{% endfor %}"
QWEN_GEN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ BODY }}<|im_end|>\n{% endgeneration %}{% else %}{{ BODY }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
)
GEN_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
NEXT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}</s> {% endif %}{% endfor %}"
)
NEXT_GEN = NEXT.replace(" {{ m['content'] }}</s> ", "{% generation %} {{ m['content'] }}</s>")
NEXT_GEN = NEXT_GEN.replace("{% endif %}", "{% endgeneration %} {% endif %}")


def _templates(name: str) -> tuple[str, str]:
    if name == "qwen_list":
        body = LIST_BODY
    elif name == "qwen_text":
        body = "{{ m['content'] }}"
    else:
        return NEXT, NEXT_GEN
    return (
        QWEN.replace("{{ BODY }}", body) + GEN_PROMPT,
        QWEN_GEN.replace("{{ BODY }}", body) + GEN_PROMPT,
    )


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


def _trl_rule(tok, training_template: str, image_token: str, n: int, markup, chat=CHAT):
    """(ids, labelled positions): transformers' assistant mask under the training template,
    each image token then repeated `n` times (as the processor expands it)."""
    out = tok.apply_chat_template(
        _conversation(chat, markup),
        chat_template=training_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    image_id = tok.convert_tokens_to_ids(image_token)
    ids, mask = [], []
    for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True):
        k = n if t == image_id else 1
        ids += [t] * k
        mask += [m] * k
    return ids, {i for i, m in enumerate(mask) if m}


def _metaspace_tokenizer():
    """A SentencePiece-style (Llama / Mistral) tokenizer: spaces are ``▁`` joined to the next
    word, so LLaVA-NeXT's ``</s> [INST]`` reads ``</s>``, ``▁[INST]``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    kw = {"replacement": "\u2581", "prepend_scheme": "first", "split": True}
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(**kw)
    raw.decoder = decoders.Metaspace(**kw)
    corpus = [m["content"] for m in CHAT] + ["[INST] q [/INST] a</s> [INST] <image>\n"]
    raw.train_from_iterator(corpus * 20, trainers.BpeTrainer(special_tokens=["</s>", "<image>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", chat_template=NEXT)


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
    out["metaspace"] = _metaspace_tokenizer()
    return out


CASES = [  # tokenizer, template, image token, visual tokens, image markup
    ("qwen2vl", "qwen_list", "<|image_pad|>", 6, None),
    ("causal_lm_dir", "qwen_text", "<image>", 4, "<image>\n"),
    ("causal_lm_dir", "llava_next", "<image>", 4, "<image>\n"),
    ("metaspace", "llava_next", "<image>", 3, "<image>\n"),
]


@pytest.mark.parametrize(("name", "template", "image_token", "n", "markup"), CASES)
def test_assistant_mask_equals_trl_generation_blocks(
    tokenizers: dict, name: str, template: str, image_token: str, n: int, markup
) -> None:
    tok = tokenizers[name]
    plain, training = _templates(template)
    old = tok.chat_template
    try:
        want_ids, labelled = _trl_rule(tok, training, image_token, n, markup)
        got = {}
        for key, tpl in (("plain", plain), ("training", training)):
            tok.chat_template = tpl
            got[key] = vlm_sft_labels(tok, CHAT, image_token, image_token * n, markup)
    finally:
        tok.chat_template = old
    for ids, labels in got.values():
        assert ids == want_ids
        assert [i for i, t in enumerate(labels) if t != IGNORE_INDEX] == sorted(labelled)
        assert all(labels[i] == ids[i] for i in labelled)
    ids, labels = got["plain"]
    # controls: both answers (and only assistant text) are learned; the image never is
    image_id = tok.convert_tokens_to_ids(image_token)
    assert ids.count(image_id) == n and image_id not in labels
    runs, run = [], []  # the labelled stretches, decoded
    for t in [*labels, IGNORE_INDEX]:
        if t != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs, run = [*runs, tok.decode(run).lstrip(" ")], []
    if template == "llava_next":  # the space after </s> belongs to the next turn, or to none
        assert runs == ["a red cat on a mat</s>", "yes</s>"] and labels[-1] == IGNORE_INDEX
    else:  # Qwen's newline after <|im_end|> is learned, also after the last turn
        assert runs == ["a red cat on a mat<|im_end|>\n", "yes<|im_end|>\n"]


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
    tok = _metaspace_tokenizer()
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


R1_STYLE = (  # DeepSeek-R1-Distill's shape: the generation prompt opens a think block that
    # the rendered assistant turns do not hold
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.mark.parametrize("second", ["yes", "<thin air>"])
def test_a_generation_prompt_the_turn_does_not_repeat_labels_the_answer(
    tokenizers: dict, second: str
) -> None:
    """The answer starts where the generation prompt and the rendered turn part, not at the
    prompt's length (which cut 'a red circle' to 'circle'); an answer that begins as the prompt's
    extra text does ("<thin air>" after "<think>\\n") is labelled whole."""
    tok = tokenizers["causal_lm_dir"]
    chat = [*CHAT[:3], {"role": "assistant", "content": second}]
    old = tok.chat_template
    try:
        tok.chat_template = R1_STYLE
        ids, labels = vlm_sft_labels(tok, chat, "<image>", "<image>" * 2, "<image>\n")
        training = R1_STYLE.replace(
            "{{ m['content'] }}<|im_end|>\n{% endfor %}",
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
            "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}",
        )
        want_ids, labelled = _trl_rule(tok, training, "<image>", 2, "<image>\n", chat)
    finally:
        tok.chat_template = old
    assert ids == want_ids
    assert [i for i, t in enumerate(labels) if t != IGNORE_INDEX] == sorted(labelled)
    learned = tok.decode([t for t in labels if t != IGNORE_INDEX])
    assert learned == f"a red cat on a mat<|im_end|>\n{second}<|im_end|>\n"
