"""Configuration: the schema behind the YAML groups, the facts derived from it, and one-pass validation."""

from memfit.config.schema import (
    AUTO,
    GIB,
    auto_lengths,
    effective_lengths,
    limit_bytes,
    limit_gib,
    register_configs,
    resolve_lengths,
    step_accumulates,
)
from memfit.config.validate import ConfigError, validate

__all__ = [
    "AUTO",
    "GIB",
    "auto_lengths",
    "ConfigError",
    "effective_lengths",
    "limit_bytes",
    "limit_gib",
    "register_configs",
    "resolve_lengths",
    "step_accumulates",
    "validate",
]
