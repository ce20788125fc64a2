"""The sweep's MLflow runs when the tracking store changes between a study's runs."""

from __future__ import annotations

import logging

import optuna
from mlflow.tracking import MlflowClient

from memfit.sweep.runs import parent_run


def test_a_study_resumed_against_a_store_without_its_run_opens_a_new_sweep_run_there_and_says_so(
    compose_cfg, tmp_path, caplog
):
    first = compose_cfg("model=tiny_seq2seq", f"tracking.uri=sqlite:///{tmp_path}/first.db")
    study = optuna.create_study(study_name="memfit-sweep", storage=f"sqlite:///{tmp_path}/optuna.db")
    earlier = parent_run(first, study, 1.7, ["throughput"])
    earlier.finish("FINISHED")
    assert study.user_attrs["mlflow_parent_run_id"] == earlier.run_id
    assert parent_run(first, study, 1.7, ["throughput"]).run_id == earlier.run_id  # same store: continued

    moved = compose_cfg("model=tiny_seq2seq", f"tracking.uri=sqlite:///{tmp_path}/second.db")
    with caplog.at_level(logging.WARNING, logger="memfit.sweep"):
        parent = parent_run(moved, study, 1.7, ["throughput"])  # MLflow alone: "Run with id=... not found"
    parent.finish("FINISHED")
    assert parent.run_id != earlier.run_id and f"its run {earlier.run_id} is not in sqlite:///" in caplog.text
    assert study.user_attrs["mlflow_parent_run_id"] == parent.run_id
    client = MlflowClient(f"sqlite:///{tmp_path}/second.db")
    assert client.get_run(parent.run_id).data.tags["memfit.sweep"] == "memfit-sweep"
