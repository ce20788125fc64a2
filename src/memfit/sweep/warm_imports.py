"""Imported once per sweep by the fork server its trial processes are forked from (memfit.sweep.trial_process):
what a trial imports on every path (run, data, models, training, tracking), heaviest first, so that no trial pays it.

Nothing here may touch a device: a CUDA context made in the server would be inherited, unusable, by every trial.
"""

from __future__ import annotations

import contextlib
import importlib

MODULES = (
    "torch",
    "transformers",
    "transformers.trainer",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "datasets",
    "peft",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",  # what a sqlite or PostgreSQL store opens (0.8 s, lazily imported)
    "matplotlib.pyplot",
    "memfit.run",
)


def warm(modules: tuple[str, ...] = MODULES) -> None:
    import os

    # an import that asks torch.cuda.is_available() would otherwise initialise the CUDA driver here, which a forked
    # process cannot use; through NVML the answer touches no driver state. Only while importing: a process that
    # imports this module for the imports alone (the test suite's) keeps its own environment.
    before = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        import matplotlib

        matplotlib.use("Agg")  # what a trial would pick without a display; set before pyplot is imported
        for name in modules:
            with contextlib.suppress(Exception):  # an optional extra or a broken install: the trial reports it
                importlib.import_module(name)
    finally:
        if before is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = before


def cuda_initialised() -> bool:
    """Whether an import initialised CUDA in this process: then a process forked from it cannot use the device."""
    import torch

    return torch.cuda.is_initialized()


warm()
CUDA_INITIALISED = cuda_initialised()  # read by each forked trial (memfit.sweep.trial_process), which then stops
