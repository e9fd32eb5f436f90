"""Several EOS ids: a generation config may list more than one (Qwen2-VL-Instruct's
``[151645, 151643]``) and HF ``generate`` ends a row at any of them. On a tiny random Qwen2-VL
whose config lists ``[a, b]``, both tokens it emits greedily and ``b`` reached first in some
row, the decoder loop equals HF ``generate`` token for token (greedy, beam, sampling under
the same seed), speculative decoding (chain and tree) equals greedy, and ``vltrain generate``
writes HF's captions. A loop that stopped only at the first id ran those rows on to ``a``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.inference import spec_helpers, vlm_helpers  # noqa: E402
from vltrain.cli import main  # noqa: E402
from vltrain.data.hf_collate import HFCollate  # noqa: E402
from vltrain.inference import speculative  # noqa: E402
from vltrain.inference.decoding import generate  # noqa: E402
from vltrain.inference.vlm_target import HFVLMTarget, load_hf_vlm, vlm_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MAX_NEW, PAD, PROMPT = 10, vlm_helpers.PAD, "What is it?"
SAMPLING = dict(temperature=1.2, top_k=30, top_p=0.95)


def _pick_ids(rows: list[list[int]]) -> tuple[int, int, int]:
    """(a, b, row): two tokens of the free-running greedy rows, b first reached in `row`
    (at position >= 1) and a later in it, neither the pad nor seen earlier in that row."""
    for r, row in enumerate(rows):
        for p in range(1, len(row)):
            for q in range(p + 1, len(row)):
                a, b = row[q], row[p]
                if a != b and PAD not in (a, b) and b not in row[:p] and a not in row[:q]:
                    return a, b, r
    raise AssertionError(f"no two distinct tokens to stop at in {rows}")


@pytest.fixture(scope="module")
def two_eos(tmp_path_factory) -> dict:
    """The model directory (its generation config listing [a, b]), the model loaded back, the
    image files and their left-padded inputs (`vltrain generate`'s, prompts of other lengths)."""
    root = tmp_path_factory.mktemp("two_eos")
    path = vlm_helpers.make_tiny_qwen2vl(root / "model")
    files = vlm_helpers.image_files(root)
    from PIL import Image

    inputs = vlm_inputs(HFCollate(path, "vlm"), [Image.open(f) for f in files], PROMPT)
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 1
    model = load_hf_vlm(path)
    free = generate(HFVLMTarget(model, eos_token_id=-1), inputs, max_new_tokens=MAX_NEW)
    a, b, row = _pick_ids(free.sequences.tolist())
    cfg_file = Path(path) / "generation_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("_from_model_config", None)  # a hub model's own config, as Qwen2-VL-Instruct's
    cfg_file.write_text(json.dumps({**cfg, "eos_token_id": [a, b], "pad_token_id": PAD}))
    return {"path": path, "model": load_hf_vlm(path), "files": files, "inputs": inputs} | {
        "a": a,
        "b": b,
        "row": row,
    }


def _hf(model, inputs: dict, **kw) -> torch.Tensor:
    """HF generate's new tokens, what follows each row's first stop id set to PAD: HF fills
    finished beams with `pad_token_id or eos_token_id[0]` (eos_token_id[0] when pad is 0, as
    here), vltrain with the pad; only the filler differs, which this normalises."""
    new = model.generate(**inputs, max_new_tokens=MAX_NEW, **kw)[:, inputs["input_ids"].shape[1] :]
    stopped = torch.isin(new, torch.tensor(model.generation_config.eos_token_id))
    return new.masked_fill(stopped.int().cumsum(1) - stopped.int() > 0, PAD)


def test_the_loop_stops_at_either_id_as_hf_generate(two_eos: dict) -> None:
    model, inputs, a, b, r = (two_eos[k] for k in ("model", "inputs", "a", "b", "row"))
    assert model.generation_config.eos_token_id == [a, b]
    target = HFVLMTarget(model)
    assert target.eos_token_ids == (a, b) and target.eos_token_id == a
    greedy = generate(target, inputs, "greedy", max_new_tokens=MAX_NEW)
    assert torch.equal(greedy.sequences, _hf(model, inputs, do_sample=False))
    n = int(greedy.lengths[r])
    assert greedy.sequences[r, n - 1] == b and n < MAX_NEW  # the second id ended the row
    # the first id alone runs that row on (what a one-id loop did): not a vacuous test
    first_only = generate(HFVLMTarget(model, eos_token_id=a), inputs, max_new_tokens=MAX_NEW)
    assert int(first_only.lengths[r]) > n
    beam = generate(target, inputs, "beam", max_new_tokens=MAX_NEW, num_beams=3)
    ref = model.generate(
        **inputs,
        max_new_tokens=MAX_NEW,
        num_beams=3,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert torch.equal(beam.sequences, _hf(model, inputs, num_beams=3))
    torch.testing.assert_close(beam.scores, ref.sequences_scores, rtol=0, atol=1e-5)
    assert bool((beam.sequences == b).any())  # a beam ended on the second id
    torch.manual_seed(7)
    sample = generate(target, inputs, "sample", max_new_tokens=MAX_NEW, **SAMPLING)
    torch.manual_seed(7)
    assert torch.equal(sample.sequences, _hf(model, inputs, do_sample=True, **SAMPLING))


@pytest.mark.parametrize("budget", [0, 4])
def test_speculative_decoding_stops_at_either_id_losslessly(
    two_eos: dict, budget: int, monkeypatch
) -> None:
    """A random drafter, then an oracle that proposes the greedy continuation (accepted paths
    run through the stop id, and the row must end there): chain and tree equal greedy."""
    model, inputs, b, r = (two_eos[k] for k in ("model", "inputs", "b", "row"))
    target = HFVLMTarget(model, [0, 1])
    ref = spec_helpers.greedy_reference(target, inputs, MAX_NEW)
    assert ref[r][-1] == b
    drafter = spec_helpers.random_drafter(target)
    out, _ = speculative.speculative_generate(target, drafter, inputs, MAX_NEW, budget)
    assert out == ref
    _, cache, _ = target.prefill(**inputs)
    first = target.next_positions(cache).tolist()
    free = generate(HFVLMTarget(model, eos_token_id=-1), inputs, max_new_tokens=MAX_NEW)
    oracle = spec_helpers.oracle_draft(free.sequences.tolist(), first, target.vocab_size, 1.0)
    monkeypatch.setattr(speculative, "_draft", oracle)
    out, stats = speculative.speculative_generate(target, drafter, inputs, MAX_NEW, budget)
    assert out == ref and stats.tau > 1.5


def test_vltrain_generate_writes_hf_captions(two_eos: dict, capsys) -> None:
    path, files, model, inputs = (two_eos[k] for k in ("path", "files", "model", "inputs"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    base = ["generate", "--model", path, "--images", *files, "--prompt", PROMPT]
    base += ["--max-new-tokens", str(MAX_NEW)]

    def captions(*more: str) -> list[str]:
        assert main([*base, *more]) == 0
        return [json.loads(x)["caption"] for x in capsys.readouterr().out.splitlines()]

    def hf(**kw) -> list[str]:
        return [
            c.strip() for c in tok.batch_decode(_hf(model, inputs, **kw), skip_special_tokens=True)
        ]

    greedy = hf(do_sample=False)
    assert captions() == greedy
    cut = tok.decode([two_eos["b"]])
    assert greedy[two_eos["row"]].endswith(cut.strip())  # the row ended on the second id
    assert captions("--strategy", "beam", "--beams", "3") == hf(num_beams=3)
    torch.manual_seed(5)
    want = hf(do_sample=True, **SAMPLING)
    flags = ["--temperature", "1.2", "--top-k", "30", "--top-p", "0.95", "--seed", "5"]
    assert captions("--strategy", "sample", *flags) == want
