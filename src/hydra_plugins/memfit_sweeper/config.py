"""The sweeper's settings, registered as hydra/sweeper=memfit. Names follow Hydra's Optuna sweeper where they mean
the same thing (n_trials, n_jobs, storage, study_name, sampler, direction, params)."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore


@dataclass
class MemfitSweeperConf:
    _target_: str = "hydra_plugins.memfit_sweeper.memfit_sweeper.MemfitSweeper"
    n_trials: int = 8  # trials in the study, counting those of earlier runs of the same study (resume)
    n_jobs: int = 1  # trials launched together per batch
    storage: str | None = None  # SQLAlchemy URL; null: sqlite:///<output_dir>/optuna.db
    study_name: str | None = None  # null: memfit-<model>-<data>-<budget>
    sampler: str = "tpe"  # tpe | random
    seed: int | None = 0
    direction: str = "maximize"  # maximize tokens/s (objective=throughput) | minimize (objective=loss)
    objective: str = "throughput"  # throughput: tokens/s of the timed segment | loss: final eval (or train) loss
    coverage_floor: float = 0.0  # a trial keeping less than this share of label tokens is infeasible
    effective_batch: int | None = None  # hold batch × accumulation: accumulation = ceil(effective_batch / batch)
    preset_dir: str = "sweeps/preset"  # where the best feasible configuration is exported (relative to launch dir)
    params: dict[str, str] = field(default_factory=dict)  # search space in Hydra override syntax


ConfigStore.instance().store(group="hydra/sweeper", name="memfit", node=MemfitSweeperConf, provider="memfit")
