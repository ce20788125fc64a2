"""Tokenization: sources AND labels cut to their max lengths, the over-length policy applied, raw lengths kept for
the length audit.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig

from memfit.config import effective_lengths
from memfit.data.collate import LABEL_PAD
from memfit.data.error import DataError
from memfit.data.sources import load_pairs

log = logging.getLogger("memfit")

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

    from memfit.data.audit import LengthAudit


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
    style: str = "pairs"  # data.style: pairs, or a conversation style rendered with chat_template
    chat_template: str | None = None  # the Jinja text conversations are rendered with (memfit.data.chat)


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


def _encode_chat(batch: dict[str, list], tokenizer: Any, spec: TokenizeSpec) -> dict[str, list]:
    """Each conversation rendered with the chat template; labels are the assistant tokens, the rest -100. An
    over-long conversation keeps its start (memfit.data.chat.cut_conversation); `label_len_kept` counts the assistant
    tokens left, for the audit's coverage."""
    from memfit.data.chat import cut_conversation, encode_turns

    out = {**_new_encoding(), "label_len_kept": []}
    for turns in batch["messages"]:
        ids, is_label = encode_turns(tokenizer, turns, spec.chat_template)
        keep = cut_conversation(is_label, spec.max_source_length, spec.max_label_length)
        labels = [token if label else LABEL_PAD for token, label in zip(ids[:keep], is_label[:keep], strict=True)]
        assistant = sum(is_label)
        _add(out, ids[:keep], labels, len(ids) - assistant, assistant)
        out["label_len_kept"].append(sum(is_label[:keep]))
    return out


def _num_proc(rows: int) -> int | None:
    """Worker processes for tokenization: only worth their start-up on large datasets."""
    return min(os.cpu_count() or 1, 8) if rows >= 50_000 else None


def tokenize_split(pairs: list[dict[str, str]], tokenizer: Any, spec: TokenizeSpec) -> Dataset:
    """Tokenize in batches, truncating sources and labels; keep the raw lengths for the audit. Nothing dropped here
    (load_and_tokenize applies memory.overlength and leaves out samples that kept no label)."""
    from datasets import Dataset

    pairs_encode = _encode_seq2seq if spec.task == "seq2seq" else _encode_causal
    encode = _encode_chat if spec.style != "pairs" else pairs_encode
    ds = Dataset.from_list(pairs)
    return ds.map(
        lambda b: encode(b, tokenizer, spec),
        batched=True,
        batch_size=1000,
        remove_columns=ds.column_names,
        num_proc=_num_proc(len(ds)),
        new_fingerprint=_fingerprint(len(ds), tokenizer, spec),
    )


def _tokenized(pairs: list[dict[str, str]], tokenizer: Any, spec: TokenizeSpec, cache: str | None) -> Dataset:
    """tokenize_split, through the tokenized cache (memfit.data.cache) where one is configured."""
    from memfit.data.cache import cached, key

    return cached(cache, key(pairs, tokenizer, spec), lambda: tokenize_split(pairs, tokenizer, spec))


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


def without_unlabelled(ds: Dataset, task: str) -> tuple[Dataset, int]:
    """The split without the samples that kept no label token (a conversation cut before its first assistant turn,
    or one without any): they train nothing but cost their forward and backward passes, and alone in a micro-batch
    their mean loss is 0 / 0, a NaN that only Trainer's screen keeps out of the logged loss. Counted as
    memfit.data.collate.loss_positions counts a batch (a causal LM's first label predicts nothing), here over the
    Arrow column at once. Returns the split and how many samples left it."""
    import pyarrow.compute as pc

    if len(ds) == 0:
        return ds, 0
    column = ds.with_format("arrow")["labels"].combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    labelled = column.flatten().to_numpy(zero_copy_only=False) != LABEL_PAD
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if task == "causal":
        labelled[starts[lengths > 0]] = False
    counts = np.bincount(np.repeat(np.arange(len(lengths)), lengths), weights=labelled, minlength=len(lengths))
    keep = counts > 0
    return (ds, 0) if keep.all() else (ds.select(np.flatnonzero(keep)), int((~keep).sum()))


def _leave_out_unlabelled(splits: dict[str, Dataset], task: str) -> None:
    for name, ds in splits.items():
        splits[name], left = without_unlabelled(ds, task)
        if left:
            log.warning(
                "%d %s sample(s) kept no label token (truncation cut them before their first label, or they have "
                "none): left out, as they would train nothing; raise memory.max_source_length to keep them",
                left, name,
            )  # fmt: skip


def _say_cut_conversations(audit: LengthAudit, spec: TokenizeSpec) -> None:
    """memory.overlength=truncate keeps a long conversation's start: say how many were cut and what they lose."""
    if audit.over_long:
        log.warning(
            "%d conversation(s) longer than memory.max_source_length=%d / max_label_length=%d keep their start "
            "(memory.overlength=truncate): %d of their assistant tokens are not trained",
            audit.over_long, spec.max_source_length, spec.max_label_length, audit.label_lost_truncate,
        )  # fmt: skip


def _style(data: DictConfig, tokenizer: Any) -> tuple[str, str | None]:
    """data.style, and for a conversation style the chat template it renders with."""
    if data.style == "pairs":
        return "pairs", None
    from memfit.data.chat import template_for

    return data.style, template_for(tokenizer, data.chat_template)


@dataclass
class PreparedData:
    """Tokenized splits after the over-length policy, and the length audit of the training split."""

    datasets: DatasetDict
    audit: LengthAudit
    source_raw: np.ndarray
    label_raw: np.ndarray


def _batch_rows(batch_size: int, samples: int) -> int:
    """The most rows a training batch holds: a batch never holds more than there are samples (said)."""
    if batch_size > samples:
        log.warning(
            "trainer.batch_size=%d is more than the %d training samples: every batch holds at most %d rows, and "
            "the audit and preflight size that batch",
            batch_size,
            samples,
            samples,
        )
    return min(batch_size, samples)


def load_and_tokenize(cfg: DictConfig, tokenizer: Any, lengths: tuple[int, int] | None = None) -> PreparedData:
    """The run's train/validation datasets, tokenized under the memory policy's lengths (or `lengths`, the (source,
    label) cut that `auto` lengths came to: memfit.run.auto_lengths), with their audit."""
    from datasets import DatasetDict
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar

    from memfit.data.audit import audit_lengths
    from memfit.progress import quiet

    if quiet():  # datasets' own bars show tokenization, quiet under CI like the rest
        disable_progress_bar()
    else:
        enable_progress_bar()
    pairs = load_pairs(cfg.data, cfg.model.task)
    max_source, max_label = lengths or effective_lengths(cfg)
    spec = TokenizeSpec(cfg.model.task, max_source, max_label, cfg.memory.overlength, *_style(cfg.data, tokenizer))
    train = _tokenized(_cap(pairs["train"], cfg.data.max_train_samples), tokenizer, spec, cfg.data.tokenized_cache)
    source_raw, label_raw = np.asarray(train["source_len_raw"]), np.asarray(train["label_len_raw"])
    splits = {"train": apply_overlength(train, spec)}
    eval_lengths = None
    if pairs["validation"]:
        capped = _cap(pairs["validation"], cfg.data.max_eval_samples)
        validation = _tokenized(capped, tokenizer, spec, cfg.data.tokenized_cache)
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
    _leave_out_unlabelled(splits, cfg.model.task)
    if len(splits["train"]) == 0:
        raise DataError(
            "no training sample kept a label token after truncation: raise memory.max_source_length (a "
            "conversation keeps its start, and the start held no assistant turn)"
        )
    kept_labels = np.asarray(train["label_len_kept"]) if "label_len_kept" in train.column_names else None
    audit = audit_lengths(
        source_raw,
        label_raw,
        kept_mask(train, spec),
        label_kept=kept_labels,
        task=cfg.model.task,
        max_source=max_source,
        max_label=max_label,
        batch=_batch_rows(cfg.trainer.batch_size, len(splits["train"])),
        multiple=cfg.memory.pad_to_multiple_of,
        sampler="group_by_length" if cfg.memory.group_by_length else "random",
        eval_lengths=eval_lengths,
        eval_batch=cfg.memory.eval_batch_size or cfg.trainer.batch_size,
    )
    if spec.style != "pairs" and spec.overlength == "truncate":
        _say_cut_conversations(audit, spec)
    return PreparedData(DatasetDict(splits), audit, source_raw, label_raw)
