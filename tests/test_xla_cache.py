"""fedjax_split.run.xla_cache: the persistent compilation cache on by default, a second process
loads what the first compiled, the user's own settings win."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A child that enables the cache as run_experiment does, compiles one program and reports the
# directory in use and the cache hits JAX recorded.
_PROBE = """
import jax, jax.numpy as jnp
from jax import monitoring
from fedjax_split.run import xla_cache
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
where = xla_cache.enable()
jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)(jnp.ones((8, 8))).block_until_ready()
print(where, len(hits))
"""


def _probe(tmp_path: Path, **env: str) -> tuple[str, int]:
    drop = ("JAX_COMPILATION_CACHE_DIR", "FEDJAX_SPLIT_XLA_CACHE")
    inherited = {k: v for k, v in os.environ.items() if k not in drop}
    full = {**inherited, "FEDJAX_SPLIT_CACHE": str(tmp_path / "cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env}  # fmt: skip
    res = subprocess.run([sys.executable, "-c", _PROBE], env=full, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    where, hits = res.stdout.split()
    return where, int(hits)


def test_a_second_process_loads_what_the_first_compiled(tmp_path: Path) -> None:
    where, hits = _probe(tmp_path)
    assert where == str(tmp_path / "cache" / "xla") and hits == 0
    assert any((tmp_path / "cache" / "xla").iterdir())  # the compiled program is on disk
    again, hits = _probe(tmp_path)
    assert again == where and hits >= 1  # our program (and jnp.ones') came from the disk


def test_the_users_directory_wins_and_off_means_off(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    assert _probe(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine)) == (str(mine), 0)
    assert any(mine.iterdir()) and not (tmp_path / "cache" / "xla").exists()
    assert _probe(tmp_path, FEDJAX_SPLIT_XLA_CACHE="off") == ("None", 0)
    assert not (tmp_path / "cache" / "xla").exists()


def test_an_unknown_setting_is_a_user_error(monkeypatch) -> None:
    import pytest

    from fedjax_split.errors import UserError
    from fedjax_split.run import xla_cache

    monkeypatch.setenv(xla_cache.ENV, "sometimes")
    with pytest.raises(UserError, match="FEDJAX_SPLIT_XLA_CACHE='sometimes': use on"):
        xla_cache.enable()
