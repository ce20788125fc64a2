"""Data: load source/target pairs, tokenize with truncation of sources AND labels, apply the over-length policy.

Every format is reduced to two text columns, `source` and `target`. For seq2seq, `source` is the encoder
input and `target` the labels. For causal LMs, `source` is the prompt (masked out of the loss) and `target`
the response; a single `text_column` becomes an empty prompt and the whole text as target.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig

from memfit.config import ACLSUM_SECTIONS, ACLSUM_TARGETS, DATA_FORMATS, effective_lengths

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

    from memfit.audit import LengthAudit

LABEL_PAD = -100  # positions the loss ignores


class DataError(ValueError):
    """A problem with the user's data, phrased as one line naming the field and the fix."""


def _file_columns(fmt: str, path: Path) -> list[str]:
    """Column names from the first record or header, without reading the whole file."""
    if fmt == "jsonl":
        with path.open("rb") as fh:
            for raw in fh:
                if raw.strip():
                    return list(json.loads(raw.decode("utf-8")).keys())
        return []
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8") as fh:
            return next(csv.reader(fh), [])
    import pyarrow.parquet as pq

    return list(pq.read_schema(path).names)


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
    except (json.JSONDecodeError, ValueError) as err:
        return [f"{key}={path_str} line 1 is not valid JSON ({err.msg if hasattr(err, 'msg') else err}): fix that line"]
    except Exception as err:  # pyarrow raises its own types for a broken parquet file
        return [f"{key}={path_str} cannot be read as {data.format} ({err}): check the file and data.format"]
    return [
        f"{field}={name!r} is not a column of {path_str} (it has: {', '.join(map(str, columns))}): set {field}"
        for field, name in _required_columns(data, task)
        if name not in columns
    ]


def check_data_source(data: DictConfig, task: str) -> list[str]:
    """Problems with the data settings that can be found without loading the data."""
    if data.format not in DATA_FORMATS:
        return [f"data.format={data.format!r} is not one of {', '.join(DATA_FORMATS)}: pick one"]
    problems: list[str] = []
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
                records.append(json.loads(raw.decode("utf-8")))
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
        with path.open(newline="", encoding="utf-8") as fh:
            return list(csv.DictReader(fh))
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _to_pairs(records: list[dict[str, Any]], data: DictConfig, task: str, where: str) -> list[dict[str, str]]:
    pairs = []
    for index, rec in enumerate(records):
        if task == "causal" and data.text_column:
            source, target = "", rec.get(data.text_column)
        else:
            source, target = rec.get(data.source_column), rec.get(data.target_column)
        if target is None or not str(target).strip():
            column = data.text_column if (task == "causal" and data.text_column) else data.target_column
            raise DataError(f"{where} record {index + 1} has an empty {column!r}: remove it or fill it in")
        pairs.append({"source": "" if source is None else str(source), "target": str(target)})
    return pairs


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


def load_pairs(data: DictConfig, task: str) -> dict[str, list[dict[str, str]]]:
    """Train and validation lists of {source, target}; validation may be empty."""
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


def _cap(pairs: list[dict[str, str]], limit: int | None) -> list[dict[str, str]]:
    return pairs if limit is None else pairs[:limit]


def _truncate(ids: list[int], max_len: int, keep_last: bool) -> list[int]:
    """Cut to max_len; keep the closing special token (EOS/SEP) as the tokenizer's own truncation does."""
    if len(ids) <= max_len:
        return ids
    return ids[: max_len - 1] + ids[-1:] if keep_last and max_len > 1 else ids[:max_len]


@dataclass(frozen=True)
class TokenizeSpec:
    task: str
    max_source_length: int
    max_label_length: int
    overlength: str


def _new_encoding() -> dict[str, list]:
    return {"input_ids": [], "attention_mask": [], "labels": [], "source_len_raw": [], "label_len_raw": []}


def _add(out: dict[str, list], input_ids: list[int], labels: list[int], source_raw: int, label_raw: int) -> None:
    out["input_ids"].append(input_ids)
    out["attention_mask"].append([1] * len(input_ids))
    out["labels"].append(labels)
    out["source_len_raw"].append(source_raw)
    out["label_len_raw"].append(label_raw)


def _encode_seq2seq(batch: dict[str, list[str]], tokenizer: Any, spec: TokenizeSpec) -> dict[str, list]:
    sources = tokenizer(batch["source"], truncation=False)["input_ids"]
    labels = tokenizer(text_target=batch["target"], truncation=False)["input_ids"]
    out = _new_encoding()
    for src, lab in zip(sources, labels, strict=True):
        src_cut = _truncate(src, spec.max_source_length, keep_last=True)
        _add(out, src_cut, _truncate(lab, spec.max_label_length, keep_last=True), len(src), len(lab))
    return out


def _encode_causal(batch: dict[str, list[str]], tokenizer: Any, spec: TokenizeSpec) -> dict[str, list]:
    """prompt + response + EOS as input; the prompt is masked out of the labels."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    prompts = tokenizer(batch["source"], add_special_tokens=False)["input_ids"]
    responses = tokenizer(batch["target"], add_special_tokens=False)["input_ids"]
    out = _new_encoding()
    for prompt, response in zip(prompts, responses, strict=True):
        response = response + [eos]
        prompt_cut = _truncate(prompt, spec.max_source_length, keep_last=False)
        response_cut = _truncate(response, spec.max_label_length, keep_last=True)
        _add(out, prompt_cut + response_cut, [LABEL_PAD] * len(prompt_cut) + response_cut, len(prompt), len(response))
    return out


def _num_proc(rows: int) -> int | None:
    """Worker processes for tokenization: only worth their start-up on large datasets."""
    return min(os.cpu_count() or 1, 8) if rows >= 50_000 else None


def tokenize_split(pairs: list[dict[str, str]], tokenizer: Any, spec: TokenizeSpec) -> Dataset:
    """Tokenize in batches, truncating sources and labels; keep the raw lengths for the audit. Nothing dropped."""
    from datasets import Dataset

    encode = _encode_seq2seq if spec.task == "seq2seq" else _encode_causal
    ds = Dataset.from_list(pairs)
    return ds.map(
        lambda b: encode(b, tokenizer, spec),
        batched=True,
        batch_size=1000,
        remove_columns=["source", "target"],
        num_proc=_num_proc(len(ds)),
        new_fingerprint=_fingerprint(len(ds), tokenizer, spec),
    )


def _fingerprint(rows: int, tokenizer: Any, spec: TokenizeSpec) -> str:
    """A name for the tokenized dataset. `datasets` would otherwise hash the map function, tokenizer and all, by
    pickling it: ~0.3 s a split, paid by every trial. Nothing is cached under it (the dataset is in memory)."""
    key = f"{rows}:{getattr(tokenizer, 'name_or_path', '')}:{len(tokenizer)}:{spec}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def kept_mask(ds: Dataset, spec: TokenizeSpec) -> np.ndarray:
    """Which samples the over-length policy keeps (all of them under `truncate`)."""
    source, label = np.asarray(ds["source_len_raw"]), np.asarray(ds["label_len_raw"])
    if spec.overlength != "drop":
        return np.ones(len(source), dtype=bool)
    return (source <= spec.max_source_length) & (label <= spec.max_label_length)


def apply_overlength(ds: Dataset, spec: TokenizeSpec) -> Dataset:
    mask = kept_mask(ds, spec)
    return ds if mask.all() else ds.select(np.flatnonzero(mask))


@dataclass
class PreparedData:
    """Tokenized splits after the over-length policy, and the length audit of the training split."""

    datasets: DatasetDict
    audit: LengthAudit
    source_raw: np.ndarray
    label_raw: np.ndarray


def load_and_tokenize(cfg: DictConfig, tokenizer: Any) -> PreparedData:
    """The run's train/validation datasets, tokenized under the memory policy's lengths, with their audit."""
    from datasets import DatasetDict
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar

    from memfit.audit import audit_lengths
    from memfit.progress import quiet

    if quiet():  # datasets' own bars show tokenization, quiet under CI like the rest
        disable_progress_bar()
    else:
        enable_progress_bar()
    pairs = load_pairs(cfg.data, cfg.model.task)
    max_source, max_label = effective_lengths(cfg)
    spec = TokenizeSpec(cfg.model.task, max_source, max_label, cfg.memory.overlength)
    train = tokenize_split(_cap(pairs["train"], cfg.data.max_train_samples), tokenizer, spec)
    source_raw, label_raw = np.asarray(train["source_len_raw"]), np.asarray(train["label_len_raw"])
    splits = {"train": apply_overlength(train, spec)}
    eval_lengths = None
    if pairs["validation"]:
        validation = tokenize_split(_cap(pairs["validation"], cfg.data.max_eval_samples), tokenizer, spec)
        splits["validation"] = apply_overlength(validation, spec)
        if cfg.memory.eval_enabled and len(splits["validation"]):
            eval_lengths = (
                np.asarray(splits["validation"]["source_len_raw"]),
                np.asarray(splits["validation"]["label_len_raw"]),
            )
    if len(splits["train"]) == 0:
        raise DataError(
            "memory.overlength=drop dropped every training sample: raise memory.max_source_length/max_label_length"
            " or use memory.overlength=truncate"
        )
    audit = audit_lengths(
        source_raw,
        label_raw,
        kept_mask(train, spec),
        task=cfg.model.task,
        max_source=max_source,
        max_label=max_label,
        batch=cfg.trainer.batch_size,
        multiple=cfg.memory.pad_to_multiple_of,
        sampler="group_by_length" if cfg.memory.group_by_length else "random",
        eval_lengths=eval_lengths,
        eval_batch=cfg.memory.eval_batch_size or cfg.trainer.batch_size,
    )
    return PreparedData(DatasetDict(splits), audit, source_raw, label_raw)


AUDIT_COLUMNS = ("source_len_raw", "label_len_raw")


def model_columns(ds: Dataset) -> Dataset:
    """Only what the model's forward takes (the audit columns are for the length audit alone)."""
    return ds.remove_columns([c for c in AUDIT_COLUMNS if c in ds.column_names])


class CountingCollator:
    """Pads like DataCollatorForSeq2Seq (labels with -100) and counts the real tokens it hands to training.

    Counting here, on CPU lists before the batch reaches the device, costs no GPU synchronisation.
    """

    def __init__(self, tokenizer: Any, pad_to_multiple_of: int | None, task: str = "seq2seq"):
        from transformers import DataCollatorForSeq2Seq

        self.count_labels = task == "seq2seq"  # a causal LM's labels are its own input tokens
        self.inner = DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=LABEL_PAD, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt"
        )
        self.tokens = 0  # real tokens of the batches training has taken (see consume)
        self.counting = True  # off while Trainer evaluates: eval batches go through the same collator
        self.last_shape: dict[str, tuple[int, ...]] = {}  # the batch training took last: what an OOM hit
        self.seen_shapes: set[tuple] = set()  # padded shapes training has taken: a first sight costs warm-up
        self.new_shapes = 0  # micro-batches whose padded shape training had not taken before
        self.padded_tokens = 0  # tokens with padding of the batches training has taken: what the device computed
        self.micro_batches = 0
        # Collated but not yet trained on: the dataloader runs one batch ahead of training (accelerate looks ahead
        # for the end of the data), so counting at collation would count a batch that training never took.
        self._pending: collections.deque = collections.deque()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collate without counting (evaluation), so tokens are training tokens only."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(features)
        if self.counting:
            tokens = sum(len(f["input_ids"]) for f in features)
            padded_tokens = batch["input_ids"].numel()
            if self.count_labels:
                tokens += sum(len(f["labels"]) for f in features)
                padded_tokens += batch["labels"].numel()
            shapes = {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
            self._pending.append((tokens, padded_tokens, shapes))
        return batch

    def consume(self) -> None:
        """Training takes the oldest collated batch (batches are trained in the order they were collated)."""
        if self._pending:
            tokens, padded_tokens, self.last_shape = self._pending.popleft()
            self.tokens += tokens
            self.padded_tokens += padded_tokens
            self.micro_batches += 1
            shape = tuple(sorted(self.last_shape.items()))
            if shape not in self.seen_shapes:
                self.seen_shapes.add(shape)
                self.new_shapes += 1
