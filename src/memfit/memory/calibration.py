"""Calibration of the memory model's per-token part: six cheap probes on the device (four for T5's windows), at
least one per fitted term, fitted by least squares, cached per (model architecture, memory policy, device, library
versions) so a sweep pays it once.
Where a step peaks in one of six windows (memory.model.splits_branches: seq2seq under gradient checkpointing), each
probe measures the stacks' and the head's forward and backward apart, and each window is fitted alone.

A probe is the preflight's own measurement (forward, backward and optimizer steps on a batch of exactly that
shape), so a calibrated model predicts what the preflight would measure: peak allocated and peak reserved. The fit
is over the forward + backward peaks; the optimizer step's peak, which no batch shape changes, is kept apart as a
floor (the larger of the two is the step's peak); reserved is allocated times the allocator overhead the probes saw,
plus what the allocator keeps cached per byte of logits: on 69 held-apart shapes of five architectures within 3.6%
of measured reserved, median 0.7% (`predicted_reserved_fitted_ratio` in benchmarks/results/memory_model_run20_*).
Every decision memfit sizes from it (a batch plan, the preflight's ways out, a sweep's tells) measures what it
settles on, or keeps a margin.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.config.schema import memory_knobs, step_accumulates
from memfit.data.audit import BatchShape
from memfit.memory.calibration_probes import measure_probes
from memfit.memory.model import (
    COUNTED_TERMS,
    WINDOW_TERMS,
    Architecture,
    FittedPeak,
    LinearFit,
    PeakEstimate,
    convex_in_tokens,
    estimate_peak,
    fit_convex_in_tokens,
    fit_terms,
    largest_batch,
    logits_bytes,
    splits_branches,
    window_terms,
)
from memfit.memory.probe_shapes import calibration_shapes, probe_plan
from memfit.memory.state import ModelStateBytes

log = logging.getLogger(__name__)

FORMAT = 14  # bump when what a calibration file holds or how it is fitted changes: old files are then not reused
# 7: probe batches carry a padding mask; 8: fused AdamW on CUDA; 9: the forward as accelerate wraps it for training;
# 10: six probes, to the most tokens, T5's cross-attention scores; 11: two lines in tokens, checkpointed causal LMs;
# 12: their probes at six token counts, and every checkpointed seq2seq model fitted window by window;
# 13: reserved by replaying the allocator's recorded events (checkpointed models on CUDA); 14: no replay
# the memory knobs that change what a step holds for a given shape (their Knob.step; lengths and padding do not)
POLICY_KNOBS = tuple(name for name, knob in memory_knobs().items() if knob.step)


def wanted(calibration: DictConfig, device: str, batching: str = "fixed") -> bool:
    """calibration.enabled: auto calibrates on CUDA only (host RSS is too coarse to fit), and on CPU too where
    budget-shaped batches need the memory model to size their plan; true always."""
    setting = str(calibration.enabled).lower()
    return setting == "true" or (setting == "auto" and (device == "cuda" or batching == "budget"))


@dataclass
class Calibration:
    """A fitted memory model for one (architecture, policy, device, versions): predicts a probe's peaks."""

    key: str
    identity: dict[str, Any]  # what the key hashes, for people reading the file
    architecture: Architecture
    state: ModelStateBytes
    fit: FittedPeak
    probes: list[dict[str, Any]] = field(default_factory=list)  # shape and measured peaks of each probe
    seconds: float = 0.0
    from_cache: bool = False

    def estimate(self, shape: BatchShape) -> PeakEstimate:
        """The predicted peaks of a training step on `shape` (~1 µs: searches ask hundreds of shapes)."""
        return estimate_peak(shape.batch, shape.source, shape.label, self.architecture, self.state, self.fit)

    def largest_batch(self, source: int, label: int, limit: int, upper: int = 4096) -> int:
        """The largest batch predicted to keep peak *reserved* (what the preflight judges) within `limit`."""
        return largest_batch(self.fit, source, label, self.architecture, limit, upper)

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("from_cache")
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        return cls(
            key=data["key"],
            identity=data["identity"],
            architecture=Architecture(**data["architecture"]),
            state=ModelStateBytes(**data["state"]),
            fit=FittedPeak(
                {window: LinearFit(fit["coefficients"]) for window, fit in data["fit"]["windows"].items()},
                data["fit"]["step_allocated"],
                data["fit"]["reserved_ratio"],
                data["fit"]["reserved_per_logits_byte"],
            ),
            probes=data["probes"],
            seconds=data["seconds"],
        )

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """What `save` wrote. Raises OSError or ValueError where the file is missing or damaged."""
        return cls.from_json(path.read_text())


def library_versions(cfg: DictConfig) -> dict[str, str]:
    """Versions whose kernels and allocator decide activation memory."""
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "transformers"]
    if cfg.model.lora.enabled:
        names.append("peft")
    if cfg.memory.load_in_4bit:
        names.append("bitsandbytes")
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def identity(cfg: DictConfig, device_name: str, tokens: int) -> dict[str, Any]:
    """Everything a calibration depends on: the model, the memory policy, how the step runs, the device and the
    library versions. Batch size, lengths and the budget are not in it: they are what the model predicts over."""
    model = cfg.model
    return {
        "format": FORMAT,
        "model": {
            "source": model.source,
            "name_or_path": model.name_or_path,
            "architecture": OmegaConf.to_container(model.architecture, resolve=True),
            "lora": OmegaConf.to_container(model.lora, resolve=True) if model.lora.enabled else None,
        },
        "policy": {knob: OmegaConf.to_container(cfg.memory, resolve=True)[knob] for knob in POLICY_KNOBS},
        # with accumulation a forward runs while the previous micro-batch's gradients are held
        "accumulates": step_accumulates(cfg),
        "steps": cfg.preflight.steps,
        "probe_tokens": tokens,
        "device": device_name,
        "versions": library_versions(cfg),
    }


def calibration_key(ident: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def load_cached(cache_dir: Path, key: str) -> Calibration | None:
    path = cache_dir / f"{key}.json"
    if not path.exists():
        return None
    try:
        calibration = Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError) as err:  # a damaged file is refitted, not trusted
        log.warning("calibration %s unreadable (%s): fitting it again", path, err)
        return None
    calibration.from_cache = True
    return calibration


def cached(cfg: DictConfig, device: str) -> Calibration | None:
    """This run's calibration if an earlier run (or trial) fitted it."""
    ident = identity(cfg, device_name(device), int(cfg.calibration.probe_tokens))
    return load_cached(Path(cfg.calibration.cache_dir), calibration_key(ident))


def _measured_by_window(measured: list[dict[str, Any]]) -> bool:
    return all(f"{window}_allocated" in m for m in measured for window in WINDOW_TERMS)


def _fit_windows(arch: Architecture, measured: list[dict[str, Any]], checkpointed: bool) -> dict[str, LinearFit]:
    """One fit per window of the step (memory.model.WINDOW_TERMS where it splits and the probes measured each),
    T5's position biases counted; else one fit over the whole step (a seq2seq model whose probes saw no gradient
    reach the encoder, or recorded before windows); two lines in tokens where the step's peak is convex in them
    (memory.model.convex_in_tokens)."""

    def rows(window: str) -> list[dict[str, float]]:
        return [window_terms(window)(m["batch"], m["source"], m["label"], arch) for m in measured]

    if splits_branches(arch, checkpointed) and _measured_by_window(measured):
        return {w: fit_terms(rows(w), [m[f"{w}_allocated"] for m in measured], COUNTED_TERMS) for w in WINDOW_TERMS}
    peaks = [m["allocated"] for m in measured]
    if convex_in_tokens(arch, checkpointed):
        return fit_convex_in_tokens(rows("backward"), peaks)
    return {"backward": fit_terms(rows("backward"), peaks, COUNTED_TERMS)}


def _fit_reserved(arch: Architecture, measured: list[dict[str, Any]]) -> tuple[float, float]:
    """Reserved as allocated × overhead + cached bytes per byte of logits, by least squares over the probes; where
    the logits term comes out negative (no sign of it) or cannot be told from allocated, the probes' mean
    reserved/allocated alone. (T5 with checkpointing: the mean ratio alone missed reserved by up to 18%, with the
    logits term 11%.)"""
    rows = [
        {"allocated": float(m["allocated"]), "logits": float(logits_bytes(m["batch"], m["source"], m["label"], arch))}
        for m in measured
    ]
    try:
        fitted = fit_terms(rows, [m["reserved"] for m in measured]).coefficients
    except ValueError:
        fitted = {"allocated": 0.0, "logits": -1.0}
    if fitted["logits"] < 0 or fitted["allocated"] <= 0:
        return sum(m["reserved"] / m["allocated"] for m in measured) / len(measured), 0.0
    return fitted["allocated"], fitted["logits"]


def fit_peak(arch: Architecture, measured: list[dict[str, Any]], checkpointed: bool = False) -> FittedPeak:
    """The memory model fitted from measured probes (a Calibration's `probes`: each shape with its peaks, and each
    window's where the step splits) of a step with or without gradient checkpointing: a fit per window, the
    optimizer step's peak (the same for every shape: the largest seen) and the allocator's reserved overhead.
    Raises ValueError where the probes cannot fit the terms."""
    windows = _fit_windows(arch, measured, checkpointed)
    return FittedPeak(windows, max(m["step_allocated"] for m in measured), *_fit_reserved(arch, measured))


def calibrate(
    cfg: DictConfig,
    setup: Any,
    arch: Architecture,
    state: ModelStateBytes,
    on_probe: Callable[[BatchShape], None] | None = None,
) -> Calibration | None:
    """The cached calibration for this run's (model, policy, device, versions), or a new one from its probes
    through the preflight's `probe` (weights and RNG restored after each); smaller shapes are tried when one does
    not fit the budget. None when no plan fits, or while another process calibrates the same key (its lock file
    beside the cache): a run does not wait for it."""
    tokens = int(cfg.calibration.probe_tokens)
    ident = identity(cfg, device_name(setup.device), tokens)
    key = calibration_key(ident)
    cache_dir = Path(cfg.calibration.cache_dir)
    if (found := load_cached(cache_dir, key)) is not None:
        return found
    checkpointed = cfg.memory.gradient_checkpointing
    if arch.quadratic_attention and checkpointed and not splits_branches(arch, checkpointed):
        log.warning(
            "memory model: not calibrated: with gradient checkpointing, eager attention peaks in the largest layer's "
            "recomputation, which memfit models for T5 only; the preflight still measures "
            "the worst batch"
        )
        return None
    from filelock import FileLock, Timeout

    cache_dir.mkdir(parents=True, exist_ok=True)
    # the OS releases the lock when its holder dies (flock), so a crashed calibration never blocks the next one
    lock = FileLock(cache_dir / f"{key}.lock", timeout=0)
    try:
        lock.acquire()
    except Timeout:  # two trials of a multi-GPU sweep, started together: one calibrates, the other goes on
        log.info(
            "memory model: another process is calibrating %s now: this run goes without a prediction (the "
            "preflight still measures the worst batch)",
            key,
        )
        return None
    try:
        if (found := load_cached(cache_dir, key)) is not None:  # fitted by the lock's last holder since the check
            return found
        return _fit_and_cache(cfg, setup, arch, state, on_probe, key, ident)
    finally:
        lock.release()


def _fit_and_cache(
    cfg: DictConfig,
    setup: Any,
    arch: Architecture,
    state: ModelStateBytes,
    on_probe: Callable[[BatchShape], None] | None,
    key: str,
    ident: dict[str, Any],
) -> Calibration | None:
    cache_dir = Path(cfg.calibration.cache_dir)
    checkpointed = cfg.memory.gradient_checkpointing
    branches = splits_branches(arch, checkpointed)
    if branches:
        setup = replace(setup, split_branches=True)
    start = time.perf_counter()
    for tokens, scale in probe_plan(cfg, arch):
        multiple, positions = cfg.memory.pad_to_multiple_of, cfg.model.max_positions
        shapes = calibration_shapes(arch, tokens, multiple, scale, positions, checkpointed)
        measured = measure_probes(setup, shapes, on_probe)
        if len(measured) == len(shapes):
            break
        log.warning("memory model: a calibration probe did not fit the budget; probing smaller shapes")
    if branches and arch.relative_position_bias and not _measured_by_window(measured):  # one fit misses T5 by 35%
        log.warning(
            "memory model: not calibrated: no gradient reached the encoder's output (a frozen encoder?), so the "
            "probes could not measure the decoder's and the encoder's backward apart; the preflight still measures "
            "the worst batch"
        )
        return None
    try:
        fit = fit_peak(arch, measured, cfg.memory.gradient_checkpointing)
    except (ValueError, IndexError) as err:
        log.warning(
            "memory model: not calibrated (%s): set calibration.probe_tokens lower than %d so the probes fit",
            err or "no probe fitted",
            cfg.calibration.probe_tokens,
        )
        return None
    calibration = Calibration(key, ident, arch, state, fit, measured)
    calibration.seconds = time.perf_counter() - start
    cache_dir.mkdir(parents=True, exist_ok=True)
    calibration.save(cache_dir / f"{key}.json")
    log.info(
        "memory model: calibrated %s from %d probes in %.1f s",
        key,
        len(measured),
        calibration.seconds,
    )
    return calibration
