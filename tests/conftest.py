"""Shared fixtures: compose memfit configs with Hydra's compose API, small data files, fast tiny settings."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

# Under pytest-xdist's workers (pyproject's addopts), each worker's processes, trials included, get their share of the
# cores: torch otherwise starts one OpenMP thread per core in every process, and oversubscribed threads spin.
if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from memfit.config import register_configs  # noqa: E402

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


def draw_lora_up_weights(model, std: float = 0.02) -> None:
    """peft starts every lora_B at zero, so an adapter adds nothing until trained: draw its weights (from torch's
    seeded generator) so that a test's adapters change the loss and the gradients."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=std)


@pytest.fixture
def long_tail_jsonl(tmp_path) -> Path:
    """40 short pairs and 2 with very long labels: the rare sample that breaks a typical-batch probe."""
    rows = [{"source": f"paper {i} " + "word " * (20 + i % 7), "target": "short summary " * 3} for i in range(40)]
    rows[7]["target"] = "long label " * 150
    rows[23]["target"] = "very long label " * 100
    return write_jsonl(tmp_path / "long_tail.jsonl", rows)


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """tmpfs(options) → a tmpfs mounted under tmp_path with mount's options ("size=20m", "size=1m,ro"), unmounted
    after the test: a real full or read-only disk (root writes past file permissions, not past a read-only mount).
    Skips where this process cannot mount one (it needs root in a container)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"a tmpfs cannot be mounted here ({made.stderr.decode().strip()}): needs root in a container")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def save_checkpoint(compose_cfg, directory, model: str, vocab: int | None = None):
    """A tiny model's random weights and the bundled tokenizer, saved as save_pretrained writes a checkpoint. Read
    back beside a config.json, the tokenizer takes the architecture's class, which may add an end token: the
    embedding is sized for what the directory's tokenizer holds unless `vocab` says otherwise."""
    from transformers import AutoTokenizer

    from memfit.models import build_model, build_tokenizer

    cfg = compose_cfg(f"model={model}", "model.lora.enabled=false", "trainer.device=cpu")
    build_tokenizer(cfg.model).save_pretrained(directory)
    build_model(cfg, build_tokenizer(cfg.model), "cpu").model.save_pretrained(directory)
    size = vocab or -(-len(AutoTokenizer.from_pretrained(directory)) // 8) * 8
    cfg = compose_cfg(f"model={model}", "model.lora.enabled=false", f"model.architecture.vocab_size={size}")
    build_model(cfg, build_tokenizer(cfg.model), "cpu").model.save_pretrained(directory)
    return directory


def train_py_env() -> dict[str, str]:
    env = dict(os.environ, CI="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def sweep_outputs(tmp_path: Path) -> list[str]:
    """A sweep's stores, trial directories and presets, all under tmp_path."""
    return [
        f"output_dir={tmp_path}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        f"hydra.sweeper.preset_dir={tmp_path}/preset",
    ]


def readme_command(prefix: str) -> list[str]:
    """The first shell command starting with `prefix` in the README, else in a docs/ page (every command a user
    reads is run by a test), continuation lines joined, split as a shell would."""
    import shlex

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if line.strip().startswith(prefix):
                return shlex.split(line.strip())
    raise AssertionError(f"neither the README nor docs/ has a command starting with {prefix!r}")


# timeout: README runs have taken up to 298 s on an AVX-512 host and over 600 s on 2 cores of an AVX2 EPYC
def run_train_py(
    *args: str,
    cwd: Path = ROOT,
    timeout: int = 1500,
    quiet: bool = True,
    fresh: bool = False,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` as a user runs it (quiet: as under CI, no progress bars), its stdout and stderr apart.

    fresh: in a new interpreter, as the README's commands are run. Otherwise forked from this test process's fork
    server, which imported torch, transformers and MLflow once: a sweep's trials run that way
    (memfit.sweep.trials.fork_process, as a fresh process would run them), and a run saves the ~10 CPU-seconds of
    imports, most of a tiny run's cost on 2 cores. extra_env: set in the run's environment."""
    env = {**train_py_env(), **(extra_env or {})}
    if not quiet:
        env.pop("CI", None)
    if fresh:
        command = [sys.executable, str(ROOT / "train.py"), *args]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="memfit-train-py-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = start_train_py(list(args), out, env, cwd=cwd, errors=err)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        return subprocess.CompletedProcess(["train.py", *args], returncode, out.read_text(), err.read_text())


def start_train_py(args: list[str], log: Path, env: dict[str, str], cwd: Path = ROOT, errors: Path | None = None):
    """`python train.py ARGS` forked from this test process's fork server (see run_train_py), its output in `log`
    (stderr too, unless `errors` is given); answers as subprocess.Popen does (wait, poll, kill, returncode)."""
    from memfit.sweep.trial_process import TrialJob
    from memfit.sweep.trials import fork_process

    job = TrialJob([str(ROOT / "train.py"), *args], str(log), env, errors=str(errors) if errors else None)
    with contextlib.chdir(cwd):  # the forked process starts in the directory its parent is in at start()
        return fork_process(job, "train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# MLflow's server and UI with one worker process: their default four each import MLflow's server, which on a 2-core
# machine busy with other tests pushed the start-up past 90 s (CI, session 19)
ONE_WORKER = ["--workers", "1"]


# MLflow 3's server starts job-queue consumers (huey processes, for its GenAI jobs) beside the web server: 3-4
# processes of ~7 CPU-seconds each per server here, for jobs memfit never submits. Off, except where a browser shows
# the UI (serving's `jobs`): with them off, an overlay took the UI's first click in the browser test.
NO_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def mlflow_server(store: str, port: int) -> list[str]:
    """`mlflow server` on 127.0.0.1 with one worker."""
    return ["mlflow", "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port), *ONE_WORKER]


def readme_mlflow_ui(store: str, port: int) -> list[str]:
    """The README's `mlflow ui` command on `store` and a free port (on 127.0.0.1, as the README says)."""
    ui = readme_command("mlflow ui")
    assert ui[ui.index("--host") + 1] == "127.0.0.1"
    ui[ui.index("--port") + 1] = str(port)
    ui[ui.index("--backend-store-uri") + 1] = store
    return ui


def finished_runs(output_dir) -> list:
    """The runs of `output_dir`'s MLflow store, asserted all FINISHED."""
    from mlflow.tracking import MlflowClient

    from memfit.tracking import default_tracking_uri

    client = MlflowClient(default_tracking_uri(str(output_dir)))
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    assert runs and all(r.info.status == "FINISHED" for r in runs), [r.info.status for r in runs]
    return runs


@contextlib.contextmanager
def serving(
    command: list[str], port: int, cwd: Path, timeout_s: float = 240, health: str = "/health", jobs: bool = False
) -> Iterator[str]:
    """Run a server command (MLflow's, optuna-dashboard) until the block ends; yields its base URL once `health`
    answers 200. Its output goes to `<cwd>/<command>.log`, whose tail a failure to start shows. jobs: MLflow's job
    execution as by default (see NO_JOBS)."""
    log_path = cwd / f"{Path(command[0]).name}-{port}.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **({} if jobs else NO_JOBS)},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}{health}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    why = (
                        f"exited with {server.returncode}"
                        if server.poll() is not None
                        else f"did not answer {health} within {timeout_s:.0f} s"
                    )
                    raise AssertionError(
                        f"{command[:2]} {why}; its log ends:\n{log_path.read_text()[-2000:]}"
                    ) from None
                time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # mlflow and gunicorn leave worker processes behind otherwise
        server.wait(timeout=30)


def served_runs(url: str, experiment_id: str) -> list[dict]:
    """The runs of an experiment as an MLflow server or `mlflow ui` at `url` serves them (its REST search)."""
    query = json.dumps({"experiment_ids": [experiment_id]}).encode()
    request = urllib.request.Request(
        f"{url}/api/2.0/mlflow/runs/search", data=query, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["runs"]


@pytest.fixture(scope="session")
def readme_budget_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's CPU budget sweep, run once per session: its output dir (MLflow store, Optuna study, presets)
    and the completed process. Tests read it; none writes into it."""
    out = tmp_path_factory.mktemp("readme_sweep")
    sweep = readme_command("python train.py -m sweep=budget")[2:]
    done = run_train_py(*sweep, f"output_dir={out}", cwd=out)  # launched there: its sweeps/preset/ is out's
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


@pytest.fixture(scope="session")
def tiny_seq2seq_calibration(tmp_path_factory) -> Callable[[Path], list[str]]:
    """Copies into an output_dir's calibration cache the memory model of tiny_seq2seq's CPU sweep trials, fitted
    once per session (one xdist worker fits it, under a lock, the others wait and share it): a sweep test whose
    subject is not calibration starts as on a machine that calibrated before, rather than paying ~15-60 CPU
    seconds of probes again. It is fitted from nothing here, by the sizing job those sweeps fork (its command
    line), and in tests/memory/test_calibration.py and the README's estimate_only example
    (.ci/readme_examples.py). Returns the keys copied."""
    from filelock import FileLock

    from memfit.sweep.sizing import sizing_overrides

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    fitted = root / "tiny_seq2seq_calibration"
    with FileLock(str(root / "tiny_seq2seq_calibration.lock")):
        if not list((fitted / "calibration").glob("*.json")):
            # the sizing job of tests/sweep's CPU sweeps (their settings that enter the calibration key)
            fixed = ["model=tiny_seq2seq", "trainer.device=cpu", "memory.precision=fp32", "data.max_train_samples=8"]
            done = run_train_py(*sizing_overrides({}, fixed, None, None), f"output_dir={fitted}")
            assert done.returncode == 0, done.stderr[-3000:]
            assert "memory model: calibrated" in done.stdout + done.stderr  # the sizing job fits it from nothing
    files = sorted((fitted / "calibration").glob("*.json"))

    def seed(output_dir: Path) -> list[str]:
        cache = output_dir / "calibration"
        cache.mkdir(parents=True, exist_ok=True)
        for file in files:
            shutil.copy(file, cache / file.name)
        return [file.stem for file in files]

    return seed


def _postgres_bin() -> Path | None:
    """Debian's PostgreSQL server binaries (package postgresql), or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


@pytest.fixture(scope="session")
def postgres() -> Iterator[Callable[[str], str]]:
    """A real PostgreSQL server on 127.0.0.1 in a temporary directory, for the test session; yields a function
    that creates a fresh database and returns its SQLAlchemy URL. Skips, saying why, where it cannot start."""
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql; .ci/run installs it)")
    try:
        import psycopg2
    except ImportError:
        pytest.skip("psycopg2 is not installed (pip install -e '.[test]')")
    # not under pytest's tmp dir: it is private to root, and the server runs as the postgres user
    root = Path(tempfile.mkdtemp(prefix="memfit-postgres-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root: run it as Debian's postgres user
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = root / "data"
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "memfit", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200"
    started = subprocess.run(
        [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"],
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        pytest.skip(f"PostgreSQL did not start: {started.stderr.strip()[-300:]}")
    names = iter(range(10**6))

    def database(prefix: str) -> str:
        name = f"{prefix}_{next(names)}"
        connection = psycopg2.connect(host="127.0.0.1", port=port, user="memfit", dbname="postgres")
        connection.autocommit = True
        connection.cursor().execute(f"CREATE DATABASE {name}")
        connection.close()
        return f"postgresql+psycopg2://memfit@127.0.0.1:{port}/{name}"

    try:
        yield database
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_finish(session) -> None:
    """Import what a run imports (torch, transformers, MLflow: memfit.sweep.warm_imports), then move every object
    this test process holds to the collector's permanent generation, as a forked trial does
    (memfit.sweep.trial_process): a run's gc.collect calls (the preflight's, accelerate's) then walk only what the
    tests made, not the ~700k objects of the imports, which live as long as the process anyway. A tiny in-process
    run: 5.4 -> 3.0 CPU-seconds here."""
    import gc

    import memfit.sweep.warm_imports  # noqa: F401 - the imports are the point

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items) -> None:
    """The slow end-to-end tests first (in their files' order), the quick ones after: xdist hands tests out in this
    order, so the two workers share the long runs from the start and the quick tests fill the end, rather than one
    worker finishing a long run alone while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """MEMFIT_TEST_CPU=<file>: append each test's CPU seconds (this process's and its reaped children's, setup and
    teardown included) to the file, one JSON line each: where the suite's CPU goes on a 2-core machine, which a
    test's wall time under xdist does not show."""
    path = os.environ.get("MEMFIT_TEST_CPU")
    if not path:
        yield
        return
    import resource

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    start, wall = cpu(), time.monotonic()
    yield
    with open(path, "a") as out:
        out.write(json.dumps({"test": item.nodeid, "cpu_s": cpu() - start, "wall_s": time.monotonic() - wall}) + "\n")
