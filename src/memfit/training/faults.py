"""Fault injection, for proving that sweeps and runs survive faults: MEMFIT_FAULTS="<run name>=<fault>@<step>,...".

Faults: `oom` raises the allocator's own OutOfMemoryError, `crash` raises RuntimeError, `nan` poisons a trainable
weight with NaN (the loss turns NaN on its own from there), `kill` SIGKILLs the process (nothing runs after it),
`term` sends it SIGTERM (as a preemption does).
Each fires at the end of optimizer step <step> of the run whose tracking run name matches; other runs are untouched.
It is read from the environment, never from config, so a fault cannot slip into a logged or exported configuration.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

log = logging.getLogger(__name__)

ENV = "MEMFIT_FAULTS"
KINDS = ("oom", "crash", "nan", "kill", "term")


def parse(spec: str) -> dict[str, tuple[str, int]]:
    """{run name: (fault, step)} from "trial-1=oom@2,trial-3=nan@1"."""
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, what = item.partition("=")
        kind, _, step = what.partition("@")
        if kind not in KINDS or not step.isdigit() or not name:
            raise ValueError(f"{ENV}: {item!r} is not <run name>=<{'|'.join(KINDS)}>@<step>")
        faults[name] = (kind, int(step))
    return faults


def _fire(kind: str, step: int, model: Any) -> None:
    import torch

    log.warning("%s: injecting %s at step %d", ENV, kind, step)
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB ({ENV} at step {step})")
    if kind == "crash":
        raise RuntimeError(f"injected crash ({ENV} at step {step})")
    if kind in ("kill", "term"):
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGTERM)
        return
    with torch.no_grad():  # nan
        next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))


def callbacks_for(run_name: str) -> list[Any]:
    """The TrainerCallback that injects this run's fault, if MEMFIT_FAULTS names it."""
    fault = parse(os.environ.get(ENV, "")).get(run_name)
    if fault is None:
        return []
    from transformers import TrainerCallback

    kind, at_step = fault

    class InjectFault(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.global_step == at_step:
                _fire(kind, at_step, model)

    return [InjectFault()]
