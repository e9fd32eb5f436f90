"""A tiny random HF causal LM with a chat-template tokenizer, saved locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures import tiny_causal_lm

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "count to five",
    "name a color",
    "say hello",
    "what is two plus two",
    "list fruits",
    "one two three four five",
    "red green blue",
    "hello there friend",
    "apple pear plum",
]


def tiny_lm(path: Path, arch: str = "llama", layers: int = 4) -> Path:
    """Save a tiny random Llama/Qwen2 + BPE tokenizer (with chat template) under `path`."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        TEXTS * 3,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
        chat_template=CHAT,
    )
    torch.manual_seed(0)
    special = (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id)
    cfg, cls = tiny_causal_lm(arch, len(fast), layers, max_positions=512, special=special)
    cls(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return path
