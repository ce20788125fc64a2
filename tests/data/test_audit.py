"""The length audit finds the rare long labels and the exact worst padded batch."""

from __future__ import annotations

import numpy as np

from memfit.data import load_and_tokenize
from memfit.data.audit import BatchShape, audit_lengths, padded, render_table, worst_batches
from memfit.models import build_tokenizer


def test_worst_batch_pairs_longest_source_with_longest_label():
    source, label = np.array([10, 300, 20, 40]), np.array([500, 5, 7, 9])
    assert worst_batches(source, label, 4, "seq2seq", None) == [BatchShape(4, 300, 500)]
    assert worst_batches(source, label, 4, "seq2seq", 64) == [BatchShape(4, 320, 512)]
    # one sample per batch: each sample that is not dominated is a candidate
    assert set(worst_batches(source, label, 1, "seq2seq", None)) == {BatchShape(1, 300, 5), BatchShape(1, 10, 500)}
    # causal: prompt + response share the input
    assert worst_batches(source, label, 2, "causal", 8) == [BatchShape(2, 512, 512)]


def test_a_larger_batch_than_the_configured_one_is_bounded_by_the_longest_source_and_label_together():
    """A largest-batch search from a configured batch of 1 probes batch 6 at 6 × longest source × longest label,
    not at the single worst sample's shape (on an H200 the latter found batch 6 fitting pegasus_large under
    24 GiB, whose own preflight at batch 6 then measured it 0.18 GiB over the limit)."""
    source, label = np.array([1024, 100, 20]), np.array([40, 896, 7])
    kept = np.ones(3, dtype=bool)
    audit = audit_lengths(
        source, label, kept, task="seq2seq", max_source=1024, max_label=1024, batch=1, multiple=8, sampler="random"
    )
    assert audit.worst_at(1) == max(audit.worst_train, key=lambda s: s.tokens) == BatchShape(1, 1024, 40)
    assert audit.worst_at(6) == BatchShape(6, 1024, 896)


def test_audit_counts_truncation_drops_and_coverage():
    source, label = np.array([10, 20, 30, 40]), np.array([5, 5, 5, 85])
    kept = np.array([True, True, True, False])
    audit = audit_lengths(
        source, label, kept, task="seq2seq", max_source=25, max_label=50, batch=2, multiple=None, sampler="random"
    )
    assert audit.dropped == 1 and audit.truncated_source == 1 and audit.truncated_label == 0
    assert audit.label_coverage == (5 + 5 + 5) / 100
    assert audit.source_coverage == (10 + 20 + 25) / 100  # the dropped sample's source is lost, the third cut
    assert audit.worst_train == [BatchShape(2, 25, 5)]
    assert audit.label_raw.max == 85 and audit.label_raw.p50 == 5


def test_audit_of_long_tail_jsonl_finds_the_rare_long_labels(compose_cfg, long_tail_jsonl):
    cfg = compose_cfg(
        "data=jsonl",
        f"data.path={long_tail_jsonl}",
        "data.validation_fraction=0",
        "memory.max_label_length=512",
        "memory.pad_to_multiple_of=8",
        "trainer.batch_size=4",
    )
    tokenizer = build_tokenizer(cfg.model)
    audit = load_and_tokenize(cfg, tokenizer).audit
    rows = [line for line in long_tail_jsonl.read_text().splitlines()]
    import json

    records = [json.loads(r) for r in rows]
    label_lengths = [len(tokenizer(text_target=r["target"])["input_ids"]) for r in records]
    source_lengths = [len(tokenizer(r["source"])["input_ids"]) for r in records]
    assert audit.label_raw.max == max(label_lengths) == 302  # "long label " × 150 + [CLS] + [SEP]
    assert audit.label_raw.p90 < 20  # typical labels are short: the long ones are rare
    assert audit.worst_train == [BatchShape(4, padded(max(source_lengths), 8), padded(302, 8))]
    table = render_table(audit)
    assert "labels" in table and "302" in table and "coverage" in table
