"""What XLA compiled in this process, from JAX's own compile events.

JAX reports every backend compilation (`/jax/core/compile/backend_compile_duration`, with the
program's name) and every program the persistent cache served instead (`.../cache_hits`, recorded
inside the same compilation). `watch()` registers one listener per process (JAX has no public way
to remove one) that keeps them all; a run marks where a round starts (`mark`) and reads what was
compiled since (`since`). A program loaded from the cache is listed as such, not as compiled.
Why it matters: on an accelerator the first round is compile-bound, and a run's shapes decide
how many programs it compiles (`data.batching`: one shape per run).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program XLA built: its name (the jitted function's, e.g. `jit(segment_one)`), the
    seconds it took and whether the persistent cache served it."""

    name: str
    seconds: float
    cached: bool


class CompileLog:
    """Every compilation of this process, in order (appended by JAX's listeners)."""

    def __init__(self) -> None:
        self.events: list[Compiled] = []
        self._hit = threading.local()

    def on_event(self, event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            self._hit.value = True

    def on_duration(self, event: str, seconds: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            cached = getattr(self._hit, "value", False)
            self._hit.value = False
            self.events.append(Compiled(str(kwargs.get("fun_name", "?")), seconds, cached))

    def mark(self) -> int:
        """A point to count from (`since`)."""
        return len(self.events)

    def since(self, mark: int = 0) -> list[Compiled]:
        return self.events[mark:]


_LOG: CompileLog | None = None
_LOCK = threading.Lock()


def watch() -> CompileLog:
    """The process's compile log, listening from the first call on."""
    from jax import monitoring  # here, not at the top: a command's --help imports no JAX

    global _LOG
    with _LOCK:
        if _LOG is None:
            _LOG = CompileLog()
            monitoring.register_event_listener(_LOG.on_event)
            monitoring.register_event_duration_secs_listener(_LOG.on_duration)
    return _LOG


def counts(events: Sequence[Compiled], *, cached: bool = False) -> dict[str, int]:
    """How many times each program was compiled (`cached`: loaded from the cache instead)."""
    out: dict[str, int] = {}
    for e in events:
        if e.cached == cached:
            out[e.name] = out.get(e.name, 0) + 1
    return out


SLOW = 1.0  # seconds: a compilation a person waits for


def report(events: Sequence[Compiled], top: int = 5) -> dict[str, Any]:
    """What a record says of `events`: programs compiled and their seconds, those that took a
    second or more, programs the cache served, and the slowest programs by total seconds."""
    built = [e for e in events if not e.cached]
    by_name: dict[str, list[float]] = {}
    for e in built:
        by_name.setdefault(e.name, []).append(e.seconds)
    slowest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "programs_compiled": len(built),
        "compile_seconds": round(sum(e.seconds for e in built), 3),
        "slow_compiles": sum(e.seconds >= SLOW for e in built),
        "programs_from_cache": len(events) - len(built),
        "slowest_programs": [
            {"program": name, "times": len(s), "seconds": round(sum(s), 3)} for name, s in slowest
        ],
    }
