"""The Hydra task: run, write report.json beside the job, and turn the outcome into an exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config import ConfigError
from memfit.data import DataError
from memfit.run.flow import run
from memfit.run.report import EXIT_BAD_INPUT, EXIT_PREFLIGHT_FAILED, EXIT_RUN_FAILED, RunReport
from memfit.run.signals import Stopped, stop_on_signals


def _write_report(report: RunReport) -> None:
    """report.json in the Hydra job's output directory, for scripts and for resuming sweeps."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        path = Path(HydraConfig.get().runtime.output_dir) / "report.json"
        try:
            path.write_text(json.dumps(report.to_dict(), indent=1))
        except OSError as err:  # a full or read-only disk: the outcome is still printed and in MLflow
            print(f"memfit: warning: {path} not written: {err.strerror or err}", file=sys.stderr)


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def main(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra task. Bad input: one line per problem, exit 2. Preflight does not fit: exit 3. A failed run: exit 1
    (in a single run; in a multirun the report goes back to the sweeper and the sweep goes on)."""
    try:
        with stop_on_signals():
            report = run(cfg)
    except Stopped as err:  # recorded KILLED in MLflow by run(), its metrics flushed
        _write_report(RunReport(status="interrupted", reason=f"killed: {err}"))
        print(
            f"memfit: {err}: the run ended KILLED (rerun with trainer.resume=true to continue a checkpointed run)",
            file=sys.stderr,
        )
        sys.exit(err.exit_code)
    except (ConfigError, DataError) as err:
        for line in str(err).splitlines():
            print(f"memfit: error: {line}", file=sys.stderr)
        invalid = RunReport(status="invalid", reason=str(err).splitlines()[0])
        _write_report(invalid)
        if _in_multirun():  # one bad trial must not end the sweep: report it instead
            return invalid.to_dict()
        sys.exit(EXIT_BAD_INPUT)
    except Exception as err:  # recorded FAILED in MLflow by run(); report.json says so too, for a sweeper
        first_line = str(err).splitlines()[0] if str(err) else ""
        _write_report(RunReport(status="failed", reason=f"failed: {type(err).__name__}: {first_line}"))
        raise
    _write_report(report)
    if report.status != "ok" and not _in_multirun():
        print(f"memfit: {report.status}: {report.reason}", file=sys.stderr)
        sys.exit(EXIT_PREFLIGHT_FAILED if report.status == "preflight_failed" else EXIT_RUN_FAILED)
    return report.to_dict()
