"""A rerun that measures something else never reuses a study: it gets its own, or one line where the user named it."""

from __future__ import annotations

import logging

import optuna
import pytest
from omegaconf import OmegaConf

from memfit.sweep import naming, parse_search
from memfit.sweep.derive import SearchSpace
from memfit.sweep.naming import MEASURES_ATTR, differences, record, what_it_measures
from memfit.sweep.space import SweepConfigError, suggest
from memfit.sweep.storage import open_study

SETTINGS = OmegaConf.create(
    {"n_jobs": 1, "devices": None, "heartbeat_s": None, "sampler": "random", "seed": 0, "n_trials": 4, "storage": None}
)


def measures(
    labels: str, objective: str = "throughput", fixed: tuple[str, ...] = (), floor: float = 0.99, segment=None
) -> dict:
    space, _ = parse_search(["trainer.batch_size=choice(2,8)", f"memory.max_label_length=choice({labels})"], {})
    searched = SearchSpace(space, ["model=tiny_seq2seq", *fixed])
    return what_it_measures(searched, [objective], 32, floor, segment), space


def open_and_measure(url: str, measured: dict, space: dict, named_by_user: bool = False) -> optuna.Study:
    """Open the study as the sweeper does, and run one trial of the space in it."""

    def choose(storage) -> str:  # as BudgetSweep._open names its study
        return naming.choose("memfit-sweep", naming.recorded(storage, "memfit-sweep"), measured, named_by_user)

    study, _ = open_study("memfit-sweep", url, SETTINGS, ["maximize"], lambda *_: None, choose_name=choose)
    record(study, measured)
    trial = study.ask()
    suggest(trial, space, "fixed", 32)
    study.tell(trial, 1.0)
    return study


def test_a_rerun_that_widens_a_choice_gets_its_own_study_and_the_same_command_resumes_it(tmp_path, caplog):
    url = f"sqlite:///{tmp_path}/optuna.db"
    first = open_and_measure(url, *measures("64,128"))
    assert first.study_name == "memfit-sweep" and first.user_attrs[MEASURES_ATTR]["space"]
    assert open_and_measure(url, *measures("64,128")).study_name == "memfit-sweep"  # the same command resumes
    with caplog.at_level(logging.WARNING, logger="memfit.sweep"):
        wider = open_and_measure(url, *measures("256,512,1024"))  # Optuna alone: "dynamic value space"
    assert wider.study_name.startswith("memfit-sweep-") and len(wider.trials) == 1
    assert "memory.max_label_length: [64, 128] → [256, 512, 1024]" in caplog.text
    assert open_and_measure(url, *measures("256,512,1024")).study_name == wider.study_name  # and resumes too
    assert len(optuna.load_study(study_name="memfit-sweep", storage=url).trials) == 2  # the first one is kept


@pytest.mark.parametrize(
    ("changed", "shown"),
    [
        ({"objective": "epoch_throughput"}, "objectives: ['throughput'] → ['epoch_throughput']"),
        ({"fixed": ("trainer.max_steps=5",)}, "fixed: "),
        ({"floor": 0.9}, "coverage_floor: 0.99 → 0.9"),
        ({"segment": 40}, "segment_micro_batches: None → 40"),  # a shorter timed segment measures another rate
    ],
)
def test_another_objective_fixed_setting_or_floor_is_another_study(tmp_path, changed, shown):
    url = f"sqlite:///{tmp_path}/optuna.db"
    open_and_measure(url, *measures("64,128"))
    other, space = measures("64,128", **changed)
    assert open_and_measure(url, other, space).study_name != "memfit-sweep"
    assert shown in differences(measures("64,128")[0], other)


def test_where_records_go_is_not_what_a_study_measures():
    moved = measures("64,128", fixed=("tracking.uri=sqlite:////tmp/elsewhere.db", "output_dir=/tmp/x"))[0]
    assert moved == measures("64,128")[0]


def test_a_study_the_user_named_is_never_renamed_a_changed_search_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/optuna.db"
    open_and_measure(url, *measures("64,128"), named_by_user=True)
    with pytest.raises(SweepConfigError, match=r"^hydra.sweeper.study_name=memfit-sweep measured another search \("):
        open_and_measure(url, *measures("256,512"), named_by_user=True)


def test_a_study_from_before_studies_recorded_their_search_gives_one_line_not_a_traceback(tmp_path):
    url = f"sqlite:///{tmp_path}/optuna.db"
    old = optuna.create_study(study_name="memfit-sweep", storage=url, direction="maximize")
    old.enqueue_trial({"trainer.batch_size": 2, "memory.max_label_length": 64})
    trial = old.ask(
        {
            "trainer.batch_size": optuna.distributions.CategoricalDistribution([2, 8]),
            "memory.max_label_length": optuna.distributions.CategoricalDistribution([64, 128]),
        }
    )
    old.tell(trial, 1.0)
    with pytest.raises(SweepConfigError, match=r"^memory.max_label_length: study memfit-sweep searched other choices"):
        open_and_measure(url, *measures("256,512"))
