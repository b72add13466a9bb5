"""The suite's own set-up holds: --dist loadgroup keeps every test of one xdist_group on one
worker (pyproject.toml: the federation tests, a few GB each, never two at once). pytest 9.2's
structured node ids silently broke it (pytest-xdist issue 1386): the groups ran on both workers
and the suite took twice as long. And a run leaves nothing in the temporary directory: the
session's XLA cache was once left behind, with an empty one per worker (545 MB in 359 folders)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("federation")


@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    print("worker", os.environ["PYTEST_XDIST_WORKER"])
"""

UNGROUPED = """
import pytest


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(GROUPED)
    (tmp_path / "test_b.py").write_text(GROUPED.replace("test_grouped", "test_grouped_too"))
    (tmp_path / "test_c.py").write_text(UNGROUPED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
         "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    grouped = re.findall(r"\[(gw\d)\] .*PASSED .*test_grouped", res.stdout)
    assert len(grouped) == 8 and len(set(grouped)) == 1, res.stdout
    assert len(re.findall(r"PASSED .*test_free", res.stdout)) == 6


SEES_THE_CACHE = """
import os
from pathlib import Path


def test_sees_the_cache():
    seen = Path(os.environ["SEEN"], os.environ["PYTEST_XDIST_WORKER"])
    seen.write_text(os.environ["JAX_COMPILATION_CACHE_DIR"])
"""


def test_a_run_leaves_no_xla_cache_behind(tmp_path: Path) -> None:
    """The suite's conftest makes one XLA cache for the session, shared by the workers, and
    removes it at the end."""
    suite, temp, seen = tmp_path / "suite", tmp_path / "temp", tmp_path / "seen"
    suite.mkdir(), temp.mkdir(), seen.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    (suite / "test_x.py").write_text(SEES_THE_CACHE)
    (suite / "test_y.py").write_text(SEES_THE_CACHE.replace("sees_the", "too_sees_the"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k != "JAX_COMPILATION_CACHE_DIR"}  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(suite), str(suite)],
        capture_output=True, text=True, env={**env, "TMPDIR": str(temp), "SEEN": str(seen)},
        cwd=suite, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    caches = {p.read_text() for p in seen.iterdir()}
    assert len(list(seen.iterdir())) == 2 and len(caches) == 1, caches  # one for both workers
    assert Path(caches.pop()).parent == temp
    assert not list(temp.glob("fedjax-split-xla-*"))  # (pytest's own tmp_path stays, as ever)
