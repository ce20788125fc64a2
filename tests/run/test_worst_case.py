"""The worst-case phase on CPU, where nothing but the kernel's OOM killer stops an allocation."""

from __future__ import annotations

import re

import pytest

from memfit.run import run
from tests.run.test_auto_lengths import long_tail_cfg

pytestmark = pytest.mark.slow


def test_a_cpu_batch_expected_past_the_host_budget_is_not_probed_and_the_search_does_not_run_it(
    compose_cfg, long_tail_jsonl, caplog
):
    """On CPU nothing but the kernel's OOM killer stops an allocation: a batch of 20 rows whose one row, scaled,
    needs more than the budget is not probed; the preflight fails with that line and the ways out, and the
    largest-batch search never runs the batch either."""
    cfg = long_tail_cfg(
        compose_cfg,
        long_tail_jsonl,
        "memory.max_label_length=512",  # a set length: auto would cut it to fit
        "trainer.batch_size=20",
        "preflight_only=true",
        over_rss_gib=0.3,
    )
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert report.status == "preflight_failed"
    assert re.search(
        r"train batch 20 × source 32 × labels 304: not probed: one row of these lengths measured [\d.]+ GiB, so 20 "
        r"rows are expected to need ~[\d.]+ GiB, past the [\d.]+ GiB this host's budget holds",
        report.reason,
    ), report.reason
    assert "trainer.batch_size=" in report.reason  # the ways out
    searched = re.search(
        r"largest-batch search from the configured batch, doubling: probed batches ([\d, ]*)", caplog.text
    )
    assert searched and "20" not in searched.group(1).split(", "), caplog.text[-2000:]


def test_auto_lengths_never_probe_a_batch_past_the_host_budget_either(compose_cfg, long_tail_jsonl, caplog):
    """The same batch of 20 with auto lengths: the full-length batch is not probed, and the cut chosen fits."""
    cfg = long_tail_cfg(
        compose_cfg,
        long_tail_jsonl,
        "trainer.batch_size=20",
        "preflight_only=true",
        "preflight.max_search_seconds=1e-9",
        over_rss_gib=0.5,
    )
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert "a batch of 20 does not fit" in caplog.text and "cut to source" in caplog.text, caplog.text[-3000:]
    assert report.status == "ok" and report.worst_case_shape[2] < 304
