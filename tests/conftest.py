"""Shared fixtures: compose memfit configs with Hydra's compose API, small data files, fast tiny settings."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from memfit.config import register_configs

# Before huggingface_hub is imported anywhere: it reads offline mode once, at import. Nothing here downloads.
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Small, fast settings for real Trainer steps on CPU.
FAST = [
    "trainer.max_steps=3",
    "trainer.batch_size=2",
    "trainer.gradient_accumulation_steps=1",
    "trainer.device=cpu",
    "memory.max_source_length=64",
    "memory.max_label_length=32",
    "memory.precision=fp32",
    "data.max_train_samples=24",
    "data.max_eval_samples=4",
]


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch):
    monkeypatch.setenv("CI", "1")  # no tqdm bars in test logs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def compose_cfg(tmp_path):
    """compose_cfg(*overrides) → the composed train config, outputs under tmp_path."""
    register_configs()

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=[f"output_dir={tmp_path / 'outputs'}", *overrides])

    yield _compose
    GlobalHydra.instance().clear()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def long_tail_jsonl(tmp_path) -> Path:
    """40 short pairs and 2 with very long labels: the rare sample that breaks a typical-batch probe."""
    rows = [{"source": f"paper {i} " + "word " * (20 + i % 7), "target": "short summary " * 3} for i in range(40)]
    rows[7]["target"] = "long label " * 150
    rows[23]["target"] = "very long label " * 100
    return write_jsonl(tmp_path / "long_tail.jsonl", rows)


def train_py_env() -> dict[str, str]:
    env = dict(os.environ, CI="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def readme_command(prefix: str) -> list[str]:
    """The README's shell command starting with `prefix`, continuation lines joined, split as a shell would."""
    import shlex

    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip().startswith(prefix):
            return shlex.split(line.strip())
    raise AssertionError(f"README has no command starting with {prefix!r}")


def run_train_py(*args: str, cwd: Path = ROOT, timeout: int = 600, quiet: bool = True) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a fresh process, as a user runs it (quiet: as under CI, no progress bars)."""
    env = train_py_env()
    if not quiet:
        env.pop("CI", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(command: list[str], port: int, cwd: Path, timeout_s: float = 90) -> Iterator[str]:
    """Run an MLflow server command until the block ends; yields its base URL once /health answers."""
    server = subprocess.Popen(
        command, cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    assert response.read().decode().strip() == "OK"
                    break
            except OSError:
                assert server.poll() is None, f"{command[:2]} exited with {server.returncode}"
                assert time.time() < deadline, f"{command[:2]} did not answer /health within {timeout_s:.0f} s"
                time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # mlflow leaves worker processes behind otherwise
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def readme_budget_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's CPU budget sweep, run once per session: its output dir (MLflow store, Optuna study, presets)
    and the completed process. Tests read it; none writes into it."""
    out = tmp_path_factory.mktemp("readme_sweep")
    sweep = readme_command("python train.py -m sweep=budget")[2:]
    done = run_train_py(*sweep, f"output_dir={out}", f"hydra.sweeper.preset_dir={out}/presets/preset")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done
