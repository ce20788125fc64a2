"""One run: its flow (flow.py) over typed phase values (context.py), its report and exit codes (report.py), and
the Hydra task around it (main.py)."""

from memfit.run.flow import run
from memfit.run.identity import core_ranges, run_name
from memfit.run.main import main
from memfit.run.report import RunReport

__all__ = ["RunReport", "core_ranges", "main", "run", "run_name"]
