"""Data sources: read the user's records (the shipped ACLSum, JSONL, CSV, Parquet, a hub dataset) into
source/target pairs, with errors that name the field and the line.

Under data.style=pairs every format is reduced to two text columns, `source` and `target`. For seq2seq, `source`
is the encoder input and `target` the labels. For causal LMs, `source` is the prompt (masked out of the loss) and
`target` the response; a single `text_column` becomes an empty prompt and the whole text as target. Under the chat
styles (messages, prompt_completion, alpaca) each record becomes {messages: turns} (memfit.data.chat).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.data.error import DataError


def _aclsum_pairs(data: DictConfig, split: str) -> list[dict[str, str]]:
    from aclsum import ACLSum

    pairs = []
    for doc in ACLSum(split).documents:
        for target in data.targets:
            sections = [s for s in data.source_sections if s != target]
            source = " ".join(sent for s in sections for sent in doc.sentences[s])
            summary = " ".join(doc.sentences["abstract"]) if target == "abstract" else doc.summaries[target]
            prefix = "" if len(data.targets) == 1 else f"{target}: "
            pairs.append({"source": prefix + source, "target": summary})
    return pairs


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSONL with the line number of the first malformed line in the error."""
    records = []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                records.append(json.loads(raw.decode("utf-8-sig")))  # a BOM, as Windows editors write
            except UnicodeDecodeError:
                raise DataError(f"data.path={path} line {number} is not UTF-8: re-encode the file as UTF-8") from None
            except json.JSONDecodeError as err:
                raise DataError(
                    f"data.path={path} line {number} is not valid JSON ({err.msg}): fix that line"
                ) from None
    return records


def _read_table(fmt: str, path: Path) -> list[dict[str, Any]]:
    if fmt == "jsonl":
        return _read_jsonl(path)
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8-sig") as fh:  # a BOM, as Windows editors write
            return list(csv.DictReader(fh))
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _to_pairs(records: list[dict[str, Any]], data: DictConfig, task: str, where: str) -> list[dict[str, Any]]:
    if data.style != "pairs":  # conversations: {messages: turns}, rendered at tokenization (memfit.data.chat)
        from memfit.data.chat import record_turns

        return [{"messages": record_turns(rec, data.style, f"{where} record {i + 1}")} for i, rec in enumerate(records)]
    text_only = task == "causal" and bool(data.text_column)
    target_column = data.text_column if text_only else data.target_column
    pairs = []
    for index, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise DataError(
                f"{where} record {index + 1} is {_type_name(rec)}, not an object of fields: write one JSON object "
                "per line"
            )
        source = None if text_only else _text(rec, data.source_column, where, index)
        target = _text(rec, target_column, where, index)
        if target is None or not target.strip():
            raise DataError(f"{where} record {index + 1} has an empty {target_column!r}: remove it or fill it in")
        pairs.append({"source": source or "", "target": target})
    return pairs


def _type_name(value: Any) -> str:
    """'a list', 'an object': a JSON value's type as the error says it."""
    return {list: "a list", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _text(record: dict[str, Any], column: str, where: str, index: int) -> str | None:
    """The record's field as text; None where it is absent or null. Any other type is refused: a list or a number
    written as its Python text would train on brackets and quotes without a word."""
    value = record.get(column)
    if value is None or isinstance(value, str):
        return value
    fix = "join its parts into one string" if isinstance(value, list) else "write it as a string"
    raise DataError(
        f"{where} record {index + 1} field {column!r} is {_type_name(value)}, not text: {fix} (or set "
        "data.source_column/data.target_column to a text field)"
    )


def _hub_split(data: DictConfig, task: str, split: str) -> list[dict[str, str]] | None:
    from datasets import load_dataset

    try:
        ds = load_dataset(data.hub_id, data.hub_config, split=split)
    except ValueError:
        return None  # the split does not exist
    except OSError as err:  # unreachable hub, offline mode, unknown id
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(
            f"data.hub_id={data.hub_id} cannot be loaded ({first}): check the id and the network "
            "(HF_HUB_OFFLINE), or save the data to a file and use data=jsonl|csv|parquet"
        ) from None
    return _to_pairs(list(ds), data, task, f"data.hub_id={data.hub_id} split {split}")


def load_pairs(data: DictConfig, task: str) -> dict[str, list[dict[str, Any]]]:
    """Train and validation lists of {source, target} (or {messages} under a chat style); validation may be empty."""
    if data.format == "aclsum":
        return {"train": _aclsum_pairs(data, "train"), "validation": _aclsum_pairs(data, "val")}
    if data.format == "hub":
        train = _hub_split(data, task, "train") or []
        validation = _hub_split(data, task, "validation") or []
    else:
        train = _to_pairs(_read_table(data.format, Path(data.path)), data, task, f"data.path={data.path}")
        validation = []
        if data.validation_path:
            rows = _read_table(data.format, Path(data.validation_path))
            validation = _to_pairs(rows, data, task, f"data.validation_path={data.validation_path}")
    if not train:
        raise DataError(f"the training data of data={data.name} has no records: check data.path or data.hub_id")
    if not validation and data.validation_fraction > 0 and len(train) >= 10:
        import random

        shuffled = train[:]
        random.Random(0).shuffle(shuffled)
        cut = max(1, int(len(train) * data.validation_fraction))
        validation, train = shuffled[:cut], shuffled[cut:]
    return {"train": train, "validation": validation}
