"""tcmalloc for the command line on Linux: which malloc a process runs on, and a re-execution of
the CLI with tcmalloc preloaded when it is installed.

Why: XLA:CPU allocates its temporaries anew on every call, and glibc's malloc hands buffers over
32 MB back to the kernel on free, so every call faults its memory in again (28% of a CPU round's
time was in the kernel; docs/benchmarks.md). tcmalloc keeps them: the README's rotten-tomatoes job
takes about 10% less time, the benchmark's rounds 25-30% less, with bit-identical results. The
allocator is fixed when a process starts, so the CLI (`train.cli`) re-executes itself once, the
same command line, with LD_PRELOAD set. FEDJAX_SPLIT_MALLOC=system opts out. In a notebook the
kernel's process must be started with LD_PRELOAD itself.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV = "FEDJAX_SPLIT_MALLOC"  # "system": keep the process's malloc; "tcmalloc": already re-executed
LIBRARY = "libtcmalloc_minimal.so.4"  # Debian/Ubuntu: apt-get install libtcmalloc-minimal4
SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
               "/usr/lib", "/usr/local/lib")  # fmt: skip


def allocator(maps: str | None = None) -> str:
    """The malloc this process runs on, from its memory maps: 'tcmalloc' or 'jemalloc' when
    preloaded, 'system' otherwise, 'unknown' where /proc is not there (not Linux)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


def find_tcmalloc(dirs: Sequence[str] = SEARCH_DIRS) -> str | None:
    """Path of an installed tcmalloc (the minimal build, then the full one), or None."""
    for d in dirs:
        for name in (LIBRARY, "libtcmalloc.so.4"):
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    found = ctypes.util.find_library("tcmalloc_minimal")
    return found or None


def preloaded_env(
    environ: Mapping[str, str], platform: str, current: str, library: str | None
) -> dict[str, str] | None:
    """The environment to re-execute with, tcmalloc first in LD_PRELOAD, or None to run on as is:
    off Linux, opted out, already re-executed once (so a preload that does not take cannot loop),
    already on tcmalloc or jemalloc, or no tcmalloc installed."""
    if platform != "linux" or environ.get(ENV) in ("system", "tcmalloc"):
        return None
    if current != "system" or library is None:
        return None
    preload = " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    return {**environ, "LD_PRELOAD": preload, ENV: "tcmalloc"}


def reexec_with_tcmalloc() -> None:
    """Replaces this process by the same command line with tcmalloc preloaded (see
    `preloaded_env`); returns without doing anything when there is no reason to. Call it first
    thing, before anything is computed or written."""
    env = preloaded_env(os.environ, sys.platform, allocator(), find_tcmalloc())
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
