"""The README's `python train.py` examples, each in a new interpreter as a user runs it (the test suite runs the
same commands forked from its fork server, to save each one's imports, and checks their behaviour in detail):

- the first budget search on CPU, then training from the preset it exported;
- the tiny causal LM (no warning at import: peft's read of a deprecated transformers alias is silenced);
- `preflight_only` and `estimate_only` ("how large a batch can I afford?");
- `python train.py -m memory=off,balanced,tight ...` (the default job three times), then `mlflow ui` serving its runs;
- `python train.py model=qwen2_5_0_5b ...` (LoRA on a 0.5B model with random weights) on a prompt/response JSONL.

Run from the repository root after the test extras are installed: python .ci/readme_examples.py
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memfit.tracking import default_tracking_uri  # noqa: E402
from tests.conftest import (  # noqa: E402
    finished_runs,
    free_port,
    readme_command,
    readme_mlflow_ui,
    run_train_py,
    served_runs,
    serving,
)


def run(prefix: str, out: Path, *extra: str, cwd: Path = ROOT) -> str:
    """The README command starting with `prefix` in a new interpreter, its outputs in `out`; what it printed."""
    done = run_train_py(*readme_command(prefix)[2:], *extra, f"output_dir={out}", cwd=cwd, fresh=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "anterior to 4.12.0" not in done.stderr  # EncoderDecoderModel's warning about old checkpoints: not ours
    assert "FutureWarning" not in done.stderr, done.stderr[-3000:]
    return done.stdout + done.stderr


def train(prefix: str, out: Path, cwd: Path = ROOT) -> list:
    """The README command starting with `prefix`, its outputs in `out`; its finished MLflow runs."""
    run(prefix, out, cwd=cwd)
    return finished_runs(out)


def budget_search_then_train_from_its_preset(work: Path) -> None:
    work.mkdir(parents=True)
    said = run("python train.py -m sweep=budget", work, cwd=work)  # launched there: its sweeps/preset/ is work's
    assert "best feasible trial" in said and "train from it with: python train.py model=tiny_seq2seq" in said, said
    used = work / "use"
    run("python train.py model=tiny_seq2seq data=aclsum +preset=", used, cwd=work)
    (trained,) = finished_runs(used)
    print(f"README budget search, then its preset: batch {trained.data.params['trainer.batch_size']} trained")


def the_small_examples(work: Path) -> None:
    (causal,) = train("python train.py model=tiny_causal", work / "causal")
    assert causal.data.params["memory.loss"] == "chunked"
    said = run("python train.py model=tiny_seq2seq preflight_only=true", work / "preflight")
    assert "largest batch that fits the worst case" in said, said[-3000:]
    said = run("python train.py model=tiny_seq2seq estimate_only=true", work / "estimate")
    assert "estimate (memory model" in said and "fitted from 6 probes" in said, said[-3000:]
    assert re.search(r"largest batch predicted to fit at source \d+ × labels \d+: (>= )?\d+", said), said[-3000:]
    assert len(list((work / "estimate").glob("calibration/*.json"))) == 1  # fitted from nothing, kept for the next
    assert finished_runs(work / "estimate")[0].data.tags["memfit.mode"] == "estimate_only"
    print("README tiny causal, preflight_only and estimate_only examples: run")


def compare_policies_then_open_the_ui(work: Path) -> None:
    runs = train("python train.py -m memory=off,balanced,tight", work)
    assert sorted(r.data.tags["memfit.memory"] for r in runs) == ["balanced", "off", "tight"]
    assert all(r.data.metrics["summary/peak_allocated_gib"] > 0 for r in runs)
    assert {r.data.params["memory.gradient_checkpointing"] for r in runs} == {"True", "False"}
    port = free_port()
    with serving(readme_mlflow_ui(default_tracking_uri(str(work)), port), port, cwd=work) as url:
        served = served_runs(url, runs[0].info.experiment_id)
    assert len(served) == 3 and {"summary/peak_allocated_gib", "train/loss"} <= {
        m["key"] for m in served[0]["data"]["metrics"]
    }
    policies = ", ".join(sorted(r.data.tags["memfit.memory"] for r in runs))
    print(f"README policy comparison: 3 runs ({policies}), served by mlflow ui")


def qwen_lora_on_own_jsonl(work: Path) -> None:
    rows = [{"prompt": f"Question {i}: what is " + "word " * 20, "response": "An answer " * 10} for i in range(30)]
    (work / "my.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run,) = train("python train.py model=qwen2_5_0_5b", work, cwd=work)
    assert run.data.params["memfit.random_weights"] == "True"
    trainable, total = int(run.data.params["memfit.trainable_params"]), int(run.data.params["memfit.total_params"])
    assert trainable < total / 50, (trainable, total)
    print(f"README Qwen2.5-0.5B LoRA example: {trainable:,} of {total:,} weights trained")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        budget_search_then_train_from_its_preset(Path(work) / "sweep")
        the_small_examples(Path(work) / "small")
        compare_policies_then_open_the_ui(Path(work) / "policies")
        (Path(work) / "qwen").mkdir()
        qwen_lora_on_own_jsonl(Path(work) / "qwen")
