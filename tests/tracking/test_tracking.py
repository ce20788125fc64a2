"""Credentials never reach MLflow; the flattened config is what gets logged."""

from __future__ import annotations

from omegaconf import OmegaConf

from memfit.tracking import flatten, mask_credentials


def test_credentials_are_masked():
    assert mask_credentials("postgresql://memfit:s3cret@db:5432/optuna") == "postgresql://memfit:***@db:5432/optuna"
    assert mask_credentials("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_flatten_gives_dotted_keys_and_masks():
    cfg = OmegaConf.create({"a": {"b": 1, "c": [1, 2]}, "tracking": {"uri": "http://u:p@h:1"}})
    flat = flatten(cfg)
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "tracking.uri": "http://u:***@h:1"}


def test_tags_are_written_in_batches_masked_and_all_kept(tmp_path):
    from mlflow.tracking import MlflowClient

    from memfit.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "memfit", "run", {"memfit.store": "postgresql://me:pw@db/x"})
    tracker.set_tags({f"memfit.tag{i}": i for i in range(150)})  # more than one batch of MLflow's 100
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    assert tags["memfit.store"] == "postgresql://me:***@db/x"
    assert all(tags[f"memfit.tag{i}"] == str(i) for i in range(150))
