"""Tokenization truncates labels as well as sources; the over-length policy drops or truncates as configured."""

from __future__ import annotations

import pytest

from memfit.data import LABEL_PAD, CountingCollator, DataError, TokenizeSpec, load_and_tokenize, load_pairs
from memfit.data.tokenize import apply_overlength, tokenize_split
from memfit.models import build_tokenizer
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def tokenizer():
    from omegaconf import OmegaConf

    return build_tokenizer(OmegaConf.create({"tokenizer": None, "name_or_path": None, "source": "random"}))


def test_labels_are_truncated_as_well_as_sources(tokenizer):
    pairs = [{"source": "word " * 300, "target": "label " * 200}]
    ds = tokenize_split(pairs, tokenizer, TokenizeSpec("seq2seq", 64, 16, "truncate"))
    row = ds[0]
    assert len(row["input_ids"]) == 64
    assert len(row["labels"]) == 16
    assert row["labels"][-1] == tokenizer.sep_token_id  # the closing token survives truncation
    assert row["source_len_raw"] == 302 and row["label_len_raw"] == 202  # raw lengths kept for the audit


def test_drop_policy_removes_over_long_samples(tokenizer):
    pairs = [
        {"source": "a b", "target": "c"},
        {"source": "a b", "target": "x " * 50},
        {"source": "w " * 90, "target": "c"},
    ]
    spec = TokenizeSpec("seq2seq", 32, 16, "drop")
    kept = apply_overlength(tokenize_split(pairs, tokenizer, spec), spec)
    assert len(kept) == 1
    spec = TokenizeSpec("seq2seq", 32, 16, "truncate")
    truncated = apply_overlength(tokenize_split(pairs, tokenizer, spec), spec)
    assert len(truncated) == 3
    assert max(len(r["labels"]) for r in truncated) == 16


def test_causal_prompt_is_masked_and_response_truncated(tokenizer):
    pairs = [{"source": "question " * 10, "target": "answer " * 40}]
    row = tokenize_split(pairs, tokenizer, TokenizeSpec("causal", 8, 12, "truncate"))[0]
    assert len(row["input_ids"]) == 8 + 12
    assert row["labels"][:8] == [LABEL_PAD] * 8
    assert row["labels"][8:] == row["input_ids"][8:]
    assert row["input_ids"][-1] == tokenizer.sep_token_id  # EOS kept at the end of a cut response


def test_collator_pads_labels_with_ignore_index_and_counts_tokens(tokenizer):
    pairs = [{"source": "a b c d", "target": "e"}, {"source": "a", "target": "e f g h i"}]
    ds = tokenize_split(pairs, tokenizer, TokenizeSpec("seq2seq", 64, 64, "truncate"))
    collator = CountingCollator(tokenizer, pad_to_multiple_of=8)
    batch = collator([{k: ds[i][k] for k in ("input_ids", "attention_mask", "labels")} for i in range(2)])
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].shape == (2, 8)
    assert (batch["labels"][0] == LABEL_PAD).sum() == 8 - 3
    assert collator.tokens == 0  # collated is not trained: the dataloader runs a batch ahead of training
    with collator.paused():  # an evaluation batch is never counted
        collator([{k: ds[0][k] for k in ("input_ids", "attention_mask", "labels")}])
    collator.consume()
    assert collator.tokens == (6 + 3) + (3 + 7) and collator.last_shape["input_ids"] == (2, 8)
    collator.consume()  # nothing else was collated for training
    assert collator.tokens == (6 + 3) + (3 + 7)


def test_aclsum_gives_real_pairs(compose_cfg):
    cfg = compose_cfg()
    pairs = load_pairs(cfg.data, "seq2seq")
    assert len(pairs["train"]) == 300 and len(pairs["validation"]) == 150  # 100 + 50 papers × 3 aspects
    assert pairs["train"][0]["source"].startswith("challenge: ")
    assert len(pairs["train"][0]["target"].split()) > 5


def test_jsonl_with_causal_text_column(compose_cfg, tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"sample {i} " * 5} for i in range(20)])
    cfg = compose_cfg("model=tiny_causal", "data=jsonl", f"data.path={path}", "data.text_column=text")
    ds = load_and_tokenize(cfg, tokenizer).datasets
    assert len(ds["train"]) == 18 and len(ds["validation"]) == 2
    assert all(label != LABEL_PAD for label in ds["train"][0]["labels"])  # no prompt: every token is a target


def test_malformed_jsonl_line_is_reported(compose_cfg, tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"source": "a", "target": "b"}\n{"source": "a", "target": \n', encoding="utf-8")
    cfg = compose_cfg("data=jsonl", f"data.path={path}")
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_and_tokenize(cfg, tokenizer)


def test_empty_target_is_reported(compose_cfg, tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "e.jsonl", [{"source": "a", "target": "b"}, {"source": "a", "target": " "}])
    cfg = compose_cfg("data=jsonl", f"data.path={path}")
    with pytest.raises(DataError, match="record 2 has an empty 'target'"):
        load_and_tokenize(cfg, tokenizer)


def test_data_hub_loads_named_splits_through_datasets(compose_cfg, tmp_path):
    # load_dataset() resolves a directory of split files exactly as it resolves a hub id: the same code path, offline
    rows = [{"source": f"paper {i} " + "text " * 8, "target": f"summary {i}"} for i in range(12)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "validation.jsonl", rows[:3])
    cfg = compose_cfg("model=tiny_seq2seq", "data=hub", f"data.hub_id={tmp_path}")
    pairs = load_pairs(cfg.data, cfg.model.task)
    assert len(pairs["train"]) == 12 and len(pairs["validation"]) == 3
    assert pairs["validation"][2] == {"source": rows[2]["source"], "target": "summary 2"}


def test_an_unreachable_hub_id_is_one_clear_data_error(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq", "data=hub", "data.hub_id=memfit-tests/no-such-dataset")
    with pytest.raises(DataError, match=r"data.hub_id=memfit-tests/no-such-dataset cannot be loaded .*jsonl"):
        load_pairs(cfg.data, cfg.model.task)


def test_text_saved_with_a_byte_order_mark_crlf_and_a_trailing_blank_line_is_read(compose_cfg, tmp_path):
    """What many Windows editors write: a UTF-8 BOM, CRLF line ends, a blank last line (JSONL and CSV)."""
    from memfit.config import validate

    rows = [("a paper", "its summary"), ("another paper", "another summary")]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(
        b"\xef\xbb\xbf" + b"".join(f'{{"source": "{s}", "target": "{t}"}}\r\n'.encode() for s, t in rows) + b"\r\n"
    )
    csv_path = tmp_path / "bom.csv"
    csv_path.write_bytes(
        b"\xef\xbb\xbfsource,target\r\n" + b"".join(f"{s},{t}\r\n".encode() for s, t in rows) + b"\r\n"
    )
    for fmt, path in (("jsonl", jsonl), ("csv", csv_path)):
        cfg = compose_cfg(f"data={fmt}", f"data.path={path}", "data.validation_fraction=0")
        validate(cfg)
        pairs = load_pairs(cfg.data, cfg.model.task)["train"]
        assert [(p["source"], p["target"]) for p in pairs] == rows, fmt
