"""A sweep on data it has never seen searches max lengths at the data's own quantiles, unless told otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.sweep.derive import length_choices, search_space
from memfit.sweep.space import SweepConfigError

RECIPE = {
    "trainer.batch_size": "choice(1,2,4)",
    "memory.max_source_length": "quantiles",
    "memory.max_label_length": "quantiles",
}


def test_length_choices_are_the_p90_p99_p999_and_longest_padded_and_capped():
    lengths = np.concatenate([np.full(990, 30), np.arange(1, 10) * 100, [5000]])  # a long tail, one beyond the limit
    assert length_choices(lengths, 8, 1024) == [32, 104, 1024]  # p90 30 → 32, p99 100 → 104, p99.9 and max capped
    assert length_choices(lengths, None, 4096) == [30, 100, 4096]


def test_a_derived_label_choice_keeps_the_long_tails_labels_and_the_command_line_wins(compose_cfg, long_tail_jsonl):
    cfg = compose_cfg("model=tiny_seq2seq", "data=jsonl", f"data.path={long_tail_jsonl}")
    searched = search_space([], RECIPE, cfg)
    labels = searched.space["memory.max_label_length"].choices
    p999 = np.quantile(searched.lengths.label, 0.999, method="higher")
    assert max(labels) >= p999 and max(labels) >= searched.lengths.label.max()  # the 2 long labels are kept whole
    assert searched.space["trainer.batch_size"].choices == (1, 2, 4)
    assert "memory.max_label_length: [" in searched.describe() and "(the data's p90, p99, p99.9, longest)" in (
        searched.describe()
    )
    told = search_space(["memory.max_label_length=choice(64,512)", "memory.max_source_length=128"], RECIPE, cfg)
    assert told.space["memory.max_label_length"].choices == (64, 512) and told.derived == {}
    assert "memory.max_source_length" not in told.space and "memory.max_source_length=128" in told.fixed


def test_only_lengths_are_derived_and_an_empty_space_is_one_line(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq")
    with pytest.raises(SweepConfigError, match=r"^trainer.batch_size=quantiles: only memory.max_source_length and"):
        search_space([], {"trainer.batch_size": "quantiles"}, cfg)
    with pytest.raises(SweepConfigError, match="the sweep has nothing to search"):
        search_space(["trainer.batch_size=2"], {}, cfg)


@pytest.mark.parametrize(
    ("device", "policy", "searched"),
    [("cuda", "balanced", ("fixed", "budget")), ("cpu", "balanced", None), ("cuda", "off", None)],
)
def test_the_recipes_batching_is_searched_where_trials_train_on_a_gpu(
    compose_cfg, monkeypatch, device, policy, searched
):
    """`trainer.batching: auto` in the recipe: both kinds of batches on a GPU with expandable segments (deciding
    where trials train needs no GPU here: trainer.device=cuda says so), not searched on CPU or without them
    (memory=off); the command line still wins."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cfg = compose_cfg("model=tiny_seq2seq", f"trainer.device={device}", f"memory={policy}")
    recipe = {"trainer.batch_size": "choice(1,2)", "trainer.batching": "auto"}
    space = search_space([], recipe, cfg).space
    assert getattr(space.get("trainer.batching"), "choices", None) == searched
    told = search_space(["trainer.batching=fixed"], recipe, cfg)
    assert "trainer.batching" not in told.space and "trainer.batching=fixed" in told.fixed
