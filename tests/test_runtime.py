"""fedjax_split.runtime: the process settings the entry points apply (glibc's malloc tuned so
that freed buffers are reused instead of faulted in again; the persistent compilation cache; CPU
devices), and that importing the library applies none of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from fedjax_split import runtime
from fedjax_split.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

GLIBC = "7f01-7f02 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
TC = "7f03-7f04 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n"
JE = "7f05-7f06 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"


def test_allocator_is_read_from_the_process_maps(monkeypatch):
    assert runtime.allocator(GLIBC + TC) == "tcmalloc"
    assert runtime.allocator(JE + GLIBC) == "jemalloc"
    monkeypatch.setattr(runtime, "_tuned", False)
    assert runtime.allocator(GLIBC) == "system"
    monkeypatch.setattr(runtime, "_tuned", True)
    assert runtime.allocator(GLIBC) == "glibc-tuned"


def test_tuning_is_wanted_on_linux_glibc_unless_opted_out():
    assert runtime.wanted({}, "linux", "system")
    assert runtime.wanted({runtime.MALLOC_ENV: "auto"}, "linux", "system")
    assert not runtime.wanted({runtime.MALLOC_ENV: "system"}, "linux", "system")  # opted out
    assert not runtime.wanted({}, "darwin", "unknown")  # not Linux
    assert not runtime.wanted({}, "linux", "tcmalloc")  # the user preloaded another malloc
    assert not runtime.wanted({}, "linux", "jemalloc")
    with pytest.raises(UserError, match=r"FEDJAX_SPLIT_MALLOC='off': use auto .* or system"):
        runtime.wanted({runtime.MALLOC_ENV: "off"}, "linux", "system")


# A child process that applies the runtime settings (which tune malloc unless opted out), then, in a
# second thread as XLA's workers would, allocates, touches and frees a 64 MB block ten times,
# and prints the minor page faults that took, and the allocator it reports.
_MALLOC_PROBE = """
import ctypes, resource, sys, threading
from fedjax_split import runtime
runtime.tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
faults = []
def work():
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=work)
t.start(); t.join()
print(runtime.allocator(), sum(faults[1:]), faults[0])
"""


def _malloc_probe(**env: str) -> tuple[str, int, int]:
    inherited = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", runtime.MALLOC_ENV)}
    res = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], env={**inherited, **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    name, later, first = res.stdout.split()
    return name, int(later), int(first)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_freed_block_is_reused_instead_of_faulted_in_again():
    """Untuned, each of the nine repeated 64 MB blocks is a fresh mmap whose pages fault in anew
    (about 16k 4 KB faults each); tuned, the first block's pages are reused."""
    name, later, first = _malloc_probe(**{runtime.MALLOC_ENV: "system"})
    assert name == "system"
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert later > 9 * pages // 2, (later, pages)  # faulted in again and again
    name, later_tuned, first_tuned = _malloc_probe()
    assert name == "glibc-tuned"
    assert first_tuned > pages // 2  # the first touch faults, of course
    assert later_tuned < later // 10, (later_tuned, later)


# A child that enables the cache as the entry points do, compiles one program and reports the
# directory in use and the cache hits JAX recorded.
_CACHE_PROBE = """
import jax, jax.numpy as jnp
from jax import monitoring
from fedjax_split import runtime
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
where = runtime.enable_xla_cache()
jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)(jnp.ones((8, 8))).block_until_ready()
print(where, len(hits))
"""


def _cache_probe(tmp_path: Path, **env: str) -> tuple[str, int]:
    drop = ("JAX_COMPILATION_CACHE_DIR", "FEDJAX_SPLIT_XLA_CACHE")
    inherited = {k: v for k, v in os.environ.items() if k not in drop}
    full = {**inherited, "FEDJAX_SPLIT_CACHE": str(tmp_path / "cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env}  # fmt: skip
    res = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=full, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    where, hits = res.stdout.split()
    return where, int(hits)


def test_a_second_process_loads_what_the_first_compiled(tmp_path: Path) -> None:
    where, hits = _cache_probe(tmp_path)
    assert where == str(tmp_path / "cache" / "xla") and hits == 0
    assert any((tmp_path / "cache" / "xla").iterdir())  # the compiled program is on disk
    again, hits = _cache_probe(tmp_path)
    assert again == where and hits >= 1  # our program (and jnp.ones') came from the disk


def test_the_users_directory_wins_and_off_means_off(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    assert _cache_probe(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine)) == (str(mine), 0)
    assert any(mine.iterdir()) and not (tmp_path / "cache" / "xla").exists()
    assert _cache_probe(tmp_path, FEDJAX_SPLIT_XLA_CACHE="off") == ("None", 0)
    assert not (tmp_path / "cache" / "xla").exists()


def test_an_unknown_setting_is_a_user_error(monkeypatch) -> None:
    monkeypatch.setenv(runtime.XLA_CACHE_ENV, "sometimes")
    with pytest.raises(UserError, match="FEDJAX_SPLIT_XLA_CACHE='sometimes': use on"):
        runtime.enable_xla_cache()


def test_after_start_the_count_is_kept_or_a_user_error() -> None:
    have = len(jax.devices("cpu"))  # started by now (conftest forces 2)
    assert have == 2
    assert runtime.use_cpu_devices(None) == have
    assert runtime.use_cpu_devices(have) == have
    assert runtime.use_cpu_devices(1) == have  # more than asked for: the first are used
    with pytest.raises(UserError, match="restart the runtime"):
        runtime.use_cpu_devices(have + 1)
    with pytest.raises(UserError, match="at least 1"):
        runtime.use_cpu_devices(0)
    assert len(jax.devices("cpu")) == have


def test_before_start_the_count_is_applied() -> None:
    """In a fresh process (no XLA_FLAGS), the count asked for is the count JAX starts with."""
    code = (
        "import jax; from fedjax_split.runtime import use_cpu_devices as u; "
        "print(u(3), len(jax.devices('cpu')), u(None))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["3", "3", "3"]


def test_importing_the_library_changes_nothing_in_the_process() -> None:
    """`import fedjax_split` (and its public names) neither tunes malloc nor touches JAX's
    configuration; `runtime.apply` does both."""
    code = (
        "import jax, fedjax_split\n"
        "from fedjax_split import runtime\n"
        "fedjax_split.run_experiment, fedjax_split.RoundSpec\n"
        "print(runtime.allocator(), jax.config.jax_compilation_cache_dir or None)\n"
        "applied = runtime.apply(None)\n"
        "print(applied.allocator, applied.xla_cache is not None, applied.cpu_devices)\n"
        "print(jax._src.xla_bridge.backends_are_initialized())\n"
    )
    drop = ("LD_PRELOAD", runtime.MALLOC_ENV, runtime.XLA_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    before, after, started = res.stdout.splitlines()
    assert before == "system None"
    want = "glibc-tuned" if sys.platform.startswith("linux") else "system"
    assert after.split() == [want, "True", "None"]
    assert started == "False"  # no device count asked for: JAX's backends not started


def test_apply_reports_a_bad_setting_as_a_user_error(monkeypatch) -> None:
    monkeypatch.setenv(runtime.MALLOC_ENV, "off")
    with pytest.raises(UserError, match="FEDJAX_SPLIT_MALLOC='off'"):
        runtime.apply(None)
