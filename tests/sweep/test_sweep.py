"""memfit's budget sweeper: search-space parsing, how trials are told to Optuna, and a real sweep on CPU."""

from __future__ import annotations

import json
import re
import shlex
import urllib.request
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from memfit.sweep import outcome_of, parse_search
from memfit.tracking import default_tracking_uri, run_facts
from tests.conftest import free_port, readme_command, run_train_py, serving, sweep_outputs


def test_search_space_from_recipe_and_command_line():
    space, fixed = parse_search(
        ["trainer.batch_size=choice(2,4)", "memory.max_label_length=range(32,129,32)", "model=tiny_seq2seq"],
        {"trainer.batch_size": "choice(1,2,4,8)", "trainer.learning_rate": "tag(log,interval(1e-5,1e-3))"},
    )
    assert space["trainer.batch_size"] == optuna.distributions.CategoricalDistribution([2, 4])  # command line wins
    assert space["memory.max_label_length"] == optuna.distributions.IntDistribution(32, 128, step=32)
    assert space["trainer.learning_rate"] == optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)
    assert fixed == ["model=tiny_seq2seq"]


def test_every_configuration_of_a_finite_space_and_none_of_a_continuous_or_huge_one():
    from memfit.sweep.space import configurations

    space, _ = parse_search(["trainer.batch_size=choice(2,4)", "memory.max_label_length=range(32,97,32)"], {})
    assert configurations(space) == [
        {"trainer.batch_size": b, "memory.max_label_length": label} for b in (2, 4) for label in (32, 64, 96)
    ]
    assert configurations(space, limit=5) is None  # 6 configurations: too many to predict one by one
    continuous, _ = parse_search(["trainer.learning_rate=interval(1e-5,1e-3)"], {})
    assert configurations(continuous) is None


def test_a_best_trial_at_the_edge_of_its_limit_is_warned_about_with_a_safer_one_named():
    """A later run measures the worst case again in another process: at the limit's edge its preflight may refuse
    the preset. (The README's CPU sweep once exported a winner 0.0003 GiB under its limit, refused on reuse.)"""
    from memfit.sweep.results import near_limit_warning

    def trial(number: int, batch: int, peak: float, tokens_per_s: float):
        made = optuna.trial.create_trial(
            params={"trainer.batch_size": batch},
            distributions={"trainer.batch_size": optuna.distributions.CategoricalDistribution([2, 8, 32])},
            values=[tokens_per_s],
            user_attrs={"worst_case_peak_gib": peak},
            constraints={"memory_gib": peak - 1.1},  # limit 1.1 GiB
        )
        made.number = number
        return made

    edge, safe, slow = trial(1, 32, 1.0997, 900.0), trial(0, 8, 0.89, 700.0), trial(2, 2, 0.74, 300.0)
    text = near_limit_warning(edge, [safe, edge, slow], ["maximize"])
    assert "trial 1's worst case (1.100 GiB) is 0.000 GiB under its 1.10 GiB limit" in text
    assert "the best with more headroom is trial 0 ({'trainer.batch_size': 8}" in text
    assert near_limit_warning(safe, [safe, slow], ["maximize"]) is None  # 0.21 GiB under: no warning
    assert "more headroom" not in near_limit_warning(edge, [edge], ["maximize"])  # no safer trial to name


def test_a_run_that_does_not_fit_is_an_infeasible_complete_trial():
    report = {"status": "preflight_failed", "worst_case_peak_gib": 30.0, "label_coverage": 1.0}
    outcome = outcome_of(report, None, 23.5, ["throughput"], 0.99)
    assert outcome.state == "complete" and outcome.value == 0.0
    assert outcome.constraints["memory_gib"] == pytest.approx(6.5) and not outcome.feasible


def test_an_oom_without_a_measured_size_is_still_infeasible():
    outcome = outcome_of({"status": "oom", "reason": "oom: at step 9"}, None, 23.5, ["throughput"], 0.0)
    assert outcome.state == "complete" and outcome.constraints["memory_gib"] > 0


def test_a_fitting_run_is_feasible_unless_coverage_is_too_low():
    report = {"status": "ok", "worst_case_peak_gib": 20.0, "tokens_per_s": 1234.0, "label_coverage": 0.97}
    fits = outcome_of(report, None, 23.5, ["throughput"], 0.95)
    assert fits.feasible and fits.value == 1234.0
    assert not outcome_of(report, None, 23.5, ["throughput"], 0.99).feasible


def test_epoch_throughput_is_the_reports_epoch_estimate():
    report = {"status": "ok", "worst_case_peak_gib": 20.0, "tokens_per_s": 1234.0, "epoch_tokens_per_s": 987.0}
    assert outcome_of(report, None, 23.5, ["epoch_throughput"], 0.0).value == 987.0
    assert outcome_of(report, None, 23.5, ["throughput"], 0.0).value == 1234.0
    assert outcome_of(report, None, 23.5, ["epoch_throughput"], 0.0).attrs["epoch_tokens_per_s"] == 987.0
    # a segment too short to fit the step-time model: the segment's own rate, not the worst value
    del report["epoch_tokens_per_s"]
    assert outcome_of(report, None, 23.5, ["epoch_throughput"], 0.0).value == 1234.0


def test_a_crash_is_a_failed_trial_with_its_reason():
    outcome = outcome_of(None, "ValueError: boom", 23.5, ["throughput"], 0.0)
    assert outcome.state == "fail" and outcome.attrs["reason"] == "ValueError: boom"


def test_the_sweeper_plugin_is_discovered():
    out = run_train_py("--info", "plugins", timeout=120)
    assert "MemfitSweeper" in out.stdout


TRIAL_APP = """
import gc, json, os, sys
from pathlib import Path
run_dir = Path([a for a in sys.argv if a.startswith("hydra.run.dir=")][0].split("=", 1)[1])
print("trial output")
report = {"pid": os.getpid(), "argv": sys.argv[1:], "torch_imported": "torch" in sys.modules}
report["frozen"] = gc.get_freeze_count()
report["cores"] = sorted(os.sched_getaffinity(0))
report["env"] = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "MEMFIT_TRIAL_MARK", "OMP_NUM_THREADS")}
def rss_kib(pid):
    return int([line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")][0].split()[1])
report["rss_of_server"] = rss_kib("self") / rss_kib(os.getppid())
if report["torch_imported"]:
    import torch
    report["threads"] = torch.get_num_threads()
(run_dir / "report.json").write_text(json.dumps(report))
"""


@pytest.mark.parametrize("fork", [True, False])
def test_a_trial_process_runs_only_its_own_overrides_in_its_own_environment(tmp_path, monkeypatch, fork):
    """hydra.sweeper.fork_trials: a trial forked from the fork server has its imports paid (and frozen out of the
    collector's sight), a fresh one pays its own; either way it runs the app with its own overrides, sees the
    environment and cores of its device's runner, and writes its output to its own log."""
    import os
    import sys

    from memfit.sweep.trials import ProcessTrials, trial_env

    app = tmp_path / "app.py"
    app.write_text(TRIAL_APP)
    monkeypatch.setenv("MEMFIT_TRIAL_MARK", "given")  # set after the fork server started: the trial sees it anyway
    trials = ProcessTrials([sys.executable, str(app), "--config-name", "x"], tmp_path / "s", None, trial_env(), fork)
    trials.start()
    core = sorted(os.sched_getaffinity(0))[-1]
    first, second = trials.launch([["a=1"]], 0) + trials.pinned("3", cores=[core]).launch([["a=2"]], 1)
    assert first.report["argv"] == ["--config-name", "x", "a=1", f"hydra.run.dir={tmp_path / 's' / '0'}"]
    assert second.report["argv"][-2] == "a=2" and first.report["pid"] != second.report["pid"]
    threads = os.environ.get("OMP_NUM_THREADS")
    assert first.report["env"] == {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "MEMFIT_TRIAL_MARK": "given",
        "OMP_NUM_THREADS": threads,
    }
    assert second.report["env"] == {
        "CUDA_VISIBLE_DEVICES": "3",
        "MEMFIT_TRIAL_MARK": "given",
        "OMP_NUM_THREADS": threads or "1",
    }
    assert first.report["cores"] == sorted(os.sched_getaffinity(0)) and second.report["cores"] == [core]
    assert (tmp_path / "s" / "1" / "trial.log").read_text() == "trial output\n"
    if fork:
        assert first.report["torch_imported"] and first.report["frozen"] > 100_000
        # the server's file pages are counted in the trial's RSS from its start, as in a fresh process's
        assert first.report["rss_of_server"] > 0.95
        assert second.report["threads"] == 1  # OMP_NUM_THREADS applied, though torch was imported before it
    else:
        assert not first.report["torch_imported"] and first.report["frozen"] == 0
    trials.close()


EXITING_APP = """
import atexit, sys, threading, time
from pathlib import Path
run_dir = Path([a for a in sys.argv if a.startswith("hydra.run.dir=")][0].split("=", 1)[1])
atexit.register(lambda: (run_dir / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (run_dir / "thread").write_text("done"))).start()
print("exiting")  # not flushed: a trial's output is written as it goes, as `python -u` writes it
if "code=kill" in sys.argv:
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int([a for a in sys.argv if a.startswith("code=")][0].split("=")[1]))
"""


@pytest.mark.parametrize("fork", [True, False])
def test_a_trial_process_ends_as_a_normal_exit_would_less_the_interpreter_teardown(tmp_path, fork):
    """memfit.sweep.trial_process ends the trial with os._exit after its work: threads and atexit handlers still
    run, and the exit status is the script's."""
    import sys

    from memfit.sweep.trials import ProcessTrials, trial_env

    app = tmp_path / "app.py"
    app.write_text(EXITING_APP)
    trials = ProcessTrials([sys.executable, str(app)], tmp_path / "s", None, trial_env(), fork)
    trials.start()
    [result] = trials.launch([["code=3"]], 0)
    job = tmp_path / "s" / "0"
    assert result.report is None and result.error == "failed: exit 3: exiting"
    assert (job / "atexit").read_text() == "ran" and (job / "thread").read_text() == "done"
    [ok] = trials.launch([["code=0"]], 1)
    assert ok.error == "failed: exit 0: exiting"  # no report.json: the sweeper says so, with the status
    [killed] = trials.launch([["code=kill"]], 2)
    assert killed.error == "killed: by SIGKILL" and (tmp_path / "s" / "2" / "trial.log").read_text() == "exiting\n"
    trials.close()


def test_pinned_cores_are_disjoint_halves_of_this_process_cores_written_as_taskset_does():
    import os

    from memfit.run import core_ranges
    from memfit.sweep.trials import core_sets

    assert core_ranges([0, 1, 2, 3, 8, 9, 10, 11]) == "0-3,8-11" and core_ranges([5]) == "5"
    mine = sorted(os.sched_getaffinity(0))
    halves = core_sets(2)
    if len(mine) < 2:
        assert halves is None  # fewer cores than devices: nothing to pin
        return
    assert halves[0] and halves[1] and not set(halves[0]) & set(halves[1])
    assert set(halves[0]) | set(halves[1]) <= set(mine) and len(halves[0]) == len(halves[1]) == len(mine) // 2
    assert core_sets(len(mine) + 1) is None


def test_pinned_cores_keep_hyperthread_siblings_together_and_prefer_one_numa_node():
    from memfit.sweep.trials import core_sets, cpu_place

    # a 2-socket host with 8 physical cores, 2 threads each, numbered as Linux does: cpu N and N+8 are siblings,
    # cpus 0-3 (and 8-11) on node 0, 4-7 (and 12-15) on node 1
    def place(cpu: int) -> tuple[int, int, int]:
        core = cpu % 8
        return (core // 4, core // 4, core % 4)

    halves = core_sets(2, cpus=range(16), place=place)
    assert halves == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]  # not 0-7 | 8-15: siblings
    quarters = core_sets(4, cpus=range(16), place=place)
    assert quarters[0] == [0, 1, 8, 9] and all(len(q) == 4 for q in quarters)
    assert core_sets(16, cpus=range(16), place=place) == [
        [cpu] for cpu in [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    ]
    assert core_sets(17, cpus=range(16), place=place) is None
    node, socket, core = cpu_place(0)  # this machine's sysfs, read for real
    assert min(node, socket, core) >= 0


@pytest.mark.slow
@pytest.mark.xdist_group("readme_budget_sweep")
def test_the_readme_budget_sweep_finds_and_exports_a_preset(readme_budget_sweep, tmp_path):
    swept, first = readme_budget_sweep
    name, storage = "memfit-tiny_seq2seq-aclsum-1.7GiB", f"sqlite:///{swept}/optuna.db"
    study = optuna.load_study(study_name=name, storage=storage)
    assert all(t.constraints for t in study.trials)  # a constraint on every trial, told ones included
    ran = [t for t in study.trials if not t.user_attrs.get("not_run")]
    assert len(ran) <= 6 and len({tuple(sorted(t.params.items())) for t in ran}) == len(ran)  # none ran twice
    measured = [t for t in ran if t.user_attrs["status"] == "ok"]
    assert measured and all({"model", "preflight", "train"} <= set(t.user_attrs["phase_seconds"]) for t in measured)
    assert re.search(r"trial \d+ feasible: .*; [\d.]+ s in its process \(seconds: checks [\d.]+, ", first.stdout)
    told = [t for t in study.trials if t.user_attrs.get("not_run")]
    assert all(t.user_attrs["device_seconds"] == 0.0 and t.user_attrs["reason"].startswith("not run: ") for t in told)
    infeasible = [t for t in study.trials if t.constraints["memory_gib"] > 0]
    assert infeasible and all(t.state == optuna.trial.TrialState.COMPLETE for t in infeasible)
    statuses = {t.user_attrs["status"] for t in infeasible}
    assert "preflight_failed" in statuses and statuses <= {"preflight_failed", "predicted_infeasible"}
    assert "best feasible trial" in first.stderr + first.stdout
    # the pick: the fastest trial, or one within its measured spread (the tie band) that keeps more labels
    results = OmegaConf.load(next(swept.rglob("optimization_results-*.yaml")))
    fastest, best = study.trials[results.fastest_trial], study.trials[results.best_trial]
    assert fastest.value == max(t.value for t in study.trials if t.constraints["memory_gib"] <= 0)
    assert results.tie_band == pytest.approx(fastest.user_attrs["tokens_per_s_spread"] or 0.0)  # 2 steps: no spread
    assert best.value >= fastest.value * (1 - results.tie_band)
    assert best.user_attrs["label_coverage"] >= fastest.user_attrs["label_coverage"]
    assert (best.number != fastest.number) == ("picked over trial" in first.stderr + first.stdout)

    client = MlflowClient(default_tracking_uri(str(swept)))
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    parents = [r for r in runs if "memfit.sweep" in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert "pareto.png" in [a.path for a in client.list_artifacts(parents[0].info.run_id)]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(int(r.data.tags["memfit.trial"]) for r in children) == list(range(len(study.trials)))  # each once
    assert {r.info.status for r in children} == {"FINISHED", "FAILED"}  # infeasible trials end FAILED, with reason
    assert all(
        "trial/feasible" in r.data.metrics and r.data.tags.get("memfit.reason")
        for r in children
        if r.info.status == "FAILED"
    )

    preset = swept / "sweeps" / "preset" / "tiny_seq2seq-aclsum-1.7gib.yaml"  # export_to, under the launch dir
    (beside,) = swept.glob("multirun/*/*/preset/tiny_seq2seq-aclsum-1.7gib.yaml")  # and beside the sweep's outputs
    assert preset.read_text() == beside.read_text() and preset.read_text().startswith("# @package _global_")
    # the closing line's command, as printed, is the README's (which adds a step limit) and trains from the preset
    printed = re.search(r"train from it with: (python train\.py [^)]+)\)", first.stdout + first.stderr).group(1)
    use = readme_command("python train.py model=tiny_seq2seq data=aclsum +preset=")
    assert shlex.split(printed) + ["trainer.max_steps=2"] == use and f"# Use: {printed}\n" in preset.read_text()
    trained = run_train_py(*use[2:], f"output_dir={tmp_path}/use", cwd=swept)
    assert trained.returncode == 0, trained.stderr[-2000:]
    exported = OmegaConf.load(preset)
    client = MlflowClient(default_tracking_uri(str(tmp_path / "use")))
    run = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.batch_size"] == str(exported.trainer.batch_size)
    assert run.data.params["memory.max_label_length"] == str(exported.memory.max_label_length)
    assert run.data.params["budget.gib"] == "1.7"
    assert exported.memory.max_source_length == 256 and exported.memory.precision == "fp32"  # fixed settings too
    assert "trainer.max_steps" not in run.data.params or exported.trainer.get("max_steps") is None


@pytest.mark.slow
@pytest.mark.xdist_group("readme_budget_sweep")  # the session fixture runs once per worker: share its worker
def test_optuna_dashboard_shows_the_readme_sweeps_trials_with_constraints_and_reasons(readme_budget_sweep):
    """The README's dashboard command, on the README sweep's study: a real optuna-dashboard on 127.0.0.1."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    swept, _ = readme_budget_sweep
    extra = [Requirement(r) for r in requires("memfit") if "dashboard" in r]
    assert [r.name for r in extra if r.marker.evaluate({"extra": "dashboard"})] == ["optuna-dashboard"]
    assert readme_command('pip install -e ".[dashboard]"')
    command = readme_command("optuna-dashboard")
    assert command[1] == "sqlite:///outputs/optuna.db" and command[command.index("--host") + 1] == "127.0.0.1"
    port = free_port()
    command[command.index("--port") + 1] = str(port)
    command[1] = f"sqlite:///{swept}/optuna.db"
    with serving(command, port, cwd=swept, health="/api/studies") as url:
        studies = _get_json(f"{url}/api/studies")["study_summaries"]
        (study,) = [s for s in studies if s["study_name"] == "memfit-tiny_seq2seq-aclsum-1.7GiB"]
        trials = _get_json(f"{url}/api/studies/{study['study_id']}?after=0")["trials"]
    stored = optuna.load_study(study_name=study["study_name"], storage=f"sqlite:///{swept}/optuna.db").trials
    assert len(trials) == len(stored)
    attrs = [{a["key"]: a["value"] for a in t["user_attrs"]} for t in trials]
    assert all({"status", "device_seconds", "constraint_memory_gib"} <= set(a) for a in attrs)
    # the dashboard shows Optuna 5's named constraints only through these attributes (memfit.sweep.outcome)
    assert [float(a["constraint_memory_gib"]) for a in attrs] == [t.constraints["memory_gib"] for t in stored]
    assert any(a.get("reason", "").startswith("not run: ") for a in attrs)  # told without running, and why


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


# A memory-like synthetic problem: peak grows with batch × tokens, throughput saturates in batch and rewards longer
# labels, so the best feasible configuration sits on the budget boundary, as in real budget searches.
BATCHES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
LABELS = [64, 128, 256, 384, 512, 768, 1024]
LIMIT_GIB = 24.0


def _measure(batch: int, label: int) -> tuple[float, float]:
    peak = 6.0 + 0.0009 * batch * (1024 + 2.0 * label)
    tokens_per_s = 10_000 * batch * (1024 + label) / (batch * (1024 + label) + 4000) * (label / 1024) ** 0.3
    return peak, tokens_per_s


def _best_feasible(mode: str, seed: int, trials: int = 30) -> float:
    sampler = optuna.samplers.RandomSampler(seed=seed) if mode == "random" else optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    space = {
        "b": optuna.distributions.CategoricalDistribution(BATCHES),
        "L": optuna.distributions.CategoricalDistribution(LABELS),
    }
    best = 0.0
    for _ in range(trials):
        trial = study.ask(space)
        peak, speed = _measure(trial.params["b"], trial.params["L"])
        fits = peak <= LIMIT_GIB
        report = {"status": "ok" if fits else "preflight_failed", "worst_case_peak_gib": peak, "tokens_per_s": speed}
        if mode == "fail" and not fits:  # what a sweeper without constraints does with an OOM
            study.tell(trial, None, state=optuna.trial.TrialState.FAIL)
            continue
        outcome = outcome_of(report, None, LIMIT_GIB, ["throughput"], 0.0)
        for key, value in outcome.constraints.items():
            trial.set_constraint(key, value)
        study.tell(trial, outcome.value)
        best = max(best, outcome.value) if outcome.feasible else best
    return best


def test_the_sampler_learns_from_the_memory_constraint():
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    seeds = range(40)
    mean = {mode: sum(_best_feasible(mode, s) for s in seeds) / len(seeds) for mode in ("memfit", "fail", "random")}
    optimum = max(_measure(b, lab)[1] for b in BATCHES for lab in LABELS if _measure(b, lab)[0] <= LIMIT_GIB)
    assert mean["memfit"] > mean["fail"] and mean["memfit"] > mean["random"], mean
    assert mean["memfit"] > 0.9 * optimum


def test_a_configuration_larger_than_an_infeasible_one_is_not_run():
    from types import SimpleNamespace

    from memfit.sweep import dominated_by

    oom = SimpleNamespace(
        number=3,
        params={"trainer.batch_size": 8, "memory.max_label_length": 256},
        user_attrs={"status": "preflight_failed"},
    )
    fits = SimpleNamespace(
        number=4, params={"trainer.batch_size": 32, "memory.max_label_length": 32}, user_attrs={"status": "ok"}
    )
    assert dominated_by({"trainer.batch_size": 16, "memory.max_label_length": 256}, [fits, oom]) is oom
    assert dominated_by({"trainer.batch_size": 16, "memory.max_label_length": 128}, [fits, oom]) is None
    assert dominated_by({"trainer.batch_size": 8, "memory.max_label_length": 256, "x": 1}, [oom]) is None


def test_a_trial_another_worker_failed_as_stale_does_not_stop_this_worker(caplog):
    from memfit.sweep.telling import TrialTeller
    from memfit.sweep.trials import TrialResult

    teller = TrialTeller(OmegaConf.create({"coverage_floor": 0.0, "heartbeat_s": 2}), None, ["throughput"])
    study = optuna.create_study(direction="maximize")
    trial = study.ask({"trainer.batch_size": optuna.distributions.CategoricalDistribution([4, 8])})
    study.tell(trial, state=optuna.trial.TrialState.FAIL)  # another worker: its heartbeat came too late
    report = {"status": "ok", "tokens_per_s": 100.0, "worst_case_peak_gib": 1.0}
    teller.tell(study, trial, TrialResult(report, None, 3.0), None)
    assert study.trials[trial.number].state == optuna.trial.TrialState.FAIL  # as the other worker left it
    assert "failed it as stale" in caplog.text and "no heartbeat for 6 s" in caplog.text


def test_a_configuration_measured_before_is_told_from_that_measurement_not_run_again():
    from memfit.sweep.telling import TrialTeller

    sweep = TrialTeller(OmegaConf.create({"coverage_floor": 0.0}), None, ["throughput"])
    study = optuna.create_study(direction="maximize")
    space = {"trainer.batch_size": optuna.distributions.CategoricalDistribution([4, 8])}
    study.enqueue_trial({"trainer.batch_size": 8})
    measured = study.ask(space)
    assert not sweep.told_without_running(study, measured, None)  # nothing known yet: it runs
    measured.set_user_attr("status", "ok")
    measured.set_user_attr("device_seconds", 41.0)
    measured.set_constraint("memory_gib", -2.5)
    study.tell(measured, 1234.0)

    study.enqueue_trial({"trainer.batch_size": 8})
    study.enqueue_trial({"trainer.batch_size": 4})
    again, other = study.ask(space), study.ask(space)
    assert sweep.told_without_running(study, again, None)
    assert not sweep.told_without_running(study, other, None)
    told = study.trials[again.number]
    assert told.values == [1234.0] and told.user_attrs["repeat_of"] == measured.number
    assert told.user_attrs["device_seconds"] == 0.0 and told.user_attrs["status"] == "ok"
    assert told.constraints == {"memory_gib": -2.5}


def test_of_two_workers_asking_one_configuration_at_once_only_the_earlier_trial_measures_it():
    """Two workers' trials both hold the same configuration, RUNNING, before either has checked the other: the
    lower-numbered one runs, the other is told as surplus (before, each saw the other and neither ran)."""
    from memfit.sweep.telling import TrialTeller

    sweep = TrialTeller(OmegaConf.create({"coverage_floor": 0.0}), None, ["throughput"])
    study = optuna.create_study(direction="maximize")
    space = {"trainer.batch_size": optuna.distributions.CategoricalDistribution([4, 8])}
    study.enqueue_trial({"trainer.batch_size": 8})
    study.enqueue_trial({"trainer.batch_size": 8})
    first, second = study.ask(space), study.ask(space)
    assert sweep.told_without_running(study, second, None)  # checked first, but the later trial of the two
    assert not sweep.told_without_running(study, first, None)  # runs
    told = study.trials[second.number]
    assert told.state == optuna.trial.TrialState.FAIL and told.user_attrs["status"] == "surplus"
    assert f"trial {first.number} (another worker) is measuring" in told.user_attrs["reason"]


def test_a_label_length_below_the_coverage_floor_is_told_from_the_data_not_run(compose_cfg):
    from memfit.data import load_and_tokenize
    from memfit.models import build_tokenizer
    from memfit.sweep.screen import coverage_screen, data_lengths
    from memfit.sweep.telling import TrialTeller

    cfg = compose_cfg("model=tiny_seq2seq", "data.max_train_samples=48")
    space = {"memory.max_label_length": optuna.distributions.CategoricalDistribution([8, 512])}
    screen = coverage_screen(data_lengths(space, cfg), space, cfg, floor=0.99)
    short = compose_cfg("model=tiny_seq2seq", "data.max_train_samples=48", "memory.max_label_length=8")
    audited = load_and_tokenize(short, build_tokenizer(short.model)).audit.label_coverage
    assert screen.below_floor({"memory.max_label_length": 8}) == pytest.approx(audited) and audited < 0.99
    assert screen.below_floor({"memory.max_label_length": 512}) is None
    assert data_lengths({"data.max_train_samples": space["memory.max_label_length"]}, cfg) is None

    sweep = TrialTeller(OmegaConf.create({"coverage_floor": 0.99}), None, ["throughput"], screen=screen)
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"memory.max_label_length": 8})
    trial = study.ask(space)
    assert sweep.told_without_running(study, trial, None)
    told = study.trials[0]
    assert told.user_attrs["status"] == "below_coverage_floor" and "coverage_floor=0.99" in told.user_attrs["reason"]
    assert told.constraints["coverage"] == pytest.approx(0.99 - audited) and told.values == [0.0]


def test_the_constraint_uses_the_limit_the_preflight_judged_by():
    report = {"status": "ok", "worst_case_peak_gib": 20.0, "limit_gib": 19.0, "tokens_per_s": 1.0}
    outcome = outcome_of(report, None, 23.5, ["throughput"], 0.0)
    assert outcome.constraints["memory_gib"] == pytest.approx(1.0) and not outcome.feasible


SMALL_SWEEP = [
    "-m",
    "sweep=budget",
    "model=tiny_seq2seq",
    "budget.gib=null",
    "trainer.device=cpu",
    "trainer.max_steps=3",
    "memory.precision=fp32",
    "memory.max_source_length=64",
    "memory.max_label_length=32",
    "data.max_train_samples=24",
    "data.max_eval_samples=4",
    "hydra.sweeper.coverage_floor=0",
    "hydra.sweeper.effective_batch=null",
    "trainer.seed=range(0,1000)",  # distinct configurations that no measured OOM dominates
    # no sizing job (the SIGTERM test keeps the recipe's); small batches: a trial's preflight and steps ~2 s, not 5
    "trainer.batch_size=choice(1,2,4)",
]


def _wait_for_running_trial(storage: str, name: str, number: int, proc, timeout: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        try:
            trials = optuna.load_study(study_name=name, storage=storage).trials
        except KeyError:  # the study is not created yet
            trials = []
        if any(t.number == number and t.state == optuna.trial.TrialState.RUNNING for t in trials):
            time.sleep(1.0)  # let the trial's process get going
            return
        time.sleep(0.2)
    raise AssertionError(f"trial {number} never started")


def _sweep_logs(tmp_path: Path) -> str:
    """memfit's log of every job and trial of a sweep (train.log; trial.log holds the same lines with the output)."""
    return "".join(log.read_text() for log in sorted((tmp_path / "sweep").rglob("train.log")))


def _all_end(processes: list, within_s: float) -> bool:
    """Whether every psutil process ends (or is left a zombie, its parent gone) within `within_s` seconds."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=within_s)
    try:
        return all(p.status() == psutil.STATUS_ZOMBIE for p in alive)
    except psutil.NoSuchProcess:
        return _all_end(alive, within_s=1)


@pytest.mark.slow
def test_faults_in_trials_and_a_killed_sweeper_lose_nothing(tmp_path, monkeypatch):
    """A trial that OOMs, one that raises, one whose loss turns NaN, one SIGKILLed, then the sweeper itself
    SIGKILLed mid-trial in the last of n_trials: after rerunning the same command every trial is in Optuna and
    MLflow once, with its state and reason, no MLflow run is RUNNING, and the interrupted configuration is measured
    after all, one trial past n_trials."""
    import os
    import signal

    import psutil

    from tests.conftest import run_train_py, start_train_py, train_py_env

    args = [
        *SMALL_SWEEP,
        "hydra.sweeper.n_trials=6",
        *sweep_outputs(tmp_path),
    ]
    monkeypatch.setenv("MEMFIT_FAULTS", "trial-1=oom@1,trial-2=crash@1,trial-3=nan@1,trial-4=kill@1")
    name, storage = "memfit-tiny_seq2seq-aclsum-nobudget", f"sqlite:///{tmp_path}/optuna.db"
    first = start_train_py(args, tmp_path / "first.log", train_py_env())
    try:
        _wait_for_running_trial(storage, name, 5, first)
        processes = psutil.Process(first.pid).children(recursive=True)  # the fork server, the trial forked from it
    finally:
        os.kill(first.pid, signal.SIGKILL)  # the sweeper dies mid-trial; its trial process dies with it
        first.wait()
    assert len(processes) >= 2 and _all_end(processes, within_s=30)
    again = run_train_py(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"sweep {name}" not in again.stderr  # CI=1: no progress bar in logs

    study = optuna.load_study(study_name=name, storage=storage)
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.number for t in trials] == list(range(7))  # no duplicated or missing numbers
    status = {t.number: (t.state.name, t.user_attrs.get("status")) for t in trials}
    assert status[0] == ("COMPLETE", "ok")
    assert status[1] == ("COMPLETE", "oom") and trials[1].constraints["memory_gib"] > 0  # infeasible, not FAIL
    assert status[2] == ("FAIL", "failed") and "injected crash" in trials[2].user_attrs["reason"]
    assert status[3] == ("FAIL", "nan_loss") and "loss is nan" in trials[3].user_attrs["reason"]
    assert status[4] == ("FAIL", "failed") and trials[4].user_attrs["reason"] == "killed: by SIGKILL"
    assert status[5] == ("FAIL", "interrupted")
    assert trials[6].user_attrs["retry_of"] == 5 and status[6] == ("COMPLETE", "ok")  # run although 6 trials ran

    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    parents = [r for r in runs if "memfit.sweep" in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the rerun continued the same parent
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(int(r.data.tags["memfit.trial"]) for r in children) == list(range(7))  # each trial once
    by_trial = {int(r.data.tags["memfit.trial"]): r for r in children}
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert by_trial[1].info.status == "FAILED" and by_trial[1].data.tags["memfit.reason"].startswith("oom: at step")
    oom_report = Path(client.download_artifacts(by_trial[1].info.run_id, "oom/report.txt")).read_text()
    fitted = r"the highest peak before it: step 1, micro-batch \d+ \(.*input_ids \d+×\d+, labels \d+×\d+\): [\d.]+ GiB"
    assert re.search(fitted, oom_report), oom_report  # the step that fitted before the OOM
    assert by_trial[3].data.tags["memfit.reason"].startswith("nan_loss")
    assert by_trial[4].info.status == "KILLED" and by_trial[5].info.status == "KILLED"
    assert by_trial[6].info.status == "FINISHED" and "train/loss" in by_trial[6].data.metrics


def test_sigterm_stops_a_sweep_recording_its_trial_interrupted_and_the_rerun_measures_it(
    tmp_path, tiny_seq2seq_calibration
):
    """SIGTERM to the sweeper mid-trial: the trial process is stopped too and ends its MLflow run KILLED, the trial is
    FAIL `interrupted` with its configuration queued again, the sweep's run ends KILLED, and the sweeper exits 143;
    rerunning the command measures the queued configuration.

    The sweep keeps the recipe's `trainer.batch_size: fits`: one estimate_only job (forked, recording nothing)
    before the first trial predicts the largest batch that fits at the space's shortest lengths; the batch choices
    sized from it are printed and recorded on the sweep's run, and the rerun searches the choices its study
    recorded, with no sizing job. The memory model it predicts with was calibrated before, as on a machine that
    swept this model already (the fixture fits it from nothing with this sizing job's own overrides)."""
    from memfit.sweep.sizing import Sizing
    from tests.conftest import run_train_py, start_train_py, train_py_env

    recipe_batches = [a for a in SMALL_SWEEP if not a.startswith("trainer.batch_size")]  # sized in a forked job
    # a trial long enough that SIGTERM (a second after the trial starts) lands before it ends: 60 steps of ~50 ms
    # after its ~1.5 s start-up, not the ~40 micro-batches a fixed-batch trial times by default (20 steps at a large
    # batch: ~1 s); the rerun trains them all
    args = [
        *recipe_batches,
        *sweep_outputs(tmp_path),
        "hydra.sweeper.n_trials=1",
        "trainer.max_steps=60",
        "hydra.sweeper.segment_micro_batches=null",
    ]
    (seeded,) = tiny_seq2seq_calibration(tmp_path)
    name, storage = "memfit-tiny_seq2seq-aclsum-nobudget", f"sqlite:///{tmp_path}/optuna.db"
    errors = tmp_path / "sweeper.err"
    sweeper = start_train_py(args, tmp_path / "sweeper.out", train_py_env(), errors=errors)
    try:
        _wait_for_running_trial(storage, name, 0, sweeper)
        sweeper.terminate()  # SIGTERM, as `kill` sends it
        sweeper.wait(timeout=120)
    finally:
        sweeper.kill()
    stderr = errors.read_text()
    assert sweeper.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "memfit: the sweep was stopped by SIGTERM" in stderr
    said = stderr + (tmp_path / "sweeper.out").read_text()
    at = "memory.max_source_length=64, memory.max_label_length=32"
    largest = int(re.search(rf"sized by the memory model: largest batch predicted to fit at {at}: (\d+)", said)[1])
    choices = Sizing(largest, 24, {}).choices()  # capped at the 24 training samples
    assert f"trainer.batch_size: {choices} (sized by the memory model" in said
    assert f"memory model calibration {seeded})" in said  # the sizing job predicted with the cached calibration
    assert "memory model: calibrated" not in _sweep_logs(tmp_path)  # and fitted none

    study = optuna.load_study(study_name=name, storage=storage)
    first = study.trials[0]
    assert first.state == optuna.trial.TrialState.FAIL and first.user_attrs["status"] == "interrupted"
    assert "stopped by SIGTERM" in first.user_attrs["reason"]
    queued = [t for t in study.trials if t.state == optuna.trial.TrialState.WAITING]
    assert [t.user_attrs["retry_of"] for t in queued] == [0]
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    (parent,) = [r for r in runs if "memfit.sweep" in r.data.tags]
    assert parent.info.status == "KILLED" and "stopped by SIGTERM" in parent.data.tags["memfit.reason"]
    recorded = Path(client.download_artifacts(parent.info.run_id, "search_space.txt", str(tmp_path))).read_text()
    assert f"trainer.batch_size: {choices} (sized by the memory model" in recorded
    (trial_run,) = [r for r in runs if r.data.tags.get("memfit.trial") == "0"]
    assert trial_run.info.status == "KILLED" and "SIGTERM" in trial_run.data.tags["memfit.reason"]
    assert len(runs) == 2  # the sweep's run and its trial's: the sizing job records nothing

    again = run_train_py(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert "sized by the memory model" not in said and f"trainer.batch_size: {choices} (as study {name}" in said
    assert "memory model: calibrated" not in _sweep_logs(tmp_path)  # nor does the rerun's trial
    study = optuna.load_study(study_name=name, storage=storage)
    retried = [t for t in study.trials if t.user_attrs.get("retry_of") == 0]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.COMPLETE
    measured = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(measured) == 1  # as many as the uninterrupted sweep of n_trials=1 measures: the stop cost no trial
    assert all(t.params["trainer.batch_size"] in choices for t in study.trials)
    parent = client.get_run(parent.info.run_id)  # the rerun finished the sweep's run: its stop is not why it ended
    assert parent.info.status == "FINISHED" and "memfit.reason" not in parent.data.tags


IN_PROCESS = [
    "hydra.sweeper.isolation=none",  # these tests are about the search, not isolation: no process start per trial
]


def _results(tmp_path, name: str):
    return OmegaConf.load(tmp_path / "sweep" / f"optimization_results-{name}.yaml")


@pytest.mark.slow
def test_the_loss_recipe_compares_eval_loss_after_the_same_token_budget(tmp_path):
    args = [
        *readme_command("python train.py -m sweep=loss")[2:],
        *IN_PROCESS,
        "data.max_eval_samples=4",
        *sweep_outputs(tmp_path),
    ]
    out = run_train_py(*args, quiet=False)  # as at a terminal: the sweep shows its progress
    assert out.returncode == 0, out.stderr[-3000:]
    name = "memfit-tiny_seq2seq-aclsum-nobudget"
    progress = [line for line in out.stderr.splitlines() if line.startswith(f"sweep {name}")]
    assert progress and "3/3" in progress[-1] and "best loss" in progress[-1], out.stderr[-2000:]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3
    for trial in done:
        tokens = trial.user_attrs["train_tokens"]
        per_step = 4 * (64 + 32)  # one optimizer step: effective batch 4 of at most max-length pairs
        assert 1500 <= tokens < 1500 + per_step  # stopped on the token budget, not on steps or epochs
        assert trial.value == pytest.approx(trial.user_attrs["eval_loss"])  # the objective is the eval loss
    results = _results(tmp_path, name)
    assert results.objectives == ["loss"] and results.best_value == pytest.approx(min(t.value for t in done))


@pytest.mark.slow
def test_pareto_mode_keeps_the_trade_off_between_two_objectives(tmp_path):
    args = [
        *[a for a in SMALL_SWEEP if not a.startswith(("trainer.seed", "memory.max_label_length"))],
        *IN_PROCESS,
        "hydra.sweeper.objective=pareto",
        "hydra.sweeper.pareto=[throughput,coverage]",
        "memory.max_label_length=choice(4,8,16,64)",
        "trainer.batch_size=choice(1,4)",
        "hydra.sweeper.n_trials=5",
        *sweep_outputs(tmp_path),
    ]
    out = run_train_py(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    name = "memfit-tiny_seq2seq-aclsum-nobudget"
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db")
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE] * 2
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    for trial in done:
        assert trial.values == [trial.user_attrs["tokens_per_s"], trial.user_attrs["label_coverage"]]
    front = _results(tmp_path, name).pareto_front
    on_front = {p.trial for p in front}
    assert on_front and on_front <= {t.number for t in done}
    for trial in done:  # no trial beats a front member in both objectives; off the front, one is beaten
        beaten = any(
            o.values[0] >= trial.values[0] and o.values[1] >= trial.values[1] and o.values != trial.values for o in done
        )
        assert beaten == (trial.number not in on_front)


@pytest.mark.slow
def test_a_segment_in_micro_batches_times_fewer_steps_of_a_small_batch(tmp_path):
    """hydra.sweeper.segment_micro_batches=8 at effective batch 4 and trainer.max_steps=6: batch 1 (4 micro-batches
    a step) trains 3 steps, the least a segment takes; batch 4 (1 a step) keeps its 6."""
    from mlflow.tracking import MlflowClient

    args = [
        *[a for a in SMALL_SWEEP if not a.startswith(("trainer.seed", "trainer.max_steps", "hydra.sweeper.effective"))],
        *IN_PROCESS,
        "trainer.max_steps=6",
        "trainer.batch_size=choice(1,4)",
        "hydra.sweeper.effective_batch=4",
        "hydra.sweeper.segment_micro_batches=8",
        "hydra.sweeper.n_trials=2",
        *sweep_outputs(tmp_path),
    ]
    out = run_train_py(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    study = optuna.load_study(
        study_name="memfit-tiny_seq2seq-aclsum-nobudget", storage=f"sqlite:///{tmp_path}/optuna.db"
    )
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    steps = {
        t.params["trainer.batch_size"]: len(client.get_metric_history(t.user_attrs["run_id"], "train/loss"))
        for t in study.trials
    }
    assert steps == {1: 3, 4: 6}


@pytest.mark.slow
def test_a_budget_ladder_reuses_measurements_and_writes_one_preset_per_budget(tmp_path):
    args = [
        *readme_command("python train.py -m sweep=ladder")[2:],
        *IN_PROCESS,
        *sweep_outputs(tmp_path),
    ]
    out = run_train_py(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    storage = f"sqlite:///{tmp_path}/optuna.db"
    small = optuna.load_study(study_name="memfit-tiny_seq2seq-aclsum-1.6GiB", storage=storage)
    large = optuna.load_study(study_name="memfit-tiny_seq2seq-aclsum-3GiB", storage=storage)
    reused = [t for t in large.trials if "reused_from" in t.user_attrs]
    ran = [t for t in large.trials if "reused_from" not in t.user_attrs and "not_run" not in t.user_attrs]
    assert reused and len(ran) == 2  # measurements carried over, then 2 new trials run (any told without running aside)
    for trial in reused:
        origin = small.trials[int(trial.user_attrs["reused_from"].split("#")[1])]
        assert trial.params == origin.params and trial.user_attrs["device_seconds"] == 0.0
        assert trial.constraints["memory_gib"] == pytest.approx(origin.user_attrs["worst_case_peak_gib"] - 2.5)
    table = (tmp_path / "sweep" / "ladder.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 1.6 ") or line.startswith("| 3 ")]
    assert len(rows) == 2, table
    for budget in ("1.6", "3"):
        row = next(r for r in rows if r.startswith(f"| {budget} "))
        if "nothing fits" not in row:
            assert (tmp_path / "preset" / f"tiny_seq2seq-aclsum-{budget}gib.yaml").exists()
    assert "nothing fits" not in rows[1]  # 3 GiB holds what 1.6 GiB held, at least
    assert rows[1].split("|")[4].strip() == "256"  # the fixed max source length has its column too
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    ladder = [r for r in runs if "memfit.ladder" in r.data.tags]
    assert len(ladder) == 1 and ladder[0].info.status == "FINISHED"
    assert "ladder.md" in [a.path for a in client.list_artifacts(ladder[0].info.run_id)]
    sweeps = [r for r in runs if "memfit.sweep" in r.data.tags]
    assert len(sweeps) == 2 and all(r.data.tags["mlflow.parentRunId"] == ladder[0].info.run_id for r in sweeps)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.batch_size=interval(10,1)"], "trainer.batch_size=interval(10,1): the interval is empty or inverted"),
        (["trainer.batch_size=range(5,1)"], "trainer.batch_size=range(5,1): the range is empty or inverted"),
        (
            ["trainer.batch_size=2", "memory.max_source_length=64", "memory.max_label_length=32"],
            "hydra.sweeper.params is empty and no choice(...)",
        ),
        (["hydra.sweeper.storage=sqlite:////proc/no/such/dir/optuna.db"], "hydra.sweeper.storage=sqlite:////proc/no"),
        (
            ["hydra.sweeper.storage=postgresql://me:secret@127.0.0.1:9/db"],
            "hydra.sweeper.storage=postgresql://me:***@127.0.0.1:9/db cannot",
        ),
        (["hydra.sweeper.objective=speed"], "hydra.sweeper.objective=speed"),
        (
            ["hydra.sweeper.devices=[0,1]", "hydra.sweeper.isolation=launcher"],
            "hydra.sweeper.devices pins each trial's process to a GPU",
        ),
        (["hydra.sweeper.pin_cores=true"], "hydra.sweeper.pin_cores gives each device's trials their own cores"),
        (["hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0 must be > 0"),
        (
            ["trainer.batch_size=choice(2,4)", "memory.max_label_length=8", "data.max_train_samples=48"],
            "memory.max_label_length=8 keeps",
        ),
        (
            ["budget.gib=100000", "memory.max_label_length=32", "data.max_train_samples=16", *IN_PROCESS],
            "budget.gib=100000 is larger than this ",  # the device's; said by the batch-sizing job (in process here)
        ),
        (
            ["trainer.batch_size=choice(0,2)", "memory.max_label_length=32"],
            "trainer.batch_size=0 is searched, but no trial can run it: trainer.batch_size=0 must be > 0",
        ),
        (
            ["trainer.batch_size=2", "memory.max_label_length=choice(32,4096)"],
            "memory.max_label_length=4096 is searched, but no trial can run it: memory.max_label_length=4096 exceeds",
        ),
    ],
)
def test_a_bad_sweep_setting_is_one_line_and_exit_2(tmp_path, overrides, expected):
    out = run_train_py("-m", "sweep=budget", "model=tiny_seq2seq", f"output_dir={tmp_path}", *overrides, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"memfit: error: {expected}" in out.stderr and "Traceback" not in out.stderr
    assert "secret" not in out.stderr + out.stdout
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded


def test_when_the_sampler_proposes_only_known_configurations_an_unmeasured_one_is_queued():
    """TPE with few feasible trials can keep proposing what it was told is infeasible; the sweeper then queues a
    configuration whose outcome is not known yet, until none is left."""
    from memfit.sweep.telling import TrialTeller

    settings = OmegaConf.create({"seed": 0, "coverage_floor": 0.0, "effective_batch": None})
    sweep = TrialTeller(settings, OmegaConf.create({"trainer": {"batching": "fixed"}}), ["throughput"])
    study = optuna.create_study(direction="maximize")
    space = {
        "trainer.batch_size": optuna.distributions.CategoricalDistribution([4, 8, 16]),
        "memory.max_label_length": optuna.distributions.CategoricalDistribution([64, 128]),
    }
    study.enqueue_trial({"trainer.batch_size": 8, "memory.max_label_length": 128})
    too_large = study.ask(space)
    too_large.set_user_attr("status", "preflight_failed")
    too_large.set_constraint("memory_gib", 3.0)
    study.tell(too_large, 0.0)  # (16, 128) is at least as large: known without running

    explored = []
    while sweep.queue_unexplored(study, space):
        trial = study.ask(space)
        assert trial.user_attrs["explored"] is True
        assert not sweep.told_without_running(study, trial, None)
        explored.append((trial.params["trainer.batch_size"], trial.params["memory.max_label_length"]))
        trial.set_user_attr("status", "ok")
        trial.set_constraint("memory_gib", -1.0)
        study.tell(trial, 100.0)
    assert sorted(explored) == [(4, 64), (4, 128), (8, 64), (16, 64)]  # all but the measured and the dominated


@pytest.mark.slow
def test_a_sweep_chooses_between_fixed_and_budget_shaped_batches_and_searches_the_plans_knobs(
    tmp_path, tiny_seq2seq_calibration
):
    """docs/sweeps.md's command, with random draws that give two fixed, then budget-shaped trials (their plans
    sized by a memory model calibrated before, as on a machine that swept this model already)."""
    tiny_seq2seq_calibration(tmp_path)
    args = [
        *readme_command("python train.py -m sweep=budget model=tiny_seq2seq budget.gib=1.7 hydra.sweeper.n_trials=3")[
            3:
        ],
        "hydra.sweeper.sampler=random",
        "hydra.sweeper.seed=4",
        "hydra.sweeper.fill_budget=0",
        *IN_PROCESS,
        *sweep_outputs(tmp_path),
    ]
    out = run_train_py("-m", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    study = optuna.load_study(study_name="memfit-tiny_seq2seq-aclsum-1.7GiB", storage=f"sqlite:///{tmp_path}/optuna.db")
    ran = [t for t in study.trials if not t.user_attrs.get("not_run")]
    fixed = [t for t in ran if t.params["trainer.batching"] == "fixed"]
    shaped = [t for t in ran if t.params["trainer.batching"] == "budget"]
    assert fixed and shaped, [t.params for t in ran]
    assert all("trainer.micro_batch_fill" not in t.params and "trainer.batch_size" in t.params for t in fixed)
    assert all("trainer.micro_batch_fill" in t.params and "trainer.batch_size" not in t.params for t in shaped)
    assert all("trainer.effective_batch" in t.params for t in shaped)
    assert all("trainer.effective_batch" not in t.params for t in fixed)
    assert all(t.user_attrs["status"] == "ok" and t.values[0] > 0 for t in ran)

    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    runs = {
        r.data.tags.get("memfit.trial"): r
        for r in client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    }
    for trial in shaped:  # the step is the effective batch, cut into budget-shaped micro-batches by its plan
        run = runs[str(trial.number)]
        assert run.data.params["trainer.batch_size"] == "16"
        assert run.data.params["trainer.gradient_accumulation_steps"] == "1"
        assert run.data.params["trainer.micro_batch_fill"] == str(trial.params["trainer.micro_batch_fill"])
        assert run.data.params["trainer.effective_batch"] == trial.params["trainer.effective_batch"]
        assert (
            run_facts(client, run.info.run_id)["plan/max_batch"] >= 1 and "train/micro_batch_size" in run.data.metrics
        )
    best = OmegaConf.load(tmp_path / "preset" / "tiny_seq2seq-aclsum-1.7gib.yaml")
    if best.trainer.batching == "budget":
        assert best.trainer.batch_size == 16 and best.trainer.gradient_accumulation_steps == 1
    else:
        assert best.trainer.gradient_accumulation_steps == 16 // best.trainer.batch_size


def test_a_sweep_with_nothing_feasible_exits_3_naming_the_constraint_that_binds(tmp_path):
    """Every label length searched keeps less than the coverage floor: told from the data alone, no trial runs."""
    out = run_train_py(
        "-m",
        "sweep=budget",
        "model=tiny_seq2seq",
        "budget.gib=1.7",
        "memory.max_label_length=choice(8,16)",
        "trainer.batch_size=choice(1,4)",  # no sizing job: the data alone decides this sweep
        "hydra.sweeper.n_trials=2",
        "data.max_train_samples=48",
        *IN_PROCESS,
        *sweep_outputs(tmp_path),
    )
    assert out.returncode == 3, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "memfit: no feasible configuration: coverage binds: the longest memory.max_label_length searched, 16, keeps"
    ), last
    assert "to memory.max_label_length's choices or set hydra.sweeper.coverage_floor=0." in last
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    parent = [
        r
        for r in client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
        if "memfit.sweep" in r.data.tags
    ]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"  # what it learned is recorded
    space = client.download_artifacts(parent[0].info.run_id, "search_space.txt", str(tmp_path))
    text = Path(space).read_text()  # the recipe's source lengths, derived from the data, beside the label choices
    assert "memory.max_label_length: [8, 16]\n" in text
    assert "memory.max_source_length: [" in text and "(the data's p90, p99, p99.9, longest)" in text
    assert not (tmp_path / "preset").exists()


def test_a_sweep_whose_model_weights_exceed_the_budget_exits_3_before_any_trial(tmp_path):
    """The batch sizing job stops before loading the weights (run.state_bound): no batch is a way out, so the sweep
    ends as nothing feasible, saying why, rather than asking for batch choices."""
    out = run_train_py(
        "-m",
        "sweep=budget",
        "model=tiny_seq2seq",
        "budget.gib=0.005",
        "budget.margin_gib=0",
        "memory.max_label_length=choice(32,64)",
        "hydra.sweeper.n_trials=2",
        "data.max_train_samples=48",
        *IN_PROCESS,
        *sweep_outputs(tmp_path),
    )
    assert out.returncode == 3, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "memfit: no feasible configuration: model=tiny_seq2seq: its weights and their gradients alone take"
    ), last
    assert not (tmp_path / "preset").exists()
