"""Which study a sweep continues. Rerunning the same command resumes its study; a rerun that measures something
else (another search space, objective, effective batch, coverage floor or fixed setting) cannot share the study:
Optuna refuses a categorical parameter whose choices changed, and its earlier trials would be told against another
question. So each study records what it measures, and a sweep whose derived name holds a study that measured
something else starts its own study, named with a digest of what it measures (a rerun of the changed command
resumes that one). A name the user gave (`hydra.sweeper.study_name`) is never changed: that is one line, exit 2.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from memfit.sweep.space import SweepConfigError

log = logging.getLogger("memfit.sweep")

MEASURES_ATTR = "memfit:measures"  # the study's user attr: what it measures (what_it_measures)
# fixed settings that change where a sweep records, not what it measures
NOT_MEASURED = ("tracking.", "output_dir", "calibration.cache_dir", "hydra.", "budget.gib")


def what_it_measures(
    searched: Any,
    objectives: list[str],
    effective_batch: int | None,
    coverage_floor: float,
    segment_micro_batches: int | None = None,
) -> dict[str, Any]:
    """The settings that decide what a study's trials measure and how they are judged, as plain JSON values.
    `searched`: the sweep's space and fixed overrides (sweep.derive.SearchSpace). The timed segment's size is
    recorded only where set, so that studies from before it existed are still resumed."""
    from optuna.distributions import distribution_to_json

    space = searched.space
    measured = sorted(o for o in searched.fixed if not o.lstrip("+~").startswith(NOT_MEASURED))
    return {
        "space": {key: json.loads(distribution_to_json(space[key])) for key in sorted(space)},
        "objectives": list(objectives),
        "fixed": measured,
        "effective_batch": effective_batch,
        "coverage_floor": coverage_floor,
    } | ({"segment_micro_batches": segment_micro_batches} if segment_micro_batches else {})


def digest(measured: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(measured, sort_keys=True).encode()).hexdigest()[:8]


def differences(before: dict[str, Any], now: dict[str, Any]) -> str:
    """'space memory.max_label_length: [64, 128] → [256, 512]; objectives: ...': what changed, shortly."""
    parts = []
    for key in sorted(set(before) | set(now)):
        if key == "space":
            old, new = before.get("space", {}), now.get("space", {})
            for param in sorted(set(old) | set(new)):
                if old.get(param) != new.get(param):
                    parts.append(f"{param}: {_shown(old.get(param))} → {_shown(new.get(param))}")
        elif before.get(key) != now.get(key):
            parts.append(f"{key}: {before.get(key)} → {now.get(key)}")
    return "; ".join(parts)


def _shown(distribution: dict[str, Any] | None) -> str:
    if distribution is None:
        return "not searched"
    attrs = distribution.get("attributes", {})
    return str(attrs["choices"]) if "choices" in attrs else f"[{attrs.get('low')}, {attrs.get('high')}]"


def recorded(storage: Any | None, name: str) -> dict[str, Any] | None:
    """What the study of this name in an open storage records that it measures; None where there is no storage
    (storage.peek) or no such study, or it records nothing (made before studies recorded it)."""
    if storage is None:
        return None
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return storage.get_study_user_attrs(study_id).get(MEASURES_ATTR)


def choose(name: str, existing: dict[str, Any] | None, measured: dict[str, Any], named_by_user: bool) -> str:
    """The study this sweep uses: `name` when the storage holds no such study, or one that measures the same (or
    records nothing); otherwise `name-<digest>` (said in the log), or a SweepConfigError where the user named it."""
    if existing is None or existing == measured:
        return name
    changed = differences(existing, measured)
    if named_by_user:
        raise SweepConfigError(
            f"hydra.sweeper.study_name={name} measured another search ({changed}): give a new "
            "hydra.sweeper.study_name to start a study for this one, or rerun with the study's own settings"
        )
    own = f"{name}-{digest(measured)}"
    log.warning("study %s measured another search (%s): this sweep is study %s (%s is kept)", name, changed, own, name)
    return own


def record(study: Any, measured: dict[str, Any]) -> None:
    """A new study (or one from before studies recorded it) records what it measures."""
    if MEASURES_ATTR not in study.user_attrs:
        study.set_user_attr(MEASURES_ATTR, measured)
