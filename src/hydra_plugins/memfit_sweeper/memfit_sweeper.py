"""A thin Hydra Sweeper over memfit.sweep, imported only when a sweep runs so plugin discovery stays cheap."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class MemfitSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from memfit.sweep import BudgetSweep

        self._impl = BudgetSweep(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self._impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self._impl.sweep(arguments)
