"""What the config alone cannot tell, checked before any weights load or anything is recorded: one line each."""

from __future__ import annotations

import socket

import pytest

from memfit.config import ConfigError
from memfit.preconditions import (
    check_before_run,
    check_budget,
    check_lora_targets,
    check_output_dir,
    check_tracking_server,
    check_tracking_uri,
)
from tests.conftest import FAST, run_train_py


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_an_output_dir_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    (line,) = check_output_dir(str(blocker / "outputs"), 0.0)
    assert line.startswith(f"output_dir={blocker / 'outputs'} is not writable") and "choose a writable" in line
    assert check_output_dir(str(tmp_path / "fine"), 0.0) == []


def test_too_little_free_disk_is_named(tmp_path):
    (line,) = check_output_dir(str(tmp_path), min_free_gib=1e9)  # more than any disk has free
    assert "GiB free, less than min_free_disk_gib=1e+09" in line


def test_an_unreachable_tracking_server_is_named_before_training(compose_cfg):
    cfg = compose_cfg(f"tracking.uri=http://user:secret@127.0.0.1:{_closed_port()}")
    (line,) = check_tracking_server(cfg)
    assert "does not answer" in line and "tracking=none" in line
    assert "secret" not in line  # credentials are masked in every message


def test_a_lora_target_the_model_lacks_is_named_with_the_ones_it_has(compose_cfg):
    cfg = compose_cfg("model=tiny_causal", "model.lora.target_modules=[q_proj,qkv_fused]")
    (line,) = check_lora_targets(cfg)
    assert line.startswith("model.lora.target_modules has qkv_fused, which tiny_causal does not have")
    assert "q_proj" in line.split("its linear layers are")[1]
    assert check_lora_targets(compose_cfg("model=tiny_causal")) == []


def test_a_budget_larger_than_the_device_is_named(compose_cfg):
    (line,) = check_budget(compose_cfg("budget.gib=4096"), "cpu", 24 * 1024**3)
    assert line == (
        "budget.gib=4096 is larger than this machine's host 24.0 GiB: use budget.gib<=24 (or null for the whole device)"
    )
    assert check_budget(compose_cfg("budget.gib=8"), "cpu", 24 * 1024**3) == []


def test_all_problems_at_once(compose_cfg, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = compose_cfg(
        "model=tiny_causal",
        "model.lora.target_modules=[nope]",
        f"tracking.uri=http://127.0.0.1:{_closed_port()}",
        f"output_dir={blocker}/out",
    )
    with pytest.raises(ConfigError) as err:
        check_before_run(cfg)
    assert len(err.value.problems) == 3


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "is empty"),
        (b'{"source": "caf\xe9", "target": "x"}\n', "is not UTF-8 text"),
    ],
)
def test_empty_and_non_utf8_files_are_named(tmp_path, content, expected):
    path = tmp_path / "my.jsonl"
    path.write_bytes(content)
    out = run_train_py("data=jsonl", f"data.path={path}", f"output_dir={tmp_path / 'out'}", *FAST, timeout=120)
    assert out.returncode == 2 and f"memfit: error: data.path={path} {expected}" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out" / "mlflow.db").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["output_dir={blocked}/outputs"], "memfit: error: output_dir={blocked}/outputs is not writable"),
        (["model=tiny_causal", "budget.gib=100000"], "memfit: error: budget.gib=100000 is larger than"),
        (["tracking.uri=file://{blocked}/mlruns"], "memfit: error: tracking.uri=file://{blocked}/mlruns is MLflow's"),
        (["tracking.uri=sqlite:////no/such/dir/m.db"], "memfit: error: tracking.uri=sqlite:////no/such/dir/m.db: the"),
        (
            ["tracking.uri=sqlite:///{blocked}"],
            "memfit: error: tracking.uri=sqlite:///{blocked}: {blocked} is not a SQLite",
        ),
    ],
)
def test_train_py_stops_with_one_line_before_anything_is_recorded(tmp_path, overrides, expected):
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    args = [o.format(blocked=blocked) for o in overrides]
    out = run_train_py(*FAST, f"output_dir={tmp_path / 'out'}", *args, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert expected.format(blocked=blocked) in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out" / "mlflow.db").exists()


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "file:///data/mlruns",
            "tracking.uri=file:///data/mlruns is MLflow's file store, in maintenance mode since "
            "MLflow 3: use a sqlite store, e.g. tracking.uri=sqlite:////data/mlflow.db",
        ),
        ("./mlruns", "is MLflow's file store"),
        ("ftp://me:secret@host/x", "tracking.uri=ftp://me:***@host/x: MLflow has no 'ftp' store"),
        ("sqlite:////no/such/dir/m.db", "the directory /no/such/dir does not exist"),
    ],
)
def test_a_tracking_uri_mlflow_cannot_use_is_one_line(compose_cfg, uri, expected):
    (line,) = check_tracking_uri(compose_cfg(f"tracking.uri={uri}").tracking)
    assert expected in line and "secret" not in line


def test_usable_tracking_uris_pass(compose_cfg, tmp_path):
    for uri in (f"sqlite:///{tmp_path}/m.db", "postgresql+psycopg2://u:p@127.0.0.1/db", "http://127.0.0.1:5000"):
        assert check_tracking_uri(compose_cfg(f"tracking.uri={uri}").tracking) == []
    assert check_tracking_uri(compose_cfg("tracking=none", "tracking.uri=file:///x").tracking) == []


def test_a_tracking_server_behind_credentials_answers_the_health_check_with_them(compose_cfg):
    """The URL's user:password go as HTTP basic auth, as MLflow's client sends them; a server that wants them
    (here one that answers /health only with them) is reached, and a wrong password is named without it."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    wanted = "Basic " + base64.b64encode(b"user:s3cret").decode()

    class Guarded(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and self.headers.get("Authorization") == wanted
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Guarded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert check_tracking_server(compose_cfg(f"tracking.uri=http://user:s3cret@127.0.0.1:{port}")) == []
        (line,) = check_tracking_server(compose_cfg(f"tracking.uri=http://user:wrong@127.0.0.1:{port}"))
        assert "does not answer (Unauthorized)" in line and "wrong" not in line
    finally:
        server.shutdown()


def test_hydras_own_files_hold_no_password_of_a_url(tmp_path):
    out = run_train_py(
        f"output_dir={tmp_path}", f"tracking.uri=http://user:s3cret@127.0.0.1:{_closed_port()}", timeout=120
    )
    assert out.returncode == 2 and "s3cret" not in out.stderr
    written = sorted(tmp_path.glob("runs/*/*/.hydra/*.yaml"))
    assert {p.name for p in written} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert all("s3cret" not in p.read_text() for p in written)
    assert any("user:***@127.0.0.1" in p.read_text() for p in written)


def test_every_read_only_place_memfit_must_write_is_named_at_once(compose_cfg, tmp_path, tmpfs):
    """On a read-only mount (root writes past file permissions, not past that): output_dir, the tracking store's
    directory and both caches, each one line naming the field, before anything is written."""
    ro = tmpfs("size=1m,ro")
    cfg = compose_cfg(
        f"tracking.uri=sqlite:///{ro}/m.db", f"data.tokenized_cache={ro}/tok", f"calibration.cache_dir={ro}/cal"
    )
    with pytest.raises(ConfigError) as caches:
        check_before_run(cfg)
    assert caches.value.problems == [
        f"data.tokenized_cache={ro}/tok is not writable (Read-only file system): choose a writable directory, or "
        "data.tokenized_cache=null",
        f"calibration.cache_dir={ro}/cal is not writable (Read-only file system): choose a writable directory",
        f"tracking.uri=sqlite:///{ro}/m.db: the directory {ro} cannot be written: point to a writable one",
    ]
    (line,) = check_output_dir(str(ro / "out"), 0.0)
    assert line.startswith(f"output_dir={ro}/out is not writable (Read-only file system)")


def test_train_py_stops_on_a_read_only_cache_with_one_line(tmp_path, tmpfs):
    ro = tmpfs("size=1m,ro")
    out = run_train_py(*FAST, f"output_dir={tmp_path / 'out'}", f"data.tokenized_cache={ro}/tok", timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"memfit: error: data.tokenized_cache={ro}/tok is not")
