"""The package's shape: memfit's packages import each other only along the flow (no circle), and importing the
run or the sweep pulls in no heavy library (composition, validation and --help stay fast)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict

from tests.conftest import ROOT

SRC = ROOT / "src" / "memfit"

# what each of memfit's top-level packages and modules may import of the others: config → run → data / models /
# memory → training → tracking (config is the schema every phase reads; progress draws progress bars)
MAY_IMPORT = {
    "config": set(),
    "progress": set(),
    "tracking": {"config"},
    "lora_dropout": set(),
    "lora_update": set(),
    "attention_mask": set(),
    "models": {"config", "lora_dropout", "lora_update", "attention_mask"},
    "data": {"config", "progress"},
    "memory": {"config", "data"},
    "training": {"config", "data", "memory"},
    "preconditions": {"config", "models", "tracking"},  # models: a weightless build, for the LoRA targets
    "run": {"config", "preconditions", "data", "models", "memory", "training", "tracking", "progress"},
    "sweep": {"config", "data", "models", "memory", "tracking", "progress"},
}


def _package_of(module: str) -> str:
    return module.split(".")[1]


def package_imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts == ("__init__",):
            continue
        importer = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("memfit.") and _package_of(name) != importer:
                    found[importer].add(_package_of(name))
    return found


def test_every_package_imports_only_along_the_flow():
    imports = package_imports()
    assert set(imports) <= set(MAY_IMPORT), f"a package the layout does not know: {set(imports) - set(MAY_IMPORT)}"
    for importer, imported in imports.items():
        assert imported <= MAY_IMPORT[importer], f"memfit.{importer} imports {imported - MAY_IMPORT[importer]}"


def test_importing_the_run_and_the_sweep_pulls_in_no_heavy_library():
    code = (
        "import sys, memfit.run, memfit.sweep, hydra_plugins.memfit_sweeper.memfit_sweeper\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'mlflow', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_is_over_400_lines_unless_its_docstring_says_why():
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 400:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            assert "over 400 lines" in docstring, f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines"


def test_no_function_is_over_about_60_lines_unless_its_docstring_says_why():
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                why = "over 60 lines" in (ast.get_docstring(node) or "")
                assert length <= 65 or why, f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {length} lines"


def test_comments_name_the_result_file_behind_a_figure_never_a_session_run_or_card():
    """A figure in memfit's comments names the results file that holds it, and that file exists; history (sessions,
    numbered runs, which card) stays in git and in the result files' names."""
    import glob
    import re

    problems = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        for ref in re.findall(r"benchmarks/results/[\w.*-]+", text):
            if not glob.glob(str(ROOT / ref.rstrip(".,;)"))):
                problems.append(f"{path.relative_to(ROOT)}: {ref} does not exist")
        prose = re.sub(r"benchmarks/results/\S+", "", text)
        for found in re.findall(r"\b[Ss]ession \d+|\b[Rr]un \d+\b|\bH[12]00\b|benchmarks/README", prose):
            problems.append(f"{path.relative_to(ROOT)}: {found!r}")
    assert not problems, "\n".join(problems)


def test_the_contributing_guide_lists_every_module_and_no_other():
    """docs/contributing.md's layout names each module of src/memfit as the tree holds it: one added, moved or
    removed without the guide fails here."""
    import re

    guide = (ROOT / "docs" / "contributing.md").read_text()
    block = guide.split("## Layout", 1)[1].split("```", 2)[1]
    listed, package = set(), None  # None: outside src/memfit
    for line in block.splitlines()[1:]:
        if not line.startswith(" "):  # a root: src/memfit/ is the one listed module by module
            package = "" if line.startswith("src/memfit/") else None
        elif package is not None and re.match(r"^  [a-z_]+/", line):  # a package of src/memfit
            package = line.split()[0]
        elif package is not None and re.match(r"^  [a-z_]+\.py", line):  # top-level modules
            package = ""
        if package is not None:
            listed |= {f"{package}{name}" for name in re.findall(r"\b([a-z_]+\.py)\b", line)}
    modules = {str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if path.name != "__init__.py"}
    assert listed == modules, f"not in the guide: {sorted(modules - listed)}; not in src: {sorted(listed - modules)}"


def test_no_two_modules_import_each_other_even_lazily():
    """No circle among memfit's modules, counting imports inside functions too (a package's __init__, which only
    re-exports, is left out): a module that needs another's name while that one needs it back is a layering bug."""
    modules = {}
    for path in SRC.rglob("*.py"):
        if path.name != "__init__.py":
            modules[".".join(path.relative_to(SRC.parent).with_suffix("").parts)] = path
    imports: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memfit"):
                targets = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
                imports[name] |= {target for target in targets if target in modules and target != name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in imports[start])

    circles = sorted(f"{a} <-> {b}" for a in imports for b in imports[a] if a < b and reaches(b, a, set()))
    assert not circles, circles
