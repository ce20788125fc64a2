"""`auto` max lengths on real CPU runs: every token where the budget holds the run's batch of the longest samples, else
the longest cut whose batch fits, measured, the data tokenized again at it before the preflight proves the run."""

from __future__ import annotations

import re

import pytest

from memfit.config import GIB
from memfit.memory.meter import HostMeter
from memfit.run import run

pytestmark = pytest.mark.slow

# FAST without its lengths: the policy's auto lengths are under test; batch 8 of fp32 rows on the host
SETTINGS = [
    "model=tiny_seq2seq",
    "trainer.device=cpu",
    "memory.precision=fp32",
    "trainer.batch_size=8",
    "trainer.gradient_accumulation_steps=1",
    "tracking=none",
]


def long_tail_cfg(compose_cfg, data, *overrides: str, over_rss_gib: float | None = None):
    """tiny_seq2seq on the long-tail JSONL on CPU; with `over_rss_gib`, a host budget of this process's resident set
    plus that many GiB (no margin): what a batch adds to the process, whatever ran in it before."""
    budget = []
    if over_rss_gib is not None:
        budget = [f"budget.gib={HostMeter().current_bytes() / GIB + over_rss_gib:.3f}", "budget.margin_gib=0"]
    return compose_cfg(*SETTINGS, "data=jsonl", f"data.path={data}", *budget, *overrides)


def test_auto_keeps_every_token_where_the_budget_holds_the_longest_samples(compose_cfg, long_tail_jsonl, caplog):
    cfg = long_tail_cfg(compose_cfg, long_tail_jsonl, "preflight_only=true", "preflight.max_search_seconds=1e-9")
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert report.status == "ok" and report.label_coverage == 1.0
    assert re.search(
        r"memory.max_source_length, memory.max_label_length=auto: the model's limit \(source 1024, labels 1024 "
        r"tokens\): every token kept, the longest samples \(source \d+, labels 30\d\) fit at batch 8",
        caplog.text,
    ), caplog.text[-3000:]


def test_auto_cuts_a_long_tail_to_the_longest_the_budget_proves_and_trains(compose_cfg, long_tail_jsonl, caplog):
    """A host budget of this process's resident set plus 0.45 GiB holds a batch of 8 short samples (~0.1 GiB of
    activations) but not the long tail's 300-token labels (~0.8 GiB): the labels are cut between the two, the
    cut batch is proven by the preflight, and the run trains on the cut data."""
    cfg = long_tail_cfg(
        compose_cfg, long_tail_jsonl, "trainer.max_steps=2", "trainer.save_model=none", over_rss_gib=0.45
    )
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    cut = re.search(
        r"memory.max_source_length, memory.max_label_length=auto: at the model's limit \(source 1024, labels 1024\) "
        r"a batch of 8 does not fit the [\d.]+ GiB limit: cut to source (\d+), labels (\d+), the longest that fits "
        r"\(keeps ([\d.]+)% of label tokens, 100.0% of source tokens\)",
        caplog.text,
    )
    assert cut, caplog.text[-3000:]
    label = int(cut.group(2))
    assert 8 < label < 300 and label % 8 == 0  # not the short samples' length: where the budget ended
    assert report.status == "ok" and report.steps == 2, report.reason
    assert 0.35 < report.label_coverage < 1.0  # what the tokenized data kept, not what it had
    assert report.worst_case_shape[2] == label  # the preflight proved the cut batch
