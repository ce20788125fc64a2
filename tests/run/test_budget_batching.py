"""trainer.batching=budget end to end on CPU (host-memory budget, tiny models): the plan is calibrated and proven
by real probes before step 1, recorded in MLflow, and training takes budget-shaped micro-batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from memfit.config import ConfigError
from memfit.run import run
from memfit.tracking import default_tracking_uri, run_facts
from tests.conftest import FAST, readme_command

pytestmark = pytest.mark.slow


def _documented() -> list[str]:
    """The overrides of docs/batching.md's command."""
    return readme_command("python train.py model=tiny_seq2seq trainer.batching=budget")[2:]


def _budget_run(compose_cfg, data, *overrides):
    """docs/batching.md's command on a long-tail JSONL, on CPU, with the suite's fast settings where it sets none."""
    documented = _documented()
    keys = {o.split("=")[0] for o in [*documented, *overrides]}
    fast = [o for o in FAST if o.split("=")[0] not in keys | {"data.max_train_samples", "memory.max_label_length"}]
    return run(
        compose_cfg(
            *documented,
            "data=jsonl",
            f"data.path={data}",
            *fast,
            "memory.max_label_length=512",
            "memory.pad_to_multiple_of=8",
            "calibration.probe_tokens=1024",
            "budget.margin_gib=0",
            *overrides,
        )
    )


def _plan(client, run_id) -> dict:
    path = client.download_artifacts(run_id, "batch_plan/batch_plan.json")
    with open(path) as f:
        return json.load(f)


def test_a_binding_budget_gives_long_labels_small_micro_batches_short_ones_large(compose_cfg, long_tail_jsonl):
    roomy = _budget_run(compose_cfg, long_tail_jsonl, "budget.gib=16", "preflight_only=true")
    assert roomy.status == "ok"
    client = MlflowClient(default_tracking_uri(roomy_dir := str(compose_cfg().output_dir)))
    first = _plan(client, roomy.run_id)
    assert {cell["batch"] for cell in first["cells"]} == {16}  # roomy: every cell at the step's 16 samples
    # the default, auto, resolves to the cheaper epoch before the plan is recorded (which: tests/data/test_packing.py)
    assert first["effective_batch"] in ("tokens", "samples")
    assert client.get_run(roomy.run_id).data.tags["memfit.effective_batch"] == first["effective_batch"]
    short = min(cell["predicted_gib"] for cell in first["cells"])
    longest = max(m["reserved_gib"] for m in first["measured"])
    budget = (short + longest) / 2  # between the short cells' peak and the long labels': it binds

    shaped = [f"budget.gib={budget:.3f}", "trainer.max_steps=3", "trainer.pad_tolerance=0.1"]
    shaped.append("forensics.micro_batch_peaks=true")
    report = _budget_run(compose_cfg, long_tail_jsonl, *shaped)
    assert report.status == "ok" and report.steps == 3, report.reason
    run_id = report.run_id
    plan = _plan(client, run_id)
    batches = [cell["batch"] for cell in plan["cells"] if cell["samples"] > 0]
    assert max(batches) == 16 and min(batches) <= 12  # short cells large, long-label cells smaller
    assert all(m["reserved_gib"] <= plan["limit_gib"] for m in plan["measured"] if not m["oom"]) or plan["rounds"] > 1
    proven = {tuple(m["shape"]) for m in plan["measured"] if not m["oom"] and m["reserved_gib"] <= plan["limit_gib"]}
    assert proven  # every proof shape measured within the limit (the run would have stopped otherwise)
    recorded = client.get_run(run_id)
    facts = run_facts(client, run_id)
    assert recorded.info.status == "FINISHED" and facts["plan/max_batch"] == 16
    assert 0 < recorded.data.metrics["eval/loss"] < 20  # evaluation on packed batches: a per-token loss
    assert facts["plan/min_batch"] < 16 and facts["preflight/passed"] == 1.0
    assert recorded.data.params["memfit.calibration"]  # the plan was sized by the memory model, calibrated on CPU
    sizes = client.get_metric_history(run_id, "train/micro_batch_size")
    micro = client.get_metric_history(run_id, "train/micro_batches")
    assert [m.step for m in sizes] == [1, 2, 3] and all(m.value >= 1 for m in sizes)
    assert all(m.value >= 1 for m in micro)
    # auto, where memory binds: token steps fill the micro-batches that steps of samples leave part empty
    assert recorded.data.tags["memfit.effective_batch"] == "tokens" and plan["effective_batch"] == "tokens"
    assert plan["pad_tolerance"] == 0.1  # micro-batches drawn among samples of like length
    samples = client.get_metric_history(run_id, "train/samples")  # a step's samples: its label tokens held constant
    assert [m.step for m in samples] == [1, 2, 3] and all(m.value >= 1 for m in samples)
    table = Path(client.download_artifacts(run_id, "batch_plan/batch_plan.txt")).read_text()
    assert "batch plan (trainer.batching=budget)" in table
    _check_micro_batch_peaks(client, run_id, sum(m.value for m in micro), report.peak_where)
    # the run's peak is training's own (its logged windows), not the preflight's probes before it (here larger)
    keys = ("mem/peak_allocated_gib", "mem/eval_peak_allocated_gib")
    windows = [m.value for key in keys for m in client.get_metric_history(run_id, key)]
    assert report.peak_allocated_gib == pytest.approx(max(windows), abs=0.02)
    assert recorded.data.metrics["summary/peak_allocated_gib"] == pytest.approx(report.peak_allocated_gib)
    assert roomy_dir  # both runs in one store


def _check_micro_batch_peaks(client, run_id: str, micro_batches: float, peak_where: str | None) -> None:
    """forensics.micro_batch_peaks: a row per micro-batch trained and per optimizer step, the highest one named."""
    path = client.download_artifacts(run_id, "forensics/micro_batch_peaks.tsv")
    rows = [line.split("\t") for line in Path(path).read_text().splitlines()[1:]]
    micro = [row for row in rows if row[1] != "between"]
    assert len(micro) == micro_batches and all("input_ids" in row[2] and "labels" in row[2] for row in micro)
    assert [int(row[0]) for row in rows if row[1] == "between"] == [1, 2, 3]  # each step's optimizer step
    highest = max(rows, key=lambda row: float(row[3]))
    assert peak_where == client.get_run(run_id).data.tags["memfit.peak_where"]
    assert peak_where.startswith(f"step {highest[0]}, ") and peak_where.endswith(" GiB allocated")
    named = float(peak_where.rsplit(": ", 1)[1].split()[0])  # two decimals of the value the table holds to three
    assert named == pytest.approx(float(highest[3]), abs=0.0051)


def test_a_resumed_run_trains_the_plan_recorded_beside_its_checkpoints(compose_cfg, long_tail_jsonl):
    """The plan a checkpointed run trains is kept beside its checkpoints; a resumed run replays it (measured again),
    so its epoch packs as the first run's did whatever a fresh proof would size (changed settings prove a new one:
    tests/run/test_plan_record.py)."""
    common = ["budget.gib=16", "trainer.batch_size=4", "trainer.save_steps=1", "tracking.run_name=replayed"]
    first = _budget_run(compose_cfg, long_tail_jsonl, *common, "trainer.max_steps=1")
    assert first.status == "ok", first.reason
    client = MlflowClient(default_tracking_uri(str(compose_cfg().output_dir)))
    path = Path(compose_cfg().output_dir) / "checkpoints" / "replayed" / "batch_plan.json"
    record = json.loads(path.read_text())
    assert record["effective_batch"] == client.get_run(first.run_id).data.tags["memfit.effective_batch"]
    assert {rows for _, _, rows in record["batches"]} == {4}  # roomy: the step's 4 samples a micro-batch
    record["batches"] = [[i, j, 2] for i, j, _ in record["batches"]]  # as sized where memory was tighter
    path.write_text(json.dumps(record))

    resumed = _budget_run(compose_cfg, long_tail_jsonl, *common, "trainer.max_steps=2", "trainer.resume=true")
    assert resumed.status == "ok" and resumed.run_id == first.run_id, resumed.reason
    assert client.get_run(first.run_id).data.tags["memfit.batch_plan"].startswith("replayed")
    assert {cell["batch"] for cell in _plan(client, first.run_id)["cells"]} == {2}
    sizes = {m.step: m.value for m in client.get_metric_history(first.run_id, "train/micro_batch_size")}
    assert sizes[1] > 2 and 1 <= sizes[2] <= 2  # step 2 packed by the recorded plan, not a fresh one's 4 rows


def test_a_causal_plan_fits_its_edges_to_the_memory_model_one_cell_where_the_budget_is_roomy(
    compose_cfg, long_tail_jsonl
):
    """A causal LM's edges are fitted (memfit.memory.edges): where every length allows the step's 16 rows, one cell
    and one proof probe serve them all, where the data's quantiles would cut several."""
    report = _budget_run(compose_cfg, long_tail_jsonl, "model=tiny_causal", "budget.gib=16", "preflight_only=true")
    assert report.status == "ok", report.reason
    plan = _plan(MlflowClient(default_tracking_uri(str(compose_cfg().output_dir))), report.run_id)
    assert plan["task"] == "causal" and len(plan["source_edges"]) == 1 and len(plan["cells"]) == 1
    assert plan["cells"][0]["batch"] == 16 and len(plan["measured"]) == 1


def test_a_sample_that_does_not_fit_alone_stops_the_run_before_step_1_with_one_line(compose_cfg, long_tail_jsonl):
    report = _budget_run(compose_cfg, long_tail_jsonl, "budget.gib=0.3")  # less than the Python process itself
    assert report.status == "preflight_failed"
    assert "\n" not in report.reason and "trainer.batching=budget: a sample of source" in report.reason
    assert "label 304" in report.reason and "raise budget.gib" in report.reason  # the longest label is named
    client = MlflowClient(default_tracking_uri(str(compose_cfg().output_dir)))
    recorded = client.get_run(report.run_id)
    assert recorded.info.status == "FAILED" and run_facts(client, report.run_id)["preflight/passed"] == 0.0
    assert "train/loss" not in recorded.data.metrics


def test_budget_batching_contradictions_are_one_line_before_any_model_load(compose_cfg):
    with pytest.raises(ConfigError) as err:
        run(compose_cfg("model=tiny_seq2seq", *FAST, "trainer.batching=budget", "preflight.enabled=false"))
    assert "trainer.batching=budget contradicts preflight.enabled=false" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run(compose_cfg("model=tiny_seq2seq", *FAST, "trainer.batching=sometimes"))
    assert "trainer.batching='sometimes' is not one of auto, fixed, budget" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run(compose_cfg("model=tiny_seq2seq", *FAST, "trainer.batching=budget", "trainer.effective_batch=rows"))
    assert "trainer.effective_batch='rows' is not one of tokens, samples" in str(err.value)
