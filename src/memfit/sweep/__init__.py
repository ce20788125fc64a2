"""memfit's budget sweep (hydra/sweeper=memfit): search space, trial outcomes, trial processes, the study loop,
the budget ladder and the results it leaves."""

from memfit.sweep.outcome import TrialOutcome, objective_names, outcome_of
from memfit.sweep.space import dominated_by, parse_search, repeat_of
from memfit.sweep.study import BudgetSweep

__all__ = ["BudgetSweep", "TrialOutcome", "dominated_by", "objective_names", "outcome_of", "parse_search", "repeat_of"]
