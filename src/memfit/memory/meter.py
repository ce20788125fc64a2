"""Memory meter: one interface, two backends (the CUDA allocator, or the process's host memory on CPU).

Everything that reports memory reads it here, so CPU tests run the same code paths as GPU runs.
A *window* is the span since the last `reset_window()`; the meter also keeps the overall peak of the windows read
since `reset_overall()`. `mark()` cuts a
window into parts (one micro-batch each) and returns the part's peak, without losing the window's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from memfit.config import GIB


@dataclass(frozen=True)
class MemoryPeak:
    allocated: int  # bytes
    reserved: int  # bytes

    @property
    def allocated_gib(self) -> float:
        return self.allocated / GIB

    @property
    def reserved_gib(self) -> float:
        return self.reserved / GIB

    def max(self, other: MemoryPeak) -> MemoryPeak:
        return MemoryPeak(max(self.allocated, other.allocated), max(self.reserved, other.reserved))


class _Windows:
    """Windows and their marked parts, over a backend's peak since its last reset (`_since_mark`, `_reset_peak`).
    A part spans a window's reset: its peak is its own, whichever window's each byte counted in."""

    overall: MemoryPeak
    _marked = MemoryPeak(0, 0)  # the window's peak before the last mark
    _carried = MemoryPeak(0, 0)  # the part's peak before the window's reset

    def _since_mark(self) -> MemoryPeak:
        raise NotImplementedError

    def _reset_peak(self) -> None:
        raise NotImplementedError

    def reset_overall(self) -> None:
        """Start the overall peak afresh: training's own, without the preflight's probes before it (some of which
        ran past the limit, as the largest-batch search and a plan's earlier rounds do)."""
        self.overall = MemoryPeak(0, 0)

    def reset_window(self) -> None:
        self._carried = self._carried.max(self._since_mark())
        self._marked = MemoryPeak(0, 0)
        self._reset_peak()

    def mark(self) -> MemoryPeak:
        """The peak since the last mark; the window's peak still counts it."""
        since = self._since_mark()
        part, self._carried = self._carried.max(since), MemoryPeak(0, 0)
        self._marked = self._marked.max(since)
        self._reset_peak()
        return part

    def window_peak(self) -> MemoryPeak:
        peak = self._marked.max(self._since_mark())
        self.overall = self.overall.max(peak)
        return peak


# What a long run's allocator cache holds beyond what a fresh probe of the same batch leaves reserved: a few small
# blocks and pages more, added step by step as the shapes vary. Training's peak reserved came at most 36 MiB past
# the preflight's measured worst batch over 15 epochs (pegasus_large and qwen2_5_1_5b LoRA, budgets 16-40 GiB, fixed
# and budget-shaped batches, expandable segments; benchmarks/results/budget_batching_*_rounds2_session40_h100.json), so
# the preflight judges each measured peak with this much more.
LONG_RUN_CACHE_GROWTH = 64 * 1024**2


class CudaMeter(_Windows):
    """Peak allocated (tensors) and reserved (the caching allocator's segments) on one CUDA device."""

    backend = "cuda"
    label = "CUDA allocator"
    cache_growth = LONG_RUN_CACHE_GROWTH  # what a judged peak adds for a long run's cache (above)

    def __init__(self, device_index: int = 0):
        import torch

        self.torch = torch
        self.device = device_index
        self.overall = MemoryPeak(0, 0)

    def _since_mark(self) -> MemoryPeak:
        cuda = self.torch.cuda  # the caching allocator's own counters, on the host: no device synchronisation
        return MemoryPeak(cuda.max_memory_allocated(self.device), cuda.max_memory_reserved(self.device))

    def _reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def current_bytes(self) -> int:
        return self.torch.cuda.memory_allocated(self.device)

    def alloc_retries(self) -> int:
        """How often the caching allocator had to free its cache (a device sync) and retry to stay under the cap:
        a step near the budget runs, but slower; counted since the process started."""
        return int(self.torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def total_bytes(self) -> int:
        return self.torch.cuda.get_device_properties(self.device).total_memory

    def reachable_bytes(self) -> int:
        """The most this process's allocator can hold now: what it reserved already (an earlier job of a multirun
        may have left its cache) and what the device has free beside every other process."""
        return self.torch.cuda.mem_get_info(self.device)[0] + self.torch.cuda.memory_reserved(self.device)


def _return_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc's malloc_trim). A Hydra multirun runs
    its jobs in one process: without this, what an earlier job freed stays resident, and a later job's peak RSS
    counts it (memory=off,balanced on CPU: balanced measured above off second, below it first or alone)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim with
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: no search for libc


class HostMeter(_Windows):
    """The process's peak resident set (VmHWM), reset per window through /proc/self/clear_refs.

    On the host there is no allocated/reserved split: both numbers are the peak RSS of the whole process
    (Python, libraries and tensors), which is what a host-memory budget has to hold.
    """

    backend = "host"
    label = "host RSS (CPU)"
    cache_growth = 0  # the host has no allocator cache of the CUDA kind; its peak RSS is judged as measured
    _status = Path("/proc/self/status")
    _clear_refs = Path("/proc/self/clear_refs")

    def __init__(self) -> None:
        self.overall = MemoryPeak(0, 0)
        self._resettable = True
        _return_freed_memory()  # an earlier run of this process (a Hydra multirun) must not count in this one's RSS
        self.reset_window()

    def _read_kib(self, key: str) -> int:
        for line in self._status.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        return 0

    def _reset_peak(self) -> None:
        if not self._resettable:
            return
        try:
            self._clear_refs.write_text("5")  # "5" resets the peak RSS (VmHWM) to the current RSS
        except OSError:
            self._resettable = False  # then windows report the peak since start, which is still an upper bound

    def _since_mark(self) -> MemoryPeak:
        if self._status.exists():
            peak_bytes = self._read_kib("VmHWM") * 1024
        else:  # not Linux: resource's ru_maxrss is the peak since start
            import resource

            peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return MemoryPeak(peak_bytes, peak_bytes)

    def current_bytes(self) -> int:
        return self._read_kib("VmRSS") * 1024 if self._status.exists() else 0

    def alloc_retries(self) -> int:
        return 0  # the host has no caching allocator to retry

    def total_bytes(self) -> int:
        import psutil

        return psutil.virtual_memory().total

    def reachable_bytes(self) -> int:
        """The most this process can hold now: its resident set and what the host can still give without swapping
        (psutil's available)."""
        import psutil

        return psutil.virtual_memory().available + self.current_bytes()


def make_meter(device: str) -> CudaMeter | HostMeter:
    """The meter for the device a run trains on ('cuda' or 'cpu')."""
    return CudaMeter() if device == "cuda" else HostMeter()
