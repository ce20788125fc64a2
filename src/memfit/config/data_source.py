"""Checks on the data settings that need no loading: the format, the columns a file has, its encoding.

They run in config validation, before anything heavy is imported, so they read only a file's first record.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from omegaconf import DictConfig

from memfit.config.schema import ACLSUM_SECTIONS, ACLSUM_TARGETS, DATA_FORMATS, DATA_STYLES


def _file_columns(fmt: str, path: Path) -> list[str]:
    """Column names from the first record or header, without reading the whole file."""
    if fmt == "jsonl":
        with path.open("rb") as fh:
            for raw in fh:
                if raw.strip():
                    return list(json.loads(raw.decode("utf-8-sig")).keys())
        return []
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8-sig") as fh:
            return next(csv.reader(fh), [])
    import pyarrow.parquet as pq

    return list(pq.read_schema(path).names)


# the columns each conversation style reads (memfit.data.chat); alpaca's `input` is optional
STYLE_COLUMNS = {
    "messages": ["messages"],
    "prompt_completion": ["prompt", "completion"],
    "alpaca": ["instruction", "output"],
}


def _required_columns(data: DictConfig, task: str) -> list[tuple[str, str]]:
    if task == "causal" and data.text_column:
        return [("data.text_column", data.text_column)]
    return [("data.source_column", data.source_column), ("data.target_column", data.target_column)]


def _check_file(data: DictConfig, task: str, key: str, path_str: str) -> list[str]:
    path = Path(path_str)
    if not path.is_file():
        return [f"{key}={path_str}: no such file: give the path of a {data.format} file"]
    if path.stat().st_size == 0:
        return [f"{key}={path_str} is empty: give a {data.format} file with at least one record"]
    try:
        columns = _file_columns(data.format, path)
    except UnicodeDecodeError:
        return [f"{key}={path_str} is not UTF-8 text: re-encode it as UTF-8"]
    except json.JSONDecodeError as err:
        return [f"{key}={path_str} line 1 is not valid JSON ({err.msg}): fix that line"]
    except Exception as err:  # pyarrow's own types (its ArrowInvalid is a ValueError) for a file that is not parquet
        return [f"{key}={path_str} cannot be read as {data.format} ({err}): check the file and data.format"]
    have = ", ".join(map(str, columns))
    if data.style in STYLE_COLUMNS:
        missing = ", ".join(repr(c) for c in STYLE_COLUMNS[data.style] if c not in columns)
        return (
            [
                f"data.style={data.style} needs column {missing}, not in {path_str} (it has: {have}): rename"
                " the columns or set data.style"
            ]
            if missing
            else []
        )
    return [
        f"{field}={name!r} is not a column of {path_str} (it has: {have}): set {field}"
        for field, name in _required_columns(data, task)
        if name not in columns
    ]


def _check_style(data: DictConfig, task: str) -> list[str]:
    if data.style not in DATA_STYLES:
        return [f"data.style={data.style!r} is not one of {', '.join(DATA_STYLES)}: pick one"]
    if data.style == "pairs":
        return []
    if task != "causal":
        return [
            f"data.style={data.style} renders conversations for a causal LM: use data.style=pairs (source/target "
            "columns) with a seq2seq model"
        ]
    if data.format == "aclsum":
        return [f"data.style={data.style} reads your own records: use data=jsonl, parquet or hub"]
    return []


def check_data_source(data: DictConfig, task: str) -> list[str]:
    """Problems with the data settings that can be found without loading the data."""
    if data.format not in DATA_FORMATS:
        return [f"data.format={data.format!r} is not one of {', '.join(DATA_FORMATS)}: pick one"]
    problems = _check_style(data, task)
    if not 0 <= data.validation_fraction < 1:
        problems.append(f"data.validation_fraction={data.validation_fraction} must be in [0, 1): use e.g. 0.1")
    for key in ("max_train_samples", "max_eval_samples"):
        if data[key] is not None and data[key] <= 0:
            problems.append(f"data.{key}={data[key]} must be > 0: use a positive count or null")
    if data.format == "aclsum":
        problems += [
            f"data.source_sections has {s!r}: ACLSum sections are {', '.join(ACLSUM_SECTIONS)}"
            for s in data.source_sections
            if s not in ACLSUM_SECTIONS
        ]
        problems += [
            f"data.targets has {t!r}: ACLSum targets are {', '.join(ACLSUM_TARGETS)}"
            for t in data.targets
            if t not in ACLSUM_TARGETS
        ]
        if not data.source_sections or not data.targets:
            problems.append("data.source_sections and data.targets must each name at least one ACLSum field")
    elif data.format == "hub":
        if not data.hub_id:
            problems.append("data.hub_id is empty: give a datasets hub id such as 'org/name'")
    elif not data.path:
        problems.append(f"data.path is empty but data.format={data.format}: set data.path=<your {data.format} file>")
    else:
        problems += _check_file(data, task, "data.path", data.path)
        if data.validation_path:
            problems += _check_file(data, task, "data.validation_path", data.validation_path)
    return problems
