"""tcmalloc for the command line on Linux: which malloc a process runs on, and a re-execution of
the CLI (`train`, `pretrain`) with tcmalloc preloaded when it is installed.

Why: XLA:CPU allocates its temporaries anew on every call, and glibc's malloc hands buffers over
32 MB back to the kernel on free, so every call faults its memory in again (28% of a CPU round's
time was in the kernel; docs/benchmarks.md). tcmalloc keeps them: the README's rotten-tomatoes job
took 6-9% less time, the benchmark's rounds about 30% less, with the same results. The allocator
is fixed when a process starts, so the CLI (`train.cli`) re-executes itself once, the same
command line, with LD_PRELOAD set, and only when that command line is the CLI's own (`python -m
fedjax_split.train ...` or the `fedjax-split-train` script; never a notebook, `-c`, stdin or a
wrapper). It leaves alone a process whose user preloads anything. FEDJAX_SPLIT_MALLOC=system
opts out; the child inherits LD_PRELOAD, and so do the processes it starts.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedjax_split.errors import UserError

ENV = "FEDJAX_SPLIT_MALLOC"  # auto (default): tcmalloc where installed; system: leave it
_MARK = "FEDJAX_SPLIT_MALLOC_REEXECUTED"  # set in the child: a preload that fails cannot loop
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # apt: libtcmalloc-minimal4
MODULE, SCRIPT = "fedjax_split.train", "fedjax-split-train"


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


def search_dirs() -> tuple[str, ...]:
    """Library directories of this machine's own architecture (Debian's multiarch dir first)."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    own = (f"/usr/lib/{multiarch}",) if multiarch else ()
    return (*own, "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc(dirs: Sequence[str] | None = None) -> str | None:
    """Path of an installed tcmalloc (the minimal build, then the full one), or None."""
    for d in search_dirs() if dirs is None else dirs:
        for name in LIBRARIES:
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return ctypes.util.find_library("tcmalloc_minimal") or None


def own_command_line(
    orig_argv: Sequence[str],
    argv: Sequence[str],
    modules: Mapping[str, object],
    module: str | None = None,
    script: str | None = None,
) -> list[str] | None:
    """The command line that started this CLI (`module` / `script`, default `MODULE` /
    `SCRIPT`: the train command's; `pretrain` passes its own), to run again, or None when the
    process is something else that merely called it (IPython or Jupyter, `-c`, a script read
    from stdin, another module or script): re-running that would repeat its side effects or
    replace it."""
    module, script = module or MODULE, script or SCRIPT
    if "IPython" in modules:
        return None
    args = list(argv[1:])
    head = list(orig_argv[: len(orig_argv) - len(args)])
    if len(head) < 2 or list(orig_argv[len(head) :]) != args:
        return None
    if head[-2:] == ["-m", module] or Path(head[-1]).name == script == Path(argv[0]).name:
        return list(orig_argv)
    return None


def should_preload(environ: Mapping[str, str], platform: str, current: str) -> bool:
    """Whether to look for tcmalloc at all: not off Linux, opted out, already re-executed once, on
    a malloc other than the system's, or with anything preloaded already (the user's choice: a
    sanitizer, another malloc)."""
    mode = environ.get(ENV, "auto")
    if mode not in ("auto", "system"):
        raise UserError(f"{ENV}={mode!r}: use auto (tcmalloc where installed) or system")
    return not (
        platform != "linux"
        or mode == "system"
        or environ.get(_MARK)
        or environ.get("LD_PRELOAD")
        or current != "system"
    )


def reexec_with_tcmalloc(module: str | None = None, script: str | None = None) -> None:
    """Replaces this process by the same command line with tcmalloc preloaded (see
    `should_preload` and `own_command_line`, which `module` / `script` name the CLI for);
    returns when there is no reason to. Call it first thing, before anything is computed or
    written."""
    if not should_preload(os.environ, sys.platform, allocator()):
        return
    command = own_command_line(sys.orig_argv, sys.argv, sys.modules, module, script)
    library = find_tcmalloc()  # after the cheap checks: its fallback runs ldconfig
    if command is None or library is None or not sys.executable:
        return
    env = {**os.environ, "LD_PRELOAD": library, _MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *command[1:]], env)
