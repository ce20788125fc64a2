"""Before any weight loads: do the weights alone fit? Counted from a weightless build, they are a lower bound of
every peak (a full fine-tune's gradients, as large, with them), so where they exceed what the run may use no batch
size is a way out, and loading them would fail late (an OOM at load under the cap) or not at all (the kernel kills
a CPU run that outgrows the host). Such a run ends as a failed preflight, recorded, so that a sweep learns it as an
infeasible configuration."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import DictConfig

from memfit.config import GIB
from memfit.run.context import RunContext
from memfit.run.report import RunReport

log = logging.getLogger("memfit")

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "4-bit": 0.5}


@dataclass(frozen=True)
class StateBound:
    """The least the model state holds: its stored weights, and a full fine-tune's gradients."""

    parameters: int
    dtype: str  # as the weights are stored: fp32, bf16, or 4-bit (QLoRA)
    full: bool  # a full fine-tune: every weight has a gradient of its size

    @property
    def bytes(self) -> float:
        return self.parameters * DTYPE_BYTES[self.dtype] * (2 if self.full else 1)

    def describe(self) -> str:
        what = "weights and their gradients" if self.full else "frozen weights"
        size = f"{self.bytes / GIB:.1f} GiB ({self.parameters / 1e9:.2f}B parameters in {self.dtype})"
        return f"its {what} alone take {size}"


def state_bound(cfg: DictConfig) -> StateBound | None:
    """The model's StateBound from a meta-device build; None where it cannot be built weightless (bert2bert)."""
    from memfit.models import meta_model, stored_dtype

    try:
        model = meta_model(cfg.model)
    except Exception as err:  # noqa: BLE001 - a count, not a gate: the model's own build reports what is wrong
        log.debug("no weightless build of %s (%s): its weights are counted once loaded", cfg.model.name, err)
        return None
    if model is None:
        return None
    dtype = "4-bit" if cfg.memory.load_in_4bit else stored_dtype(cfg.model, cfg.memory)
    return StateBound(sum(p.numel() for p in model.parameters()), dtype, full=not cfg.model.lora.enabled)


def state_over_room(ctx: RunContext) -> RunReport | None:
    """A failed preflight's report where the StateBound exceeds the limit the preflight judges by
    (worst_case.budget_and_limit: the budget, else the GPU or the host's free memory, minus the margin); None where
    it fits or is unknown."""
    from memfit.run.worst_case import budget_and_limit

    bound = state_bound(ctx.cfg)
    if bound is None:
        return None
    _, limit = budget_and_limit(ctx)
    if bound.bytes <= limit:
        return None
    gib = ctx.cfg.budget.gib
    judged = f"budget.gib={gib:g}" if gib is not None else ctx.cap.judged_against
    where = f"the {limit / GIB:.2f} GiB limit ({judged} minus budget.margin_gib)"
    ways = _ways_out(ctx.cfg, bound)
    reason = f"preflight: model={ctx.cfg.model.name}: {bound.describe()}, more than {where}: {ways}"
    return RunReport(
        status="preflight_failed", reason=reason, worst_case_peak_gib=bound.bytes / GIB, limit_gib=limit / GIB
    )


def _ways_out(cfg: DictConfig, bound: StateBound) -> str:
    ways = []
    if cfg.model.task == "causal" and bound.full:
        ways.append("train LoRA adapters (model.lora.enabled=true), over 4-bit weights with memory=qlora")
    elif cfg.model.task == "causal" and bound.dtype != "4-bit":
        ways.append("store the frozen weights in 4 bits (memory=qlora)")
    if bound.dtype == "fp32":
        ways.append(f"store them in bf16 (memory.{'weights_dtype' if bound.full else 'frozen_dtype'}=bf16)")
    ways.append("raise budget.gib" if cfg.budget.gib is not None else "use a device with more memory")
    return "; ".join(ways)
