"""fedjax_split.malloc: the malloc a process runs on, and the CLI's one re-execution on tcmalloc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_split import malloc

ROOT = Path(__file__).resolve().parents[1]
GLIBC = "7f01-7f02 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
TC = "7f03-7f04 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n"
JE = "7f05-7f06 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"


def test_allocator_is_read_from_the_process_maps():
    assert malloc.allocator(GLIBC) == "system"
    assert malloc.allocator(GLIBC + TC) == "tcmalloc"
    assert malloc.allocator(JE + GLIBC) == "jemalloc"
    assert malloc.allocator() in {"system", "tcmalloc", "jemalloc"}


def test_find_tcmalloc_prefers_the_minimal_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(malloc.ctypes.util, "find_library", lambda name: None)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert malloc.find_tcmalloc([str(a), str(b)]) is None
    (b / "libtcmalloc.so.4").write_bytes(b"")
    assert malloc.find_tcmalloc([str(a), str(b)]) == str(b / "libtcmalloc.so.4")
    (b / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert malloc.find_tcmalloc([str(a), str(b)]) == str(b / "libtcmalloc_minimal.so.4")
    (a / "libtcmalloc.so.4").write_bytes(b"")  # an earlier directory wins
    assert malloc.find_tcmalloc([str(a), str(b)]) == str(a / "libtcmalloc.so.4")


def test_preloaded_env_puts_tcmalloc_first_and_marks_the_child():
    env = malloc.preloaded_env({"PATH": "/bin", "LD_PRELOAD": "/x/libfoo.so"}, "linux", "system",
                               "/l/libtcmalloc_minimal.so.4")  # fmt: skip
    assert env == {"PATH": "/bin", "LD_PRELOAD": "/l/libtcmalloc_minimal.so.4 /x/libfoo.so",
                   malloc.ENV: "tcmalloc"}  # fmt: skip
    env = malloc.preloaded_env({}, "linux", "system", "/l/libtcmalloc_minimal.so.4")
    assert env == {"LD_PRELOAD": "/l/libtcmalloc_minimal.so.4", malloc.ENV: "tcmalloc"}


@pytest.mark.parametrize(
    "environ, platform, current, library",
    [
        ({}, "darwin", "unknown", "/l/libtcmalloc.so.4"),  # not Linux
        ({malloc.ENV: "system"}, "linux", "system", "/l/libtcmalloc.so.4"),  # opted out
        ({malloc.ENV: "tcmalloc"}, "linux", "system", "/l/libtcmalloc.so.4"),  # tried once
        ({}, "linux", "tcmalloc", "/l/libtcmalloc.so.4"),  # already on it
        ({}, "linux", "jemalloc", "/l/libtcmalloc.so.4"),  # someone chose another
        ({}, "linux", "system", None),  # not installed
    ],
)
def test_preloaded_env_leaves_the_process_alone(environ, platform, current, library):
    assert malloc.preloaded_env(environ, platform, current, library) is None


_PROBE = (
    "import os, sys; from fedjax_split import malloc; print('before', flush=True); "
    "malloc.reexec_with_tcmalloc(); print(malloc.allocator(), os.environ.get(malloc.ENV), "
    "sys.argv[1:])"
)


def _probe(**env: str) -> list[str]:
    inherited = {k: v for k, v in os.environ.items() if k not in (malloc.ENV, "LD_PRELOAD")}
    proc_env = {**inherited, "PYTHONPATH": str(ROOT), **env}
    res = subprocess.run([sys.executable, "-c", _PROBE, "--task=sst2", "x y"], env=proc_env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_reexecution_runs_the_same_command_on_tcmalloc_where_installed():
    """A real re-execution on this machine: the same arguments, on tcmalloc when it is installed
    (it is, where CI runs), on the system's malloc otherwise; never more than once."""
    lines = _probe()
    if malloc.find_tcmalloc() is None:
        assert lines == ["before", "system None ['--task=sst2', 'x y']"]
    else:
        # the first process printed "before", then became the second, which printed it again
        assert lines == ["before", "before", "tcmalloc tcmalloc ['--task=sst2', 'x y']"]


def test_reexecution_can_be_turned_off():
    assert _probe(**{malloc.ENV: "system"}) == ["before", "system system ['--task=sst2', 'x y']"]
