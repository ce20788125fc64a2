"""A thin Hydra Sweeper over memfit.sweep, imported only when a sweep runs so plugin discovery stays cheap."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class MemfitSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from memfit.sweep import BudgetSweep

        self._impl = BudgetSweep(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        with _one_line_errors():
            self._impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from memfit.run.signals import stop_on_signals

        with _one_line_errors(), stop_on_signals():
            return self._impl.sweep(arguments)


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """A bad sweep setting: `memfit: error: <field>: <fix>` and exit 2, not a traceback."""
    from memfit.run.signals import Stopped
    from memfit.sweep.space import SweepConfigError
    from memfit.sweep.verdict import NothingFeasible

    try:
        yield
    except SweepConfigError as error:
        print(f"memfit: error: {error}", file=sys.stderr)
        sys.exit(2)
    except NothingFeasible as nothing:  # everything is recorded; the line says which constraint binds
        print(f"memfit: no feasible configuration: {nothing}", file=sys.stderr)
        sys.exit(3)
    except Stopped as stop:  # the sweep's MLflow run ended KILLED, its running trials recorded as interrupted
        print(f"memfit: the sweep was {stop}: rerun the same command to resume it", file=sys.stderr)
        sys.exit(stop.exit_code)
