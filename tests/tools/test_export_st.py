"""`vltrain export --format sentence-transformers`: a tiny random Qwen3-VL run (LoRA, Matryoshka
dims, instructions) trained 2 steps through the CLI, exported, and loaded by the consumer:
``SentenceTransformer(out).encode_query`` / ``encode_document`` of 8 texts and 8 page images equal
`load_run`'s embeddings to <= 1e-5 (skipped where sentence-transformers is not installed).
The files, their contents and the refusal of other model kinds need no sentence-transformers.

bench/st_export_parity.py runs the same check in the bench venv and prints the table recorded in
bench/RESULTS.md."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.conftest import tiny_overrides  # noqa: E402
from tests.fixtures import make_tiny_qwen3vl  # noqa: E402
from vltrain import load_run  # noqa: E402
from vltrain.cli import main  # noqa: E402
from vltrain.data.synth_pages import pages_command  # noqa: E402
from vltrain.tools.export_st import SYSTEM_TO_USER  # noqa: E402

PRESET = Path(__file__).resolve().parents[2] / "configs" / "qwen3vl_embed_pages.yaml"
TOL = 1e-5
DIMS = (8, 16)


def train_tiny_run(root: Path, steps: int = 2, extra: dict[str, object] | None = None) -> Path:
    """The Qwen3-VL-Embedding preset on the tiny model and synthetic pages, `steps` steps
    (`extra`: more overrides)."""
    model = make_tiny_qwen3vl(root / "model")
    pages_command(
        str(root / "pages"),
        n_train=16,
        n_val=4,
        n_test=1,
        seed=0,
        image_size=32,
        negatives=2,
        distractors=4,
    )
    run = root / "run"
    over = tiny_overrides(
        root / "pages",
        run,
        **{
            "data.train": root / "pages" / "train.jsonl",
            "data.eval": "",
            "data.test": "",
            "data.batch_size": 4,
            "data.max_visual_tokens": 0,
            "data.max_text_len": 16,
            "model.kind": "vlm",
            "model.path": model,
            "model.lora_r": 4,
            "model.lora_alpha": 8,
            "model.matryoshka_dims": "[8,16]",
            "objective.hard_negatives": 2,
            "objective.grad_cache_chunk": 2,
            "optim.lr": 1e-2,
            "optim.warmup_steps": 0,
            "run.precision": "fp32",
            "run.threads": 1,
            "train.max_steps": steps,
            "train.save_every": steps,
            "train.best_metric": "",
            **(extra or {}),
        },
    )
    assert main(["train", str(PRESET), *over]) == 0
    return run


def pages_and_queries(root: Path, n: int = 8) -> tuple[list[Path], list[str]]:
    """`n` page images and `n` query texts of the run's training records."""
    rows = [json.loads(line) for line in (root / "pages" / "train.jsonl").read_text().splitlines()]
    images = [root / "pages" / r["positive"]["image"] for r in rows[:n]]
    texts = [r["query"]["text"] for r in rows[:n]]
    return images, texts


@contextlib.contextmanager
def qwen_processor_without_video() -> Iterator[None]:
    """transformers 5.x builds a Qwen-VL processor with a video processor, and every video
    processor needs torchvision (sentence-transformers' `[image]` extra installs it). Without
    torchvision, drop that attribute: text and image inputs never reach it."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        import torchvision  # noqa: F401

        yield
        return
    except ImportError:
        pass
    assert "get_attributes" not in Qwen3VLProcessor.__dict__  # inherited: deleted to restore
    inherited = ProcessorMixin.__dict__["get_attributes"].__func__

    def without_video(cls: type) -> list[str]:
        return [a for a in inherited(cls) if a != "video_processor"]

    Qwen3VLProcessor.get_attributes = classmethod(without_video)
    try:
        yield
    finally:
        del Qwen3VLProcessor.get_attributes


def st_parity(run: Path, out: Path, root: Path) -> dict[str, Any]:
    """Max |sentence-transformers - load_run| per input kind (and per Matryoshka prefix)."""
    from sentence_transformers import SentenceTransformer

    images, texts = pages_and_queries(root)
    trained = load_run(run)
    ref_q = trained.embed_texts(texts, role="query")  # (8, D)
    ref_d = trained.embed_images(images, role="doc")  # (8, D)
    ref_d_other = trained.embed_images(images, role="doc", instruction="Describe the page.")
    from PIL import Image

    pils = [Image.open(p).convert("RGB") for p in images]
    with qwen_processor_without_video():
        st = SentenceTransformer(str(out), device="cpu")
        q = torch.as_tensor(st.encode_query(texts, convert_to_numpy=True))
        d = torch.as_tensor(st.encode_document(pils, convert_to_numpy=True))
        spaced = [f" {t}\n" if i % 2 else f"{t}  " for i, t in enumerate(texts)]
        qs = torch.as_tensor(st.encode_query(spaced, convert_to_numpy=True))
        rows = {
            "texts (encode_query)": (q - ref_q).abs().max().item(),
            "texts with surrounding whitespace (encode_query)": (qs - ref_q).abs().max().item(),
            "page images (encode_document)": (d - ref_d).abs().max().item(),
        }
        for dim in DIMS:
            cut = SentenceTransformer(str(out), device="cpu", truncate_dim=dim)
            qd = torch.as_tensor(cut.encode_query(texts, normalize_embeddings=True))
            want = torch.nn.functional.normalize(ref_q[:, :dim], dim=-1)
            rows[f"texts, truncate_dim={dim}"] = (qd - want).abs().max().item()
    return {
        "rows": rows,
        "dim": int(q.shape[1]),
        # negative controls: vltrain with another instruction, sentence-transformers with none
        "control_other_instruction": (ref_d_other - ref_d).abs().max().item(),
        "control_st_no_prompt": (torch.as_tensor(st.encode(pils)) - ref_d).abs().max().item(),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The instruction at the head of the user turn (the preset's is the system message:
    `test_system_role_instruction_exports_with_the_system_message_kept`)."""
    root = tmp_path_factory.mktemp("st_export")
    return root, train_tiny_run(root, extra={"model.instruction_role": "user"})


@pytest.fixture(scope="module")
def exported(trained: tuple[Path, Path]) -> Path:
    root, run = trained
    out = root / "st"
    assert main(["export", str(run), "--out", str(out), "--format", "sentence-transformers"]) == 0
    return out


@pytest.mark.slow
def test_export_writes_the_sentence_transformers_layout(
    trained: tuple[Path, Path], exported: Path
) -> None:
    modules = json.loads((exported / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    pool = json.loads((exported / "1_Pooling" / "config.json").read_text())
    assert pool == {
        "include_prompt": True,
        "pooling_mode": "lasttoken",
        "word_embedding_dimension": 32,
    }
    st_cfg = json.loads((exported / "config_sentence_transformers.json").read_text())
    cfg = load_run(trained[1]).cfg.model
    assert st_cfg["prompts"] == {"query": cfg.instruction_query, "document": cfg.instruction_doc}
    assert cfg.instruction_query and cfg.instruction_doc  # the preset's: the check is not vacuous
    meta = json.loads((exported / "vltrain_export.json").read_text())
    assert meta["matryoshka_dims"] == list(DIMS) and meta["embedding_dim"] == 32
    assert meta["base_model"] == "model"  # the folder's name, never its absolute path
    assert "truncate_dim" in (exported / "README.md").read_text()
    # LoRA merged: a plain transformers model, no adapter files
    assert not (exported / "adapter_config.json").exists()
    plain = transformers.AutoModelForImageTextToText.from_pretrained(exported)
    assert not any("lora" in k for k in plain.state_dict())
    # one chat template, the wrapped one, which the tokenizer reads
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert tok.chat_template.startswith(SYSTEM_TO_USER)
    assert "chat_template" not in json.loads((exported / "tokenizer_config.json").read_text())
    assert str(exported.parent) not in (exported / "vltrain_export.json").read_text()


@pytest.mark.slow
def test_chat_template_puts_the_system_prompt_where_vltrain_trains_the_instruction(
    trained: tuple[Path, Path], exported: Path
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    original = transformers.AutoTokenizer.from_pretrained(trained[0] / "model").chat_template
    sys_msg = [{"role": "system", "content": [{"type": "text", "text": "INSTR "}]}]

    def render(msgs: list, template: str | None = None) -> str:
        kw = {"chat_template": template} if template else {}
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)

    def user(*content: dict) -> list:
        return [{"role": "user", "content": list(content)}]

    def words(t: str) -> dict:
        return {"type": "text", "text": t}

    image = {"type": "image"}
    # as vltrain's collate builds them: instruction + text; the image, then the instruction
    assert render(sys_msg + user(words("q"))) == render(user(words("INSTR q")), original)
    assert render(sys_msg + user(image)) == render(user(image, words("INSTR ")), original)
    assert render(sys_msg + user(image, words("q"))) == render(
        user(image, words("INSTR q")), original
    )
    assert render(user(words("q"))) == render(user(words("q")), original)  # no system
    # a text stripped as vltrain strips what it reads, with or without a prompt
    assert render(sys_msg + user(words("  q \n"))) == render(user(words("INSTR q")), original)
    assert render(sys_msg + user(image, words(" q\t"))) == render(
        user(image, words("INSTR q")), original
    )
    assert render(user(words(" q\n"))) == render(user(words("q")), original)
    assert render([{"role": "user", "content": "q "}]) == render(user(words("q")), original)
    assert "system" not in render(sys_msg + user(words("q")))


@pytest.mark.parametrize("kind", ["dual_encoder", "hf_clip", "hf_siglip"])
def test_refuses_model_kinds_it_cannot_express(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = "" if kind == "dual_encoder" else f"\n  path: {tmp_path}"
    (run / "config.yaml").write_text(f"stage: contrastive\nmodel:\n  kind: {kind}{path}\n")
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "model.safetensors").write_bytes(b"")
    out = tmp_path / "st"
    step = run / "checkpoints" / "step_1"  # refused before its (empty) weights are read
    rc = main(["export", str(step), "--out", str(out), "--format", "sentence-transformers"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("vltrain: error:") and f"model.kind: {kind}" in err[0]
    assert "vltrain export RUN --out DIR" in err[0] and not out.exists()


@pytest.mark.slow
def test_sentence_transformers_reproduces_load_run(
    trained: tuple[Path, Path], exported: Path
) -> None:
    pytest.importorskip("sentence_transformers")
    root, run = trained
    res = st_parity(run, exported, root)
    assert res["dim"] == 32
    for name, diff in res["rows"].items():
        assert diff <= TOL, (name, diff)
    # the checks can fail: a missing instruction or prompt moves the embeddings far past TOL
    assert res["control_other_instruction"] > 1e-3 and res["control_st_no_prompt"] > 1e-3


@pytest.mark.slow
def test_a_copied_export_still_loads(exported: Path, tmp_path: Path) -> None:
    """No absolute path inside: the folder works after a move."""
    moved = tmp_path / "moved"
    shutil.copytree(exported, moved)
    for f in moved.rglob("*.json"):
        assert str(exported) not in f.read_text(), f


@pytest.mark.slow
def test_system_role_instruction_exports_with_the_system_message_kept(tmp_path: Path) -> None:
    """model.instruction_role=system (Qwen3-VL-Embedding's layout): the export keeps
    sentence-transformers' prompt as the system message (`SYSTEM_KEPT`: texts stripped, the
    system message untouched), and the consumer reproduces load_run where installed."""
    from vltrain.tools.export_st import SYSTEM_KEPT

    run = train_tiny_run(tmp_path, extra={"model.instruction_role": "system"})
    out = tmp_path / "st"
    assert main(["export", str(run), "--out", str(out), "--format", "sentence-transformers"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template.startswith(SYSTEM_KEPT)
    sys_msg = [{"role": "system", "content": [{"type": "text", "text": "INSTR"}]}]
    user = [{"role": "user", "content": [{"type": "text", "text": " q\n"}]}]
    plain = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    got = tok.apply_chat_template(sys_msg + user, tokenize=False, add_generation_prompt=True)
    want = transformers.AutoTokenizer.from_pretrained(tmp_path / "model").apply_chat_template(
        sys_msg + plain, tokenize=False, add_generation_prompt=True
    )
    assert got == want and "INSTR" in got
    if importlib.util.find_spec("sentence_transformers") is None:
        return
    res = st_parity(run, out, tmp_path)
    for name, diff in res["rows"].items():
        assert diff <= TOL, (name, diff)
    assert res["control_other_instruction"] > 1e-3 and res["control_st_no_prompt"] > 1e-3
