"""Process settings, applied by the entry points (the commands, the Flower apps, and
`run_experiment` / `run_pretraining`, which notebooks call); importing the library changes nothing.

- glibc's malloc tuned for XLA:CPU: XLA:CPU allocates its temporaries anew on every call, and
  glibc's defaults hand large blocks back to the kernel on free (mmap'd blocks, trimmed heap tops,
  shrunk per-thread arenas), so every call faults its memory in again. Three `mallopt` settings
  keep freed memory for reuse instead: one arena (M_ARENA_MAX 1: the other arenas' heaps shrink
  whatever the trim threshold), no fresh mmaps (M_MMAP_MAX 0), no trimming of the heap's top
  (M_TRIM_THRESHOLD 1 GiB). The cost is that the process keeps its peak heap. Only glibc's malloc
  is touched: a preloaded tcmalloc or jemalloc is left alone; FEDJAX_SPLIT_MALLOC=system opts out.
  It works best before JAX starts its threads, which is why the commands apply it first.
- JAX's persistent compilation cache, on by default beside the offline assets, so that a second
  run loads what the first compiled. JAX keys entries on the program, its version and the
  backend, so a stale entry is never used. Every program is kept, however fast it compiled
  (JAX keeps only those of a second or more unless told otherwise), so that a second identical run
  compiles nothing; on a GPU, XLA's per-fusion autotuning results are kept beside them (JAX's
  default, `jax_persistent_cache_enable_xla_caches`). The user's own JAX_COMPILATION_CACHE_DIR
  wins (with JAX's threshold); FEDJAX_SPLIT_XLA_CACHE=off leaves JAX as it is.
- Several CPU devices (`--cpu-devices`), so that clients trained one at a time can be dealt to
  them: two streams of small ops keep two cores busier than one. The count must be set before
  JAX starts its backends. docs/benchmarks.md has what each setting measured.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from fedjax_split import compilation
from fedjax_split.errors import Note, UserError, report

MALLOC_ENV = "FEDJAX_SPLIT_MALLOC"  # auto (default): tune glibc's malloc; system: leave it as it is
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))
_tuned = False


def allocator(maps: str | None = None) -> str:
    """The malloc this process runs on: 'tcmalloc' or 'jemalloc' when preloaded, 'glibc-tuned'
    after `tune_malloc`, 'system' otherwise, 'unknown' where /proc is not there (not Linux)."""
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
    mode = environ.get(MALLOC_ENV, "auto")
    if mode not in ("auto", "system"):
        raise UserError(f"{MALLOC_ENV}={mode!r}: use auto (tune glibc's malloc) or system")
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


def tune_malloc() -> bool:
    """Applies `SETTINGS` with mallopt once per process; whether the malloc is tuned now. A bad
    FEDJAX_SPLIT_MALLOC value is left to `check_malloc_setting`."""
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


def check_malloc_setting() -> None:
    """UserError (one line, exit status 2 from the CLI) for a FEDJAX_SPLIT_MALLOC other than
    auto or system."""
    wanted(os.environ, sys.platform, "system")


CACHE_ENV = "FEDJAX_SPLIT_CACHE"  # where the assets, the XLA cache and the nodes' state live


def cache_dir() -> Path:
    """$FEDJAX_SPLIT_CACHE, else $XDG_CACHE_HOME/fedjax_split, else ~/.cache/fedjax_split."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fedjax_split"


XLA_CACHE_ENV = "FEDJAX_SPLIT_XLA_CACHE"  # on (default) | off
MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"  # JAX's own; ours: 0


def enable_xla_cache() -> Path | None:
    """Points JAX's persistent compilation cache at our cache directory, unless the user chose one
    or opted out; returns the directory in use (None: no persistent cache)."""
    import jax

    mode = os.environ.get(XLA_CACHE_ENV, "on")
    if mode not in ("on", "off"):
        raise UserError(
            f"{XLA_CACHE_ENV}={mode!r}: use on (cache compiled programs on disk) or off"
        )
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if mode == "off":
        return None
    path = cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    if MIN_COMPILE_ENV not in os.environ:  # every program: a second run compiles nothing
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


_CPU_DEVICES = "jax_num_cpu_devices"


def use_cpu_devices(count: int | None) -> int:
    """Asks JAX for `count` CPU devices and returns how many the CPU backend has (None: leaves
    JAX's own count, 1 unless XLA_FLAGS says otherwise). Call it before any JAX computation.

    Once the backends have started their count is fixed: then fewer devices than `count` is a
    UserError (restart the process or notebook runtime), and more is fine (the first are used).
    """
    import jax

    if count is None:
        return len(jax.devices("cpu"))
    if count < 1:
        raise UserError(f"--cpu-devices must be at least 1, got {count}")
    try:
        jax.config.update(_CPU_DEVICES, count)
    except RuntimeError:  # the backends have started already
        have = len(jax.devices("cpu"))
        if have < count:
            raise UserError(
                f"JAX has started with {have} CPU device(s), so --cpu-devices {count} cannot "
                "apply; set it before any JAX computation (in a notebook: restart the runtime "
                "and run the experiment first), or leave it unset"
            ) from None
    return len(jax.devices("cpu"))


COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # JAX's own: process 0's HOST:PORT


def start_processes(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> int:
    """Joins this process to a multi-process simulation (JAX's distributed runtime) when asked
    (a coordinator, here or in JAX_COORDINATOR_ADDRESS, or more than one process); returns the
    number of processes. JAX fills what is unset from SLURM or Open MPI when it runs under them.
    Call it before any JAX computation; a second call (a notebook) keeps the first's runtime."""
    import jax

    if jax.distributed.is_initialized():
        return jax.process_count()
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    if coordinator is None and (num_processes or 1) == 1:
        return 1
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        where = f"at {coordinator!r}" if coordinator else "(no --coordinator given)"
        raise UserError(
            f"could not join the processes {where}: {reason}; give every process the same "
            "--coordinator HOST:PORT and --num-processes, and its own --process-id"
        ) from None
    return jax.process_count()


@dataclasses.dataclass(frozen=True)
class Applied:
    """What `apply` set: the malloc in use, the compilation cache directory, CPU devices."""

    allocator: str
    xla_cache: Path | None
    cpu_devices: int | None  # None: JAX's own count, left unasked (its backends not started)


def apply(cpu_devices: int | None = None, processes: tuple[Any, ...] = ()) -> Applied:
    """Every process setting at once, in the order that matters: the malloc before JAX starts
    its threads, warnings on one line, then the compilation cache, the CPU device count and
    `processes` (`start_processes`' arguments) before its first computation. Idempotent; a bad
    FEDJAX_SPLIT_MALLOC or FEDJAX_SPLIT_XLA_CACHE is a UserError. Without `cpu_devices` JAX's
    backends are not started here (a process that needs no device, such as a Flower node
    answering a query, does not pay for them)."""
    check_malloc_setting()
    tune_malloc()
    one_line_warnings()
    compilation.watch()  # before the first compilation
    cache = enable_xla_cache()
    if cpu_devices is not None:  # jax.distributed.initialize fixes the count it finds set
        import jax

        try:
            jax.config.update(_CPU_DEVICES, cpu_devices)
        except RuntimeError:
            pass  # started already: use_cpu_devices says whether the count is enough
    if processes:
        start_processes(*processes)  # before the backends start (use_cpu_devices starts them)
    devices = None if cpu_devices is None else use_cpu_devices(cpu_devices)
    return Applied(allocator(), cache, devices)


def one_line_warning(
    message: Any, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Warnings as the CLI's other messages, on one line: a source line under them reads like a
    crash. Ours are plain UserWarnings, and a `Note` is a plain line without "warning:"; others
    keep their category and origin."""
    if issubclass(category, Note):
        return f"{message}\n"
    if category is UserWarning:
        return f"warning: {message}\n"
    return f"warning: {category.__name__}: {message} ({filename}:{lineno})\n"


def one_line_warnings() -> None:
    """This process's warnings through `one_line_warning`: every process entry point (the
    commands, the Flower apps, export, assets, tools/) calls it first, and `apply` (so a notebook's
    `run_experiment` too); importing the library alone leaves Python's format as it is."""
    import warnings

    warnings.formatwarning = one_line_warning


def run_command(command_main: Callable[[], int]) -> NoReturn:
    """A command's entry point: the malloc checked and tuned before anything starts threads (a bad
    FEDJAX_SPLIT_MALLOC is the one-line exit-2 error), warnings on one line, then
    `command_main`'s exit status."""
    try:
        check_malloc_setting()
        tune_malloc()
    except UserError as e:
        sys.exit(report(e))
    one_line_warnings()
    sys.exit(command_main())
