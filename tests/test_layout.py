"""The package's layout rules (docs/architecture.md): imports point down the layers only, the data
pipelines do not import each other, importing the library imports no heavy framework, and no
function is longer than 80 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedjax_split"
# Bottom to top. A module imports its own layer or layers below it. The commands and the Flower
# apps are on top: nothing imports them.
LAYERS = [
    {"errors", "compilation"},
    {"assets", "atomic", "runtime"},
    {"tasks"},
    {"models"},
    {"data"},
    {"fed"},
    {"sim"},
    {"run"},
    {"deploy"},
    {"cli", "train", "pretrain", "flower", "export", "__init__"},
]
MAX_LINES = 80


def _unit(module: str) -> str:
    """The layer unit of a dotted module name below fedjax_split: 'data' for data.text.masking."""
    return module.split(".")[0]


def _imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every fedjax_split import, function-level ones
    too, as dotted names below fedjax_split."""
    edges = []
    for path in PACKAGE.rglob("*.py"):
        here = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "fedjax_split":
                    names = [a.name for a in node.names]
                elif node.module.startswith("fedjax_split."):
                    names = [node.module.removeprefix("fedjax_split.")]
            elif isinstance(node, ast.Import):
                names = [a.name.removeprefix("fedjax_split.") for a in node.names
                         if a.name.startswith("fedjax_split.")]  # fmt: skip
            edges += [(here, name) for name in names]
    return edges


def _layer(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"{unit} is in no layer of tests/test_layout.py: add it")


def test_imports_point_down_the_layers() -> None:
    upward = [
        (a, b) for a, b in _imports() if _layer(_unit(b)) > _layer(_unit(a))
    ]
    assert upward == []


def test_the_data_pipelines_do_not_import_each_other() -> None:
    subpackages = ("data.tokens", "data.text")
    crossing = [
        (a, b) for a, b in _imports()
        for mine in subpackages if a.startswith(mine + ".")
        for other in subpackages if other != mine and b.startswith(other)
    ]  # fmt: skip
    assert crossing == []


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} {lines}")
    assert long == []


def test_importing_the_library_is_cheap() -> None:
    """`import fedjax_split` and a look at its public names' table import no framework."""
    code = (
        "import sys, fedjax_split\n"
        "assert 'run_experiment' in fedjax_split.__all__\n"
        "heavy = ('jax', 'flax', 'transformers', 'torch', 'flwr')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
