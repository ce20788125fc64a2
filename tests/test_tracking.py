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
