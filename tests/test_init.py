"""The public API: every exported name resolves, lazily, and the documented example (docs/usage.md,
linked from the README) imports from the top-level package only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import fedjax_split

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def test_every_exported_name_resolves() -> None:
    for name in fedjax_split.__all__:
        assert getattr(fedjax_split, name) is not None, name


def test_import_stays_cheap() -> None:
    code = "import sys, fedjax_split; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_usage_python_example_imports_from_the_public_api_only() -> None:
    blocks = re.findall(r"```python\n(.*?)```", USAGE.read_text(), flags=re.S)
    assert blocks, "docs/usage.md has no Python example"
    tree = ast.parse(blocks[0])
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert imports and all(n.module == "fedjax_split" for n in imports), "import from the API"
    names = {a.name for n in imports for a in n.names}
    assert names <= set(fedjax_split.__all__), names - set(fedjax_split.__all__)
    namespace: dict = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), "usage.md", "exec"), namespace)
    assert all(namespace[n] is getattr(fedjax_split, n) for n in names)
