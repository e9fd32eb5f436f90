"""vltrain's rl advantages (grpo, rloo) against TRL's own trainers on identical rewards.

TRL computes advantages inline in ``GRPOTrainer._generate_and_score_completions`` and
``RLOOTrainer._generate_and_score_completions`` (no standalone function), so this script builds
each trainer around a tiny random causal LM and calls that method: the model generates two
tokens per completion, and a reward function hands back preset rewards by row index, so TRL's
advantage code runs on exactly the rewards given to ``vltrain.objectives.reinforce.advantages``.
Every case is compared bit for bit and the mismatching elements are counted; ``control`` counts
the mismatches of a near-miss formula (biased std, RLOO vs. mean-centred), which must be > 0.

Runs in a venv where TRL installs (not vltrain's; the checkout goes on sys.path):

    python3 -m venv venv-trl
    venv-trl/bin/pip install -c .ci/constraints.txt torch==2.13.0 'trl==1.16.*'
    venv-trl/bin/python bench/trl_advantage_parity.py

Cases: K in {2, 3, 4, 8, 16}, 1 to 4 images per call, rewards uniform in [0, 3) (CIDEr-D's
range), rounded to halves (many ties), groups of equal rewards, and K=2 pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vltrain

import torch

VOCAB = ["<pad>", "<s>", "</s>", *[f"w{i}" for i in range(29)]]


def tiny_lm_and_tokenizer():
    """A 2-layer random Llama (width 32) and a word-level tokenizer over VOCAB."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg), fast


class PresetRewards:
    """A TRL reward function returning ``values[idx]`` for each completion's ``idx`` column."""

    __name__ = "preset"

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, prompts, completions, completion_ids, idx, **kwargs) -> list[float]:
        return [self.values[i] for i in idx]


def trl_trainer(kind: str, k: int, scale: str, out: str, rewards: PresetRewards):
    """A GRPOTrainer (scale_rewards=scale) or RLOOTrainer for K generations per prompt."""
    import trl
    from datasets import Dataset

    model, tok = tiny_lm_and_tokenizer()
    common = dict(
        output_dir=out,
        per_device_train_batch_size=4 * k,
        num_generations=k,
        max_completion_length=2,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        beta=0.0,
        seed=0,
    )
    data = Dataset.from_dict({"prompt": ["w1 w2"] * 4, "idx": list(range(4))})
    if kind == "grpo":
        args = trl.GRPOConfig(scale_rewards=scale, **common)
        cls = trl.GRPOTrainer
    else:
        args = trl.RLOOConfig(**common)  # normalize_advantages=False, the default
        cls = trl.RLOOTrainer
    return cls(
        model=model, reward_funcs=[rewards], args=args, train_dataset=data, processing_class=tok
    )


def reward_sets(k: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    sets = []
    for b in (1, 4):
        r = torch.rand(b * k, generator=gen) * 3.0
        sets.append((f"uniform B={b}", r))
        sets.append((f"ties B={b}", torch.round(r * 2) / 2))
    tied = torch.rand(4, generator=gen).repeat_interleave(k)  # every group one value
    sets.append(("equal groups B=4", tied))
    return sets


def control(kind: str, scale: str, r: torch.Tensor, k: int) -> torch.Tensor:
    """A near miss of each formula (negative control: the comparison must be able to fail):
    grpo/group with the biased std, grpo/none as RLOO, rloo centred on the group mean."""
    g = r.view(-1, k)
    centred = (g - g.mean(1, keepdim=True)).reshape(-1)
    if kind == "grpo" and scale == "group":
        return centred / (g.std(1, correction=0).repeat_interleave(k) + 1e-4)
    if kind == "grpo":
        return centred * k / (k - 1)
    return centred


def trl_advantages(trainer, rewards: PresetRewards, r: torch.Tensor, k: int) -> torch.Tensor:
    rewards.values = r.tolist()  # float32 values: TRL's torch.tensor(..., float32) is exact
    inputs = [{"prompt": "w1 w2", "idx": i} for i in range(r.numel())]  # groups of K rows
    trainer.model.train()
    return trainer._generate_and_score_completions(inputs)["advantages"].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,3,4,8,16", help="group sizes K")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    opts = parser.parse_args()

    import transformers
    import trl

    from vltrain.objectives.reinforce import advantages, build_baseline

    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for kind, scale in (("grpo", "group"), ("grpo", "none"), ("rloo", "")):
            n_cases = n_values = n_bad = n_control = 0
            max_diff = 0.0
            for k in (int(x) for x in opts.ks.split(",")):
                preset = PresetRewards()
                trainer = trl_trainer(kind, k, scale, tmp, preset)
                for _, r in reward_sets(k, gen):
                    theirs = trl_advantages(trainer, preset, r, k)
                    kwargs = {"scale": scale} if kind == "grpo" else {}
                    ours = advantages(r, k, build_baseline(kind, **kwargs))
                    n_cases += 1
                    n_values += r.numel()
                    n_bad += int((ours != theirs).sum())
                    n_control += int((control(kind, scale, r, k) != theirs).sum())
                    max_diff = max(max_diff, float((ours - theirs).abs().max()))
            label = f"{kind} (scale_rewards={scale})" if kind == "grpo" else "rloo"
            rows.append(
                {
                    "baseline": label,
                    "cases": n_cases,
                    "values": n_values,
                    "mismatches": n_bad,
                    "control_mismatches": n_control,
                    "max_abs_diff": max_diff,
                }
            )
    meta = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "ks": opts.ks,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(meta))
    print("| baseline | cases | advantages | mismatches (bitwise) | max abs diff | control |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['baseline']} | {r['cases']} | {r['values']} | {r['mismatches']} | "
            f"{r['max_abs_diff']:.1e} | {r['control_mismatches']} |"
        )
    if opts.json:
        opts.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if any(r["mismatches"] or not r["control_mismatches"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
