"""glibc's malloc tuned in-process for XLA:CPU's allocation pattern, and which malloc a process
runs on.

Why: XLA:CPU allocates its temporaries anew on every call (a MiniLM step's gradients of the
47 MB word-embedding table among them). glibc's defaults hand large blocks back to the kernel on
free (mmap'd blocks, trimmed heap tops, and the per-thread arenas' heaps, which it shrinks), so
every call faults its memory in again: 3.7M page faults and 17 s of system time in a 4-client
benchmark process here. Three `mallopt` settings keep freed memory for reuse instead: every thread
allocates from the main arena (M_ARENA_MAX 1: the other arenas' heaps shrink whatever the trim
threshold), from the heap rather than fresh mmaps (M_MMAP_MAX 0), and the heap's top is not
trimmed (M_TRIM_THRESHOLD 1 GiB). That cut the faults 3.2x and the system time 2x with no
package to install (docs/benchmarks.md); the cost is that the process keeps its peak heap.

`tune()` runs when `fedjax_split` is imported, before JAX starts its threads, so the command
line, notebooks and scripts all get it. It only touches glibc's malloc: a process on another
malloc (tcmalloc or jemalloc preloaded by the user) is left alone, and FEDJAX_SPLIT_MALLOC=system
opts out.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from fedjax_split.errors import UserError

ENV = "FEDJAX_SPLIT_MALLOC"  # auto (default): tune glibc's malloc; system: leave it as it is
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))
_tuned = False


def allocator(maps: str | None = None) -> str:
    """The malloc this process runs on: 'tcmalloc' or 'jemalloc' when preloaded, 'glibc-tuned'
    after `tune`, 'system' otherwise, 'unknown' where /proc is not there (not Linux)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc-tuned" if _tuned else "system"


def wanted(environ: Mapping[str, str], platform: str, current: str) -> bool:
    """Whether to tune: on Linux's glibc malloc (not another one preloaded), unless opted out."""
    mode = environ.get(ENV, "auto")
    if mode not in ("auto", "system"):
        raise UserError(f"{ENV}={mode!r}: use auto (tune glibc's malloc) or system")
    return platform == "linux" and mode == "auto" and current == "system"


def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc (it exports gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - musl and others have no such symbol
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def tune() -> bool:
    """Applies `SETTINGS` with mallopt once per process; whether the malloc is tuned now. A bad
    FEDJAX_SPLIT_MALLOC value is left to the CLI to report (`check_setting`)."""
    global _tuned
    if _tuned:
        return True
    try:
        if not wanted(os.environ, sys.platform, allocator()):
            return False
    except UserError:
        return False
    libc = _glibc()
    if libc is None:
        return False
    _tuned = all(libc.mallopt(option, value) == 1 for option, value in SETTINGS)
    return _tuned


def check_setting() -> None:
    """UserError (one line, exit status 2 from the CLI) for a FEDJAX_SPLIT_MALLOC other than
    auto or system."""
    wanted(os.environ, sys.platform, "system")
