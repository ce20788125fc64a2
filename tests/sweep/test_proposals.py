"""Proposal rules: pure decisions over finished and running trials (no storage, no I/O)."""

from __future__ import annotations

import optuna

from memfit.sweep import proposals

SPACE = {
    "trainer.batch_size": optuna.distributions.CategoricalDistribution([4, 8, 16]),
    "memory.max_label_length": optuna.distributions.CategoricalDistribution([64, 128]),
}


def _trial(number: int, params: dict, status: str, memory_gib: float, value: float = 1.0, **attrs):
    trial = optuna.trial.create_trial(
        params=params,
        distributions={k: SPACE[k] for k in params},
        value=value,
        user_attrs={"status": status, **attrs},
        system_attrs={"constraints:memory_gib": memory_gib},
    )
    trial.number = number
    return trial


def test_a_measured_configuration_is_known_and_its_repeat_copies_only_what_was_measured():
    cost = {"phase_seconds": {"train": 9.5}}  # its process's, not its configuration's
    measured = _trial(0, {"trainer.batch_size": 8}, "ok", -1.0, value=50.0, run_id="abc", device="0", **cost)
    known = proposals.known_outcome({"trainer.batch_size": 8}, [measured], [], proposals.Knowledge())
    assert known.values == [50.0] and known.attrs["repeat_of"] == 0
    assert not {"run_id", "device", "phase_seconds"} & set(known.attrs)
    assert proposals.known_outcome({"trainer.batch_size": 4}, [measured], [], proposals.Knowledge()) is None


def test_a_configuration_another_worker_measures_now_is_surplus_only_for_the_later_trial():
    running = _trial(3, {"trainer.batch_size": 8}, "ok", -1.0)
    later = proposals.known_outcome({"trainer.batch_size": 8}, [], [running], proposals.Knowledge(), number=5)
    assert later.attrs["status"] == "surplus" and "trial 3" in later.attrs["reason"]
    assert proposals.known_outcome({"trainer.batch_size": 8}, [], [running], proposals.Knowledge(), number=2) is None


def test_the_fullest_predicted_fit_waits_until_every_unknown_configuration_is_predicted():
    candidates = [{"b": 1}, {"b": 2}, {"b": 4}, {"b": 8}]
    gib = {1: 1.0, 2: 2.0, 4: 3.9, 8: 7.0}
    known = {4}  # measured already

    def is_known(params):
        return params["b"] in known

    pick = proposals.fullest_fit(candidates, lambda p: gib[p["b"]], 4.0, is_known)
    assert pick == (2.0, {"b": 2})  # 4 is known, 8 over the limit
    unpredicted = proposals.fullest_fit(candidates, lambda p: None if p["b"] == 1 else gib[p["b"]], 4.0, is_known)
    assert unpredicted is None  # batch 1 has no prediction and is not known: the sampler goes on
    known.add(1)
    assert proposals.fullest_fit(candidates, lambda p: None if p["b"] == 1 else gib[p["b"]], 4.0, is_known) == (
        2.0,
        {"b": 2},
    )


def test_an_unexplored_configuration_is_neither_pending_nor_known():
    draws = iter([{"b": 1}, {"b": 2}, {"b": 3}])
    assert proposals.unexplored(lambda: next(draws), [{"b": 1}], lambda p: p["b"] == 2) == {"b": 3}
    assert proposals.unexplored(lambda: {"b": 1}, [{"b": 1}], lambda p: False) is None


def test_a_trial_beyond_n_trials_is_over_quota_unless_it_retries_a_killed_one():
    started = [_trial(n, {"trainer.batch_size": 4}, "ok", -1.0) for n in range(3)]
    fourth = _trial(3, {"trainer.batch_size": 8}, "ok", -1.0)
    retry = _trial(3, {"trainer.batch_size": 8}, "ok", -1.0, retry_of=1)
    assert proposals.over_quota(fourth, started, n_trials=3)
    assert not proposals.over_quota(fourth, started, n_trials=4)
    assert not proposals.over_quota(retry, started, n_trials=3)


def test_a_trial_a_retry_stands_in_for_does_not_count_toward_n_trials():
    """Trial 1 was interrupted and its configuration queued again as trial 3: the retry measures it, so three
    trials count (0, 2 and the retry), and a fourth new one is within n_trials=4."""
    interrupted = _trial(1, {"trainer.batch_size": 8}, "interrupted", -1.0)
    started = [
        _trial(0, {"trainer.batch_size": 4}, "ok", -1.0),
        interrupted,
        _trial(2, {"trainer.batch_size": 16}, "ok", -1.0),
    ]
    retry = _trial(3, {"trainer.batch_size": 8}, "ok", -1.0, retry_of=1)
    assert [t.number for t in proposals.measured([*started, retry])] == [0, 2, 3]
    assert not proposals.over_quota(_trial(4, {"trainer.batch_size": 4}, "ok", -1.0), [*started, retry], n_trials=4)
    assert proposals.over_quota(_trial(4, {"trainer.batch_size": 4}, "ok", -1.0), [*started, retry], n_trials=3)
