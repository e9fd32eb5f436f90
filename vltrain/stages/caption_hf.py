"""The caption stage on Hugging Face VLMs: model kinds ``hf_vlm`` and ``llava``.

`HFCaptionCore` stands beside `vltrain.stages.caption.CaptionCore` (the built-in captioner's)
with the same interface, and `CaptionStage` holds the one its ``model.kind`` names. The model is
`vltrain.models.hf_vlm.HFVLM`, the data `vltrain.data.vlm_caption_data`, the decoding
`vltrain.inference.vlm_captioning`. The run keeps the processor it trains with in
``<run>/processor`` (copied into every checkpoint): the model's own for hf_vlm; for llava the
tower's image processor and the LM's tokenizer with ``<image>`` added.

The load-time rules are `vltrain.stages.caption_hf_checks`.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError, load_yaml
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.core.checkpoint import load_weights, resolve_init
from vltrain.data.loaders import Loader, MapLoader
from vltrain.data.vlm_caption_data import (
    VLMCaptionCollate,
    VLMCaptionDataset,
    load_processor,
    read_vlm_dataset,
)
from vltrain.engine.runtime import RunContext
from vltrain.eval.captions import CaptionEvaluator
from vltrain.inference.vlm_captioning import decode_vlm_captions, end_tokens
from vltrain.inference.vlm_target import vlm_run
from vltrain.models import hf_vlm
from vltrain.models.hf_embedders import copy_processor_files
from vltrain.stages.caption_hf_checks import (
    HF_CAPTION_KINDS,
    check_hf_caption_config,
    llava_options,
    vision_dir,
)

__all__ = ["HF_CAPTION_KINDS", "HFCaptionCore", "check_hf_caption_config", "run_target"]


class HFCaptionCore:
    """`CaptionCore`'s interface for the HF kinds: processor, data, model, evaluation."""

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.out_dir, self.ctx = cfg, out_dir, ctx
        self._eval_sets: dict[str, VLMCaptionDataset] = {}
        self.pin_init: Path | None = None  # rl: the run folder its start is kept in
        self.processor_dir = out_dir / "processor"

    def _model_type(self) -> str:
        if self.cfg.model.kind == "llava":
            return "llava"
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.cfg.model.path, local_files_only=True).model_type

    def _write_processor(self) -> None:
        m, tmp = self.cfg.model, self.out_dir / ".processor.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        init = self.init_ckpt / "processor" if self.init_ckpt is not None else None
        if init is not None and init.is_dir():
            shutil.copytree(init, tmp, dirs_exist_ok=True)
        elif m.kind == "hf_vlm":
            copy_processor_files(m.path, tmp)
            shutil.copy2(Path(m.path) / "config.json", tmp / "config.json")
        else:
            strategy = llava_options(self.cfg)["select_strategy"]
            hf_vlm.save_llava_processor(
                vision_dir(m.vision_path), m.path, self.cfg.data.image_size, strategy, tmp
            )
        tmp.rename(self.processor_dir)

    def prepare(self) -> None:
        """The run's processor folder (this run's, `model.init_from`'s, or new), then the
        collate and the evaluator."""
        self.init_ckpt = resolve_init(self.cfg.model.init_from, self.pin_init, self.ctx.is_main)
        if self.ctx.is_main and not self.processor_dir.is_dir():
            self._write_processor()
        distributed.barrier()
        m, d = self.cfg.model, self.cfg.data
        fmt = "plain" if m.kind == "llava" and self.cfg.caption.mode != "sft" else "chat"
        self.collate = VLMCaptionCollate(
            str(self.processor_dir),
            self._model_type(),
            fmt,
            d.max_text_len,
            d.max_visual_tokens or None,
            image_markup="<image>\n" if m.kind == "llava" else None,
        )
        self.tokenizer = load_processor(str(self.processor_dir), self._model_type())["tokenizer"]
        bs = d.eval_batch_size or d.batch_size
        self.evaluator = CaptionEvaluator(self.collate, self.ctx, bs, self._decode)

    def build_model(self) -> hf_vlm.HFVLM:
        m = self.cfg.model
        if m.kind == "hf_vlm":
            base = hf_vlm.load_hf_vlm(m.path, m.local_files_only)
        else:
            base = self._assemble_llava()
        model = hf_vlm.HFVLM(base, m.kind)
        if self.init_ckpt is not None:  # LoRA goes on after: this run's adapters start fresh
            self._load_init(model)
        if m.lora_r:
            lora = {"r": m.lora_r, "alpha": m.lora_alpha, "dropout": m.lora_dropout}
            model.add_lora({**lora, "target_modules": list(m.lora_targets)})
        model.freeze(m.freeze)
        return model

    def _load_init(self, model: hf_vlm.HFVLM) -> None:
        """`model.init_from`'s weights. A LoRA run's adapters are merged into the base first, so
        this run starts from (and, with LoRA of its own, keeps as its reference) that model."""
        lora = init_lora(self.init_ckpt)
        try:
            if lora:
                model.add_lora(lora)
            load_weights(model, self.init_ckpt)
        except RuntimeError as e:
            raise ConfigError(
                f"model.init_from={self.init_ckpt} does not fit this model ({str(e)[:200]}"
                "...): it must be a caption or rl run of the same model.kind and paths"
            ) from None
        if lora:
            model.merge_lora()

    def _assemble_llava(self) -> nn.Module:
        from transformers import AutoConfig

        m, tok = self.cfg.model, self.tokenizer
        where, kw = hf_vlm.lm_tokenizer_source(m.path)
        opts = llava_options(self.cfg)
        image_id = tok.convert_tokens_to_ids("<image>")
        vis = vision_dir(m.vision_path)
        text = AutoConfig.from_pretrained(where, **kw)
        # the added <image> token may lie past the LM's vocabulary (SmolLM2: 49152 rows, the
        # tokenizer then 49153); an LM padded past its tokenizer keeps its rows
        text.vocab_size = max(text.vocab_size, len(tok))
        config = hf_vlm.llava_config(
            vis,
            text,
            image_id,
            opts["select_strategy"],
            opts["feature_layer"],
        )
        model = hf_vlm.assemble_llava(config, vis, m.path, text.vocab_size)
        gen = model.generation_config
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        gen.eos_token_id = sorted({e for e in eos if e is not None} | {tok.eos_token_id})
        gen.pad_token_id = tok.pad_token_id
        return model

    def dataset(self, path: str, train: bool) -> VLMCaptionDataset:
        c = self.cfg.caption
        return read_vlm_dataset(
            path,
            seed=self.cfg.run.seed,
            mode=c.mode,
            prompt=c.prompt,
            instruction=c.instruction,
            train=train,
        )

    def train_dataset(self, train: bool = True) -> VLMCaptionDataset:
        ds = self.dataset(self.cfg.data.train, train=train)
        if self.cfg.data.max_train_samples:
            ds.records = ds.records[: self.cfg.data.max_train_samples]
        if train:
            self._check_text_lengths(ds)
        return ds

    def _check_text_lengths(self, ds: VLMCaptionDataset) -> None:
        """Before the first step, on the first records: a chat template that cannot label them
        is a ConfigError; answers `data.max_text_len` would cut (their end-of-turn, the turns
        after) are said, with the length that keeps them."""
        try:
            checked, cut, longest = self.collate.text_lengths(ds)
        except ValueError as e:
            raise ConfigError(f"{self.cfg.model.path}: {e}") from None
        if cut and self.ctx.is_main:
            print(
                f"vltrain: {cut} of the first {checked} training samples are longer than "
                f"data.max_text_len={self.cfg.data.max_text_len} text tokens after the image: "
                "their answers lose their end (the end-of-turn the model learns to stop at) "
                f"or later turns; the longest is {longest} (set data.max_text_len={longest} "
                "to keep them whole)",
                file=sys.stderr,
            )

    def loader(self, dataset: VLMCaptionDataset, sampler: Any) -> Loader:
        return MapLoader(
            dataset,
            sampler,
            self.collate,
            num_workers=self.cfg.data.num_workers,
            seed=self.cfg.run.seed,
            pin_memory=self.ctx.device.type == "cuda",
        )

    def checkpoint_files(self) -> dict[str, Path]:
        return {"processor": self.processor_dir}

    def evaluate_decoding(
        self, model: nn.Module, split: str, strategies: dict[str, str]
    ) -> dict[str, float]:
        if split not in self._eval_sets:
            path = self.cfg.data.eval if split == "val" else self.cfg.data.test
            self._eval_sets[split] = self.dataset(path, train=False)
        return self.evaluator.evaluate(model, self._eval_sets[split], strategies)

    def _decode(
        self,
        model: nn.Module,
        images: dict[str, Tensor],
        prompt_ids: list[list[int]],
        strategy: str,
    ) -> list[str]:
        c = self.cfg.caption
        return decode_vlm_captions(
            model,
            self.tokenizer,
            images,
            prompt_ids,
            strategy,
            num_beams=c.num_beams,
            max_new_tokens=c.max_new_tokens,
            length_penalty=c.length_penalty,
        )

    def export_hf(self, model: hf_vlm.HFVLM, out: Path) -> Path:
        """A folder plain transformers loads: the model (LoRA merged) and its processor."""
        self.export_hf_files(out)
        return model.save_pretrained(out)

    def export_hf_files(self, out: Path) -> None:
        """The processor's files (not its config.json: the model's goes beside them)."""
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(self.processor_dir.iterdir()):
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, out / f.name)


def run_target(cfg: Config) -> tuple[nn.Module, str, int | None] | None:
    """A drafter's ``model.target`` that is a caption (or rl) run of kind hf_vlm or llava, as the
    HF-VLM-directory path takes it: the run's transformers model (LoRA merged, in memory, frozen),
    a temporary folder with its processor and config.json (``HFCollate`` reads it) and its
    ``data.max_visual_tokens``; None when the target is a directory."""
    found = vlm_run(cfg.model.target)
    if found is None:
        return None
    ckpt, run_cfg = found
    run_cfg.model.init_from = ""  # the weights are all in the checkpoint
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    core = HFCaptionCore(run_cfg, ckpt, ctx)
    core.prepare()  # reads ckpt/processor (saved with every checkpoint)
    model = core.build_model()
    load_weights(model, ckpt)
    base = model.model.merge_and_unload() if model.lora else model.model
    pad = core.tokenizer.pad_token_id if core.tokenizer.pad_token_id is not None else 0
    base.generation_config.eos_token_id = list(end_tokens(base, pad))  # the stage's end tokens
    folder = tempfile.mkdtemp(prefix="vltrain-target-")
    atexit.register(shutil.rmtree, folder, True)
    core.export_hf_files(Path(folder))
    base.config.save_pretrained(folder)
    return base.requires_grad_(False).eval(), folder, run_cfg.data.max_visual_tokens or None


def owning_config(ckpt: Path) -> dict[str, Any]:
    """The saved config.yaml of the run owning checkpoint folder `ckpt` ({}: none found)."""
    found = (q / "config.yaml" for q in (ckpt, *ckpt.parents[:2]))
    run = next((q for q in found if q.is_file()), None)
    return load_yaml(run) if run is not None else {}


def init_lora(ckpt: Path) -> dict[str, Any] | None:
    """The LoRA settings of the run owning checkpoint folder `ckpt` (None: full weights)."""
    m = owning_config(ckpt).get("model", {})
    if not m.get("lora_r"):
        return None
    lora = {"r": m["lora_r"], "alpha": m.get("lora_alpha", 16.0)}
    lora["dropout"] = m.get("lora_dropout", 0.0)
    return lora | {"target_modules": m["lora_targets"]}
