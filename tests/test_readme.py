"""The README's commands (outputs redirected to a temporary directory), forked from the suite's fork server as the
other tests' runs are; .ci/readme_examples.py runs each in a new interpreter, as a user does, and checks what only
a fresh process shows (warnings at import). The estimate_only example runs there alone: its memory model, fitted
from nothing, costs a minute of the suite's 2 cores, and tests/memory/test_calibration.py covers the same path."""

from __future__ import annotations

import re
import subprocess

import pytest

from memfit.tracking import default_tracking_uri
from tests.conftest import (
    FAST,
    ONE_WORKER,
    ROOT,
    finished_runs,
    free_port,
    readme_command,
    readme_mlflow_ui,
    run_train_py,
    served_runs,
    serving,
)

pytestmark = pytest.mark.slow


def run_train(argv: list[str], tmp_path, cwd=ROOT, quiet=True) -> subprocess.CompletedProcess:
    assert argv[:2] == ["python", "train.py"]
    out = run_train_py(*argv[2:], f"output_dir={tmp_path}", cwd=cwd, quiet=quiet)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_tiny_causal_example(tmp_path):
    out = run_train(readme_command("python train.py model=tiny_causal"), tmp_path)
    run = finished_runs(tmp_path)[0]
    assert run.data.tags["memfit.memory"] == "tight"
    assert run.data.params["memory.loss"] == "chunked"  # tight's: the head over the labels, a chunk at a time
    assert re.search(r"model tiny_causal: 1\.0M params, \d\.\dk trainable", out.stdout)  # not "0.00M"


def test_preflight_only_example(tmp_path):
    command = readme_command("python train.py model=tiny_seq2seq preflight_only=true")
    out = run_train(command, tmp_path, quiet=False)
    shown = out.stderr  # as at a terminal: long work shows progress
    assert re.search(r"^Map: 100%.* 300/300", shown, re.M)  # tokenizing the training split
    assert re.search(r"^preflight .* 1/1 ", shown, re.M)  # the worst-batch probes
    assert re.search(r"^max batch search .* largest fitting batch \d+", shown, re.M)
    # no budget.gib on CPU: the limit is the host's free memory, and the log says so
    logged = out.stdout
    assert "budget: no budget.gib: the host's free memory" in logged and "(the host's free memory now " in logged
    report = next(tmp_path.glob("runs/*/*/report.json")).read_text()
    assert '"max_batch"' in report and '"status": "ok"' in report
    run = finished_runs(tmp_path)[0]
    assert run.data.tags["memfit.mode"] == "preflight_only" and "train/loss" not in run.data.metrics


def test_a_policy_multirun_gives_comparable_runs_that_mlflow_ui_serves(tmp_path):
    """The README's policy comparison and `mlflow ui` command, on the tiny model (.ci/readme_examples.py runs the
    README's own, the default job three times): one multirun, a run per policy with its peak and knobs, served."""
    readme = readme_command("python train.py -m memory=off,balanced,tight")
    assert readme[2:4] == ["-m", "memory=off,balanced,tight"]
    tiny = [o for o in FAST if not o.startswith("memory.precision")]  # each policy keeps its own precision
    out = run_train(["python", "train.py", *readme[2:4], "model=tiny_seq2seq", *tiny], tmp_path)
    assert "anterior to 4.12.0" not in out.stderr
    runs = finished_runs(tmp_path)
    assert sorted(r.data.tags["memfit.memory"] for r in runs) == ["balanced", "off", "tight"]
    assert all(r.data.metrics["summary/peak_allocated_gib"] > 0 for r in runs)
    assert {r.data.params["memory.gradient_checkpointing"] for r in runs} == {"True", "False"}
    port = free_port()
    ui = readme_mlflow_ui(default_tracking_uri(str(tmp_path)), port)
    with serving([*ui, *ONE_WORKER], port, cwd=tmp_path) as url:
        served = served_runs(url, runs[0].info.experiment_id)
    assert len(served) == 3
    keys = {m["key"] for m in served[0]["data"]["metrics"]}
    assert {"summary/peak_allocated_gib", "train/loss"} <= keys


def test_readme_test_command_matches_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    README = (ROOT / "README.md").read_text()  # noqa: N806
    command = re.search(r"^pip install torch==2\.13\.0 -e \"\.\[test\]\" && pytest$", README, re.M)
    assert command and command.group(0) in ci
    assert "pip install torch==2.13.0 -e . && python train.py" in README and "&& python train.py\n" in ci
    assert "python .ci/readme_examples.py" in ci  # the README's examples, each in a new interpreter as a user runs it
