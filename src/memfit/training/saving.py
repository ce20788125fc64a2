"""What a run keeps of what it trained: the model with its tokenizer (a full fine-tune), or the LoRA adapter (and,
with model.lora.merge_on_save, the base model with the adapter merged in), beside memfit.json, which says how the
run was configured and what its memory proof found. Written whole or not at all: into a hidden directory renamed
into place, so a failed write (a full disk) never leaves a directory that looks like a saved model."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("memfit")

MERGED = "merged"  # the merged model's subdirectory, beside the adapter
RECORD = "memfit.json"


@dataclass(frozen=True)
class SavedModel:
    path: Path
    adapter: bool  # a LoRA adapter (load it onto its base model), not a whole model
    merged: Path | None  # the base model with the adapter merged in, where asked for


def _partial(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.partial")


def _write(trainer: Any, into: Path, merge: bool) -> bool:
    """The model (or adapter) and tokenizer into `into`; the merged model under it where asked. True for an adapter."""
    trainer.save_model(str(into))  # a PeftModel saves its adapter; Trainer adds the tokenizer (processing_class)
    (into / "training_args.bin").unlink(missing_ok=True)  # Trainer's pickled arguments: memfit.json says more
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = hasattr(model, "peft_config")
    if adapter and merge:
        merged = model.merge_and_unload()  # the run is over: the adapter's weights go into the base in place
        merged.save_pretrained(str(into / MERGED))
        trainer.processing_class.save_pretrained(str(into / MERGED))
    return adapter


def save_trained(trainer: Any, dest: Path, record: dict[str, Any], merge: bool) -> SavedModel:
    """Save what `trainer` trained at `dest` with `record` as memfit.json; an earlier save there is replaced (said)."""
    partial = _partial(dest)
    shutil.rmtree(partial, ignore_errors=True)  # a write that died before its rename
    partial.mkdir(parents=True)
    try:
        adapter = _write(trainer, partial, merge)
        (partial / RECORD).write_text(json.dumps(record, indent=1, default=str))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if dest.exists():
        log.warning("replacing the model saved earlier at %s (a run of the same name)", dest)
        shutil.rmtree(dest)
    partial.rename(dest)
    return SavedModel(dest, adapter, dest / MERGED if adapter and merge else None)


def load_hint(saved: SavedModel, task: str, base: str | None) -> str:
    """The Python that loads what was saved."""
    auto = "AutoModelForSeq2SeqLM" if task == "seq2seq" else "AutoModelForCausalLM"
    if saved.merged is not None:
        return f"{auto}.from_pretrained('{saved.merged}')"
    if not saved.adapter:
        return f"{auto}.from_pretrained('{saved.path}')"
    base_load = f"{auto}.from_pretrained('{base}')" if base else "<the random-weight base model this run built>"
    return f"PeftModel.from_pretrained({base_load}, '{saved.path}')"
