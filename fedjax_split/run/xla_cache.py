"""JAX's persistent compilation cache, on by default, so that a second run does not compile again.

Why: a MiniLM client step takes some 8 s to compile on a 2-core CPU, once per step shape and
device, so the first round of a short run is mostly compilation. With the cache the second run of
the same command (and every later round shape already seen) loads the compiled programs instead
(docs/benchmarks.md). The cache lives beside the offline assets (`assets.cache_dir() / "xla"`),
keyed by JAX on the program, the jax/jaxlib version and the backend, so a stale entry is never
used. A user's own setting wins: JAX_COMPILATION_CACHE_DIR (or `jax_compilation_cache_dir` set
before the run) chooses another directory, and FEDJAX_SPLIT_XLA_CACHE=off leaves JAX as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedjax_split.errors import UserError

ENV = "FEDJAX_SPLIT_XLA_CACHE"  # on (default) | off


def enable() -> Path | None:
    """Points JAX's persistent compilation cache at our cache directory, unless the user chose one
    or opted out; returns the directory in use (None: no persistent cache)."""
    import jax

    mode = os.environ.get(ENV, "on")
    if mode not in ("on", "off"):
        raise UserError(f"{ENV}={mode!r}: use on (cache compiled programs on disk) or off")
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if mode == "off":
        return None
    from fedjax_split.assets import cache_dir

    path = cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
