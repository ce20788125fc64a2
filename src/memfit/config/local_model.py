"""model=local: what a checkpoint directory's own config.json already says (the task, the position limit) read into
the config before it is validated, and the directory's problems as one line each. Plain JSON, no transformers
import: it runs in config validation, before anything heavy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config.hub import HubError, hub_checkpoint, looks_like_hub_id

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


def local_checkpoint(model: DictConfig) -> str | None:
    """The directory model.name_or_path loads from: itself, or a hub id's snapshot in the Hub's cache (fetched
    where the Hub is reachable: memfit.config.hub). None where there is none (checkpoint_problem says why)."""
    path = model.name_or_path
    if not path or Path(path).is_dir():
        return path or None
    if not looks_like_hub_id(path):
        return None
    try:
        return hub_checkpoint(path, model.revision)
    except HubError:
        return None


def tokenizer_source(model: DictConfig) -> str | None:
    """Where the tokenizer loads from: model.tokenizer (a directory or a hub id), else the checkpoint's own."""
    if model.tokenizer and looks_like_hub_id(model.tokenizer):
        return hub_checkpoint(model.tokenizer, None, "model.tokenizer")
    return model.tokenizer or local_checkpoint(model)


def tokenizer_problem(model: DictConfig, err: Exception) -> str:
    """One line for a tokenizer that does not load from where the config points."""
    field, where = (
        ("model.tokenizer", model.tokenizer) if model.tokenizer else ("model.name_or_path", model.name_or_path)
    )
    first = str(err).splitlines()[0][:200] if str(err) else ""
    return (
        f"{field}={where}: its tokenizer does not load ({type(err).__name__}: {first}): save it again with "
        "tokenizer.save_pretrained(<dir>), or set model.tokenizer=<a directory that has one>"
    )


def checkpoint_problem(model: DictConfig) -> str | None:
    """Why model.name_or_path (or model.tokenizer) gives no checkpoint: one line, or None."""
    for field, name, revision in (
        ("model.name_or_path", model.name_or_path, model.revision),
        ("model.tokenizer", model.tokenizer, None),
    ):
        if not name or Path(name).exists():
            continue
        if not looks_like_hub_id(name):
            return f"{field}={name} does not exist: give a checkpoint directory or a Hugging Face Hub id"
        try:
            hub_checkpoint(name, revision, field)
        except HubError as err:
            return str(err)
    return None


def checkpoint_config(path: str | None) -> dict[str, Any] | None:
    """The directory's config.json, or None where it has none."""
    file = Path(path) / "config.json" if path else None
    if file is None or not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # check_local_model names it
    return config if isinstance(config, dict) else None


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
    config = checkpoint_config(local_checkpoint(model))
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
    if problem := checkpoint_problem(model):
        return [problem]
    return check_local_model(model) or [
        f"model.name_or_path={model.name_or_path} is not a directory: give the one save_pretrained() wrote"
    ]


def check_local_model(model: DictConfig) -> list[str]:
    """A checkpoint directory's problems, found without loading it."""
    path = local_checkpoint(model)
    if not path:
        return []  # checkpoint_problem reports a missing path or hub id
    given = model.name_or_path
    problems = []
    if not (Path(path) / "config.json").is_file():
        problems.append(f"model.name_or_path={given} has no config.json: give the directory save_pretrained() wrote")
    elif checkpoint_config(path) is None:
        problems.append(
            f"model.name_or_path={given}: its config.json is not a JSON object: save the checkpoint again with "
            "save_pretrained()"
        )
    if problem := _headless_problem(given, checkpoint_config(path), model.task):
        problems.append(problem)
    if not model.tokenizer and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"model.name_or_path={given} has no tokenizer files: save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(dir)) or set model.tokenizer=<its directory>"
        )
    return problems


# the class names of checkpoints that carry a language-model head a causal LM trains (Qwen2ForCausalLM,
# GPT2LMHeadModel, Gemma3ForConditionalGeneration)
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _headless_problem(given: str, config: dict[str, Any] | None, task: str) -> str | None:
    """A checkpoint saved without a language-model head (an encoder such as BertModel or BertForMaskedLM) trained
    as a causal LM would get a freshly initialised head, frozen under LoRA: refused. Where config.json lists no
    architectures, nothing is known and nothing is refused."""
    architectures = (config or {}).get("architectures") or []
    if task != "causal" or not architectures or any(a.endswith(CAUSAL_HEADS) for a in architectures):
        return None
    return (
        f"model.name_or_path={given} is a {', '.join(architectures)} checkpoint, with no language-model head for a "
        "causal LM (it would train a random head): give a decoder (...ForCausalLM) or an encoder-decoder checkpoint"
    )


def check_vocabulary(model: DictConfig, tokenizer: Any) -> list[str]:
    """A checkpoint whose embedding has fewer rows than its tokenizer has tokens would index past it in training."""
    config = checkpoint_config(local_checkpoint(model))
    if not config:
        return []
    vocab = config.get("vocab_size") or (config.get("decoder") or {}).get("vocab_size")
    if isinstance(vocab, int) and vocab < len(tokenizer):
        return [
            f"model.name_or_path={model.name_or_path}: its vocabulary has {vocab} entries but its tokenizer "
            f"{len(tokenizer)}: use the tokenizer saved with these weights (model.tokenizer) or resize the embeddings"
        ]
    return []
