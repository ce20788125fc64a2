"""model=local: what a checkpoint directory's own config.json already says (the task, the position limit) read into
the config before it is validated, and the directory's problems as one line each. Plain JSON, no transformers
import: it runs in config validation, before anything heavy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

# where a config.json keeps its position limit, most specific first (T5's relative positions have none: n_positions)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
)
DEFAULT_POSITIONS = 512


def checkpoint_config(path: str) -> dict[str, Any] | None:
    """The directory's config.json, or None where it has none."""
    file = Path(path) / "config.json"
    return json.loads(file.read_text()) if file.is_file() else None


def task_of(config: dict[str, Any]) -> str:
    """seq2seq for an encoder-decoder checkpoint, else causal."""
    return "seq2seq" if config.get("is_encoder_decoder") or config.get("model_type") == "encoder-decoder" else "causal"


def positions_of(config: dict[str, Any]) -> int:
    """The longest sequence the checkpoint's positions allow (512 where it has no such limit in its config)."""
    decoder = config.get("decoder") if isinstance(config.get("decoder"), dict) else {}
    for source in (config, decoder):
        for key in POSITION_KEYS:
            if isinstance(source.get(key), int) and source[key] > 0:
                return source[key]
    return DEFAULT_POSITIONS


def resolve_local_model(cfg: DictConfig) -> None:
    """Fill model.task=auto and model.max_positions=null from the checkpoint at model.name_or_path (in place; a
    directory without config.json is left for check_local_model to report)."""
    model = cfg.model
    if not model.name_or_path or (model.task != "auto" and model.max_positions is not None):
        return
    config = checkpoint_config(model.name_or_path) if Path(model.name_or_path).is_dir() else None
    if config is None:
        return
    if model.task == "auto":
        model.task = task_of(config)
    if model.max_positions is None:
        model.max_positions = positions_of(config)


def unresolved_problems(model: DictConfig) -> list[str]:
    """Where model.task=auto or model.max_positions=null could not be read from a checkpoint: why, one line each
    (the rest of validation needs them); else nothing."""
    unread = [
        key for key, value in (("task", model.task), ("max_positions", model.max_positions)) if value in ("auto", None)
    ]
    if not unread:
        return []
    if not model.name_or_path:
        return [
            f"model.{unread[0]} is read from a checkpoint's config.json (model=local): set "
            "model.name_or_path=<checkpoint directory>"
        ]
    return check_local_model(model) or [
        f"model.name_or_path={model.name_or_path} is not a directory: give the one save_pretrained() wrote"
    ]


def check_local_model(model: DictConfig) -> list[str]:
    """A checkpoint directory's problems, found without loading it."""
    path = model.name_or_path
    if not path or not Path(path).is_dir():
        return []  # the model checks report a missing path
    problems = []
    if not (Path(path) / "config.json").is_file():
        problems.append(f"model.name_or_path={path} has no config.json: give the directory save_pretrained() wrote")
    if not model.tokenizer and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"model.name_or_path={path} has no tokenizer files: save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(dir)) or set model.tokenizer=<its directory>"
        )
    return problems


def check_vocabulary(model: DictConfig, tokenizer: Any) -> list[str]:
    """A checkpoint whose embedding has fewer rows than its tokenizer has tokens would index past it in training."""
    config = checkpoint_config(model.name_or_path) if model.name_or_path else None
    if not config:
        return []
    vocab = config.get("vocab_size") or (config.get("decoder") or {}).get("vocab_size")
    if isinstance(vocab, int) and vocab < len(tokenizer):
        return [
            f"model.name_or_path={model.name_or_path}: its vocabulary has {vocab} entries but its tokenizer "
            f"{len(tokenizer)}: use the tokenizer saved with these weights (model.tokenizer) or resize the embeddings"
        ]
    return []
