"""The sweeper's settings, registered as hydra/sweeper=memfit. Names follow Hydra's Optuna sweeper where they mean
the same thing (n_trials, n_jobs, storage, study_name, sampler, direction, params)."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore


@dataclass
class MemfitSweeperConf:
    _target_: str = "hydra_plugins.memfit_sweeper.memfit_sweeper.MemfitSweeper"
    n_trials: int = 8  # trials run per study, counting earlier runs of it (resume); told ones do not count
    n_jobs: int = 1  # trials launched together per batch
    storage: str | None = None  # SQLAlchemy URL; null: sqlite:///<output_dir>/optuna.db
    study_name: str | None = None  # null: memfit-<model>-<data>-<budget>
    sampler: str = "tpe"  # tpe | random
    seed: int | None = 0
    direction: str | None = None  # null: the objective's own (maximize throughput, minimize loss)
    objective: str = "epoch_throughput"  # epoch_throughput | throughput | loss | coverage | peak | pareto
    pareto: list[str] = field(default_factory=lambda: ["throughput", "loss"])  # objectives of objective=pareto
    coverage_floor: float = 0.0  # a trial keeping less than this share of label tokens is infeasible
    # throughput objectives: trials within this share of the fastest are ties, and the one keeping the most label,
    # then source tokens is picked (sweep.ties); null: the fastest trial's measured spread; 0: the fastest
    tie_band: float | None = None
    # tell without running a configuration the memory model predicts over budget × (1 + margin); null: never
    predict_margin: float | None = 0.1
    # throughput objectives: once the memory model can predict every configuration whose outcome is unknown, the next
    # `fill_budget` trials of a study are those predicted to fill the most of the budget while fitting; 0: none
    fill_budget: int = 2
    effective_batch: int | None = None  # hold batch × accumulation: accumulation = ceil(effective_batch / batch)
    # a fixed-batch trial times the steps that hold about this many micro-batches (3 at least, trainer.max_steps at
    # most) instead of trainer.max_steps steps; null: trainer.max_steps steps (sweep.space.segment_steps)
    segment_micro_batches: int | None = None
    # process: a fresh python process per trial | launcher: Hydra's configured launcher (the basic one runs trials in
    # the sweeper's process; hydra/launcher=submitit_slurm submits them to Slurm); none: the same as launcher
    isolation: str = "process"
    # process isolation: fork each trial's process from a fork server that imported torch, transformers and MLflow
    # once per sweep (8-15 CPU-s a trial no longer pays; no device touched before the trial). false: a new
    # interpreter per trial, for a library that initialises CUDA as it is imported
    fork_trials: bool = True
    trial_timeout_s: float | None = None  # process isolation: a trial still running after this is killed, FAIL
    # several workers on one study (a shared storage): a trial whose worker stops beating for 3 × heartbeat_s is
    # failed and queued again by the others; workers with nothing left to ask poll every poll_s. null: no heartbeat
    heartbeat_s: float | None = 30
    # one trial per GPU at a time, pinned with CUDA_VISIBLE_DEVICES (isolation=process): e.g. [0,1,2,3]
    devices: list[str] | None = None
    # with devices: each device's trial processes run on their own whole physical cores (sched_setaffinity), one
    # thread per core; false: every trial may use every core with torch's default threads (faster on the H200 host
    # measured: two trials at once 29.5 s each unpinned, 33.5 s pinned; benchmarks/README.md)
    pin_cores: bool = False
    poll_s: float = 5
    budgets: list[float] | None = None  # a budget ladder: one study per budget, smallest first, measurements reused
    # where the best feasible configuration is written: null, the sweep directory's preset/ (relative: to the launch
    # directory); export_to: also copied there, e.g. sweeps/preset, where +preset=<name> finds it from the launch dir
    preset_dir: str | None = None
    export_to: str | None = None
    params: dict[str, str] = field(default_factory=dict)  # search space in Hydra override syntax


ConfigStore.instance().store(group="hydra/sweeper", name="memfit", node=MemfitSweeperConf, provider="memfit")
