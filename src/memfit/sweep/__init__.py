"""memfit's budget sweep (hydra/sweeper=memfit): the search space (space), trial outcomes (outcome), the proposal
rules (proposals), the storage and its recovery (storage), telling trials (telling), the loop (study), the trial
processes (trials; trial_process and warm_imports, the fork server's), the MLflow runs (runs), the budget ladder
(ladder) and the results (results)."""

from memfit.sweep.outcome import TrialOutcome, objective_names, outcome_of
from memfit.sweep.space import dominated_by, parse_search, repeat_of
from memfit.sweep.study import BudgetSweep

__all__ = ["BudgetSweep", "TrialOutcome", "dominated_by", "objective_names", "outcome_of", "parse_search", "repeat_of"]
