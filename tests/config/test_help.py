"""`python train.py --help` is memfit's: what it does, the commands to start from, and the config groups."""

from __future__ import annotations

from tests.conftest import run_train_py


def test_help_names_memfit_its_first_commands_and_the_groups():
    out = run_train_py("--help", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("memfit: fine-tune transformers under a GPU memory budget")
    assert any("python train.py -m sweep=budget" in line for line in lines)
    assert any(line.startswith("memory: balanced, off, qlora, tight") for line in lines)
    assert "powered by Hydra" not in lines[0] and "--hydra-help" in lines[-1]
