"""Hydra's and OmegaConf's errors from the command line in memfit's one-line form, exit 2: an unknown key or group
option (with the nearest valid names), a value of the wrong type, a missing `???` value, an override that does not
parse. HYDRA_FULL_ERROR=1 still shows Hydra's own full trace."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import traceback
import typing
from collections.abc import Callable
from typing import Any

EXPECTED = {
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "bool": "true or false",
    "String": "a string",
}


def schema_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config schema (memfit.config.schema.TrainConfig), nested sections included."""
    from memfit.config.schema import TrainConfig

    cls = cls or TrainConfig
    keys = []
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        keys.append(key)
        kind = typing.get_type_hints(cls).get(field.name)
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, f"{key}.")
    return keys


# keys no longer in the schema that users still type, and what replaces each
REMOVED_KEYS = {
    "memory.lora_r": "set model.lora.r (a policy sets it there too: conf/memory/tight.yaml)",
    "memory.lora_target_modules": "set model.lora.target_modules (a policy sets it there too: conf/memory/tight.yaml)",
}


def _nearest(key: str) -> str:
    """': did you mean <the closest key of the same section>?', or nothing: names are compared within the section."""
    section, _, name = key.rpartition(".")
    prefix = f"{section}." if section else ""
    names = [k[len(prefix) :] for k in schema_keys() if k.startswith(prefix)]
    names = [n for n in names if "." not in n]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f": did you mean {prefix}{close[0]}?" if close else ""


def _unknown_option(err: Exception) -> str | None:
    text = str(err)
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if not missing:
        return None
    group, option = missing.groups()
    options = re.findall(r"^\t(\S+)$", text.split(f"Available options in '{group}':", 1)[-1], re.M)
    if not options and group == "preset":
        return (
            f"preset={option}: sweeps/preset/ holds no presets yet: run the command a budget sweep printed last, or "
            "sweep with hydra.sweeper.export_to=sweeps/preset"
        )
    near = difflib.get_close_matches(option, options, n=1, cutoff=0.5)
    hint = f"did you mean {group}={near[0]}? " if near else ""
    return f"{group}={option} is not an option of {group}: {hint}(options: {', '.join(options)})"


def _bad_value(cause: Any) -> str | None:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    key = getattr(cause, "full_key", None)
    if not key:
        return None
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        if key in REMOVED_KEYS:
            return f"{key} was removed: {REMOVED_KEYS[key]}"
        return f"{key} is not a config key{_nearest(key)} (python train.py --cfg job lists them)"
    if isinstance(cause, ValidationError):
        # "could not be converted to Integer", or a bool's "is not a valid bool"
        wanted = re.search(r"converted to (\w+)", str(cause)) or re.search(r"is not a valid (\w+)", str(cause))
        expected = EXPECTED.get(wanted.group(1), wanted.group(1)) if wanted else "another type"
        return f"{key}={_value_text(cause)} is not {expected}: set {key} to {expected}"
    return None


def _value_text(cause: Any) -> str:
    found = re.search(r"Value '([^']*)'", str(cause))
    return found.group(1) if found else "<that value>"


def one_line(err: BaseException) -> str | None:
    """memfit's one-line form of a command-line config error, or None for any other error."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(err, MissingConfigException):
        return _unknown_option(err)
    if isinstance(err, OverrideParseException):
        first = str(err).splitlines()[0]
        return f"an override does not parse ({first}): quote it, e.g. 'key=[1,2]' (Hydra's override grammar)"
    if isinstance(err, MissingMandatoryValue):
        key = getattr(err, "full_key", None) or "a value"
        return f"{key} is missing (???): set {key}=<value>"
    if isinstance(err, ConfigCompositionException) and err.__cause__ is not None:
        return _bad_value(err.__cause__)
    return None


def run_with_one_line_errors(app: Callable[[], Any]) -> Any:
    """Run the Hydra app; a config error from the command line is one line and exit 2. Another error keeps its full
    trace and exit 1. With HYDRA_FULL_ERROR=1 set by the user, Hydra reports everything as it does by default."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return app()
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises instead of printing; trial processes do not inherit it
    try:
        return app()
    except Exception as err:  # noqa: BLE001 - reported here, as Hydra would, in one line where it is a config error
        line = one_line(err)
        if line is None:
            traceback.print_exc()
            sys.exit(1)
        print(f"memfit: error: {line}", file=sys.stderr)
        sys.exit(2)
