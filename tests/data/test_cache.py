"""Tokenized splits are reused by the next run that reads the same rows with the same tokenizer and lengths."""

from __future__ import annotations

import logging

from memfit.data import load_and_tokenize
from memfit.models import build_tokenizer
from tests.conftest import FAST

REUSED = "tokenized data reused from"


def _prepare(compose_cfg, *overrides: str, tokenizer=None):
    cfg = compose_cfg("model=tiny_seq2seq", *FAST, *overrides)
    return cfg, load_and_tokenize(cfg, tokenizer or build_tokenizer(cfg.model))


def test_a_second_run_reuses_the_tokenized_splits_and_other_lengths_or_tokenizers_do_not(compose_cfg, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="memfit"):
        cfg, first = _prepare(compose_cfg)
        assert REUSED not in caplog.text
        _, again = _prepare(compose_cfg)
    assert caplog.text.count(REUSED) == 2  # train and validation
    for split in ("train", "validation"):
        assert again.datasets[split]["input_ids"] == first.datasets[split]["input_ids"]
        assert again.datasets[split]["labels"] == first.datasets[split]["labels"]
    assert (again.audit.label_coverage, again.audit.max_label_length) == (
        first.audit.label_coverage,
        first.audit.max_label_length,
    )
    cache = tmp_path / "outputs" / "tokenized"
    assert len(list(cache.iterdir())) == 2 and cfg.data.tokenized_cache == str(cache)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memfit"):
        _, shorter = _prepare(compose_cfg, "memory.max_label_length=16")  # other cuts: tokenized again
    assert REUSED not in caplog.text and max(len(x) for x in shorter.datasets["train"]["labels"]) <= 16

    tokenizer = build_tokenizer(cfg.model)
    tokenizer.add_tokens(["<memfit-new-token>"])  # another vocabulary
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memfit"):
        _prepare(compose_cfg, tokenizer=tokenizer)
    assert REUSED not in caplog.text and len(list(cache.iterdir())) == 6


def test_no_cache_is_written_where_it_is_turned_off(compose_cfg, tmp_path):
    _prepare(compose_cfg, "data.tokenized_cache=null")
    assert not (tmp_path / "outputs" / "tokenized").exists()
