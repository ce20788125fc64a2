"""Allocation traces of memfit's probes, to replay the CUDA caching allocator offline (issue 26's reserved memory).

    python benchmarks/allocator_trace_gpu.py --tokenizer .gpu/tok --model pegasus_large --checkpointing on \
        --set memory.loss=standard --held-apart run18 --sites 8 --out $OUT/sites_pegasus_large_ckpt_standard.npz

For one model (memory=balanced, checkpointing on or off, the loss of `--set`), the calibration's own probe shapes
and a run's held-apart shapes (memory_model_gpu.py's HELD_APART), each probed as the preflight probes it (two
optimizer steps on a batch of exactly that shape: memfit.memory.probe.probe) while
`torch.cuda.memory._record_memory_history` records every allocator event. Per shape, --out (one compressed .npz)
holds the allocator's state when recording began (`<key>.state`: its segments and their blocks, as JSON: the
weights and whatever else lives then), the events in order (`<key>.action`, indices into ACTIONS; `<key>.addr`,
`<key>.size`, `<key>.stream`; with `--sites N`, `<key>.site`: each allocation's call site, its innermost N Python
frames, as an index into `meta`'s "sites") and the probe's measured peaks (`shapes`: JSON, each shape with its key,
kind, peaks and event count). `--calibrate` calibrates first, as a run without a cached calibration does.

Why: what checkpointed seq2seq reserves beyond allocated varies by up to 1 GB between like shapes (run 18), which no
fitted line reaches (`benchmarks/reserved_candidates_cpu.py`). `allocator_replay_cpu.py` replays these traces
(exactly, session 41) and predicts held-apart shapes from the calibration shapes' traces.

`--device cpu --model tiny_seq2seq --held-apart standard` runs the same plumbing without traces (the host has no
caching allocator), as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memfit.memory.allocator_history import ACTIONS, segments, site_name  # the indices the traces store

ROOT = Path(__file__).resolve().parents[1]


def _shapes(cfg, arch, held_apart: str, model: str) -> list[tuple[str, object]]:
    """(kind, shape): the calibration's first-choice probe shapes, then the held-apart ones."""
    from memory_model_gpu import HELD_APART, SHAPES

    from memfit.data.audit import BatchShape
    from memfit.memory.probe_shapes import calibration_shapes, probe_plan

    tokens, scale = probe_plan(cfg, arch)[0]
    checkpointed = bool(cfg.memory.gradient_checkpointing)
    multiple, positions = cfg.memory.pad_to_multiple_of, cfg.model.max_positions
    probes = calibration_shapes(arch, tokens, multiple, scale, positions, checkpointed)
    table = SHAPES if held_apart == "standard" else HELD_APART[held_apart]
    held = [BatchShape(*shape) for shape in table[model]]
    return [("probe", shape) for shape in probes] + [("held_apart", shape) for shape in held]


def _events(snapshot: dict, signatures: dict[str, int], depth: int) -> dict:
    import numpy as np

    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    index = {name: i for i, name in enumerate(ACTIONS)}
    events = {
        "action": np.array([index.get(e["action"], -1) for e in trace], dtype=np.int8),
        "addr": np.array([e.get("addr", 0) for e in trace], dtype=np.int64),  # none on an OOM
        "size": np.array([e.get("size", 0) for e in trace], dtype=np.int64),
        "stream": np.array([e.get("stream", 0) for e in trace], dtype=np.int64),
    }
    if depth:  # each allocation's call site, as an index into `signatures` (-1 for other events)
        sites = [
            signatures.setdefault(site_name(e.get("frames", []), depth), len(signatures))
            if e["action"] == "alloc"
            else -1
            for e in trace
        ]
        events["site"] = np.array(sites, dtype=np.int32)
    return events


def trace(
    setup, shape, cuda: bool, max_entries: int, signatures: dict[str, int], depth: int
) -> tuple[object, dict | None, str]:
    """The probe of `shape` under the allocator's history recording: (probe result, events, starting state); with
    `depth`, each allocation's call site too (its innermost `depth` Python frames, at a cost in probe time)."""
    from memfit.memory.probe import probe

    if not cuda:
        return probe(setup, shape)[0], None, "[]"
    import torch

    torch.cuda.empty_cache()  # the trace starts from what lives (weights), not from the last shape's cache
    context = "alloc" if depth else None
    torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks="python", max_entries=max_entries)
    try:
        start = json.dumps(segments(torch.cuda.memory._snapshot(), torch.cuda.current_device()))
        result = probe(setup, shape)[0]
        events = _events(torch.cuda.memory._snapshot(), signatures, depth)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return result, events, start


def _peaks(result) -> dict:
    if result.oom:
        return {"oom": True}
    return {
        "oom": False,
        "allocated": result.backward_peak.allocated,
        "reserved": result.backward_peak.reserved,
        "step_allocated": result.step_peak.allocated,
        "step_reserved": result.step_peak.reserved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pegasus_large")
    parser.add_argument("--checkpointing", choices=["on", "off"], default="on")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides (memory.loss=standard)")
    parser.add_argument(
        "--held-apart", default="run18", help="memory_model_gpu.py's HELD_APART key, or standard (its SHAPES)"
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-entries", type=int, default=2_000_000, help="trace entries kept per shape")
    parser.add_argument("--sites", type=int, default=0, help="record each allocation's innermost N Python frames")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate first and probe as memory_model_gpu.py does after it (the branch marker's hooks where the "
        "model splits its windows): the allocator's history of a run that calibrates, not a fresh process's",
    )
    parser.add_argument("--work", default="/tmp/memfit-allocator-trace")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    from memory_model_gpu import calibrated, compose, group_overrides, probe_context

    from memfit.memory.model import describe_architecture
    from memfit.memory.policy import apply_allocator_env

    overrides = group_overrides(args.model, args.checkpointing == "on", args)
    cfg = compose(overrides)
    apply_allocator_env(cfg.memory)  # expandable segments, as the runs whose reserved memory this is about
    built, setup = probe_context(cfg, args.device)
    arch = describe_architecture(built.model, cfg.model.task)
    if args.calibrate:
        setup = calibrated(cfg, setup, built.model, arch)[2]
    arrays: dict[str, object] = {}
    shapes = []
    signatures: dict[str, int] = {}
    for number, (kind, shape) in enumerate(_shapes(cfg, arch, args.held_apart, args.model)):
        started = time.perf_counter()
        result, events, start = trace(setup, shape, args.device == "cuda", args.max_entries, signatures, args.sites)
        key = f"s{number}"
        arrays[f"{key}.state"] = np.array(start)
        for name, values in (events or {}).items():
            arrays[f"{key}.{name}"] = values
        counts = {a: int((events["action"] == i).sum()) for i, a in enumerate(ACTIONS)} if events else {}
        counts["other"] = int((events["action"] == -1).sum()) if events else 0
        row = {"key": key, "kind": kind, "shape": [shape.batch, shape.source, shape.label], "events": counts}
        shapes.append({**row, **_peaks(result), "seconds": time.perf_counter() - started})
        print(json.dumps(shapes[-1]), flush=True)
        meta = {
            "command": " ".join(sys.argv),
            "model": args.model,
            "overrides": overrides,
            "actions": ACTIONS,
            "sites": list(signatures),
        }
        np.savez_compressed(args.out, shapes=np.array(json.dumps(shapes)), meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
