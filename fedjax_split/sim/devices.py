"""Several CPU devices, so that clients trained one at a time can be dealt to them
(`rounds.RoundSpec.devices`; `--cpu-devices` in the CLI).

Why: a client step is a few thousand small ops; on a CPU one stream of them, every op split
across all cores, leaves the cores idle between ops. Two devices run two clients' streams at
once and keep them busier: a K=10 MiniLM round took 10% less time on this 2-core machine. The
price is compilation: each program compiles once per device (docs/benchmarks.md), so it pays in
long runs with many clients. The count must be set before JAX starts its backends.
"""

from __future__ import annotations

import jax

from fedjax_split.errors import UserError

_SETTING = "jax_num_cpu_devices"


def use_cpu_devices(count: int | None) -> int:
    """Asks JAX for `count` CPU devices and returns how many the CPU backend has (None: leaves
    JAX's own count, 1 unless XLA_FLAGS says otherwise). Call it before any JAX computation.

    Once the backends have started their count is fixed: then fewer devices than `count` is a
    UserError (restart the process or notebook runtime), and more is fine (the first are used).
    """
    if count is None:
        return len(jax.devices("cpu"))
    if count < 1:
        raise UserError(f"--cpu-devices must be at least 1, got {count}")
    try:
        jax.config.update(_SETTING, count)
    except RuntimeError:  # the backends have started already
        have = len(jax.devices("cpu"))
        if have < count:
            raise UserError(
                f"JAX has started with {have} CPU device(s), so --cpu-devices {count} cannot "
                "apply; set it before any JAX computation (in a notebook: restart the runtime "
                "and run the experiment first), or leave it unset"
            ) from None
    return len(jax.devices("cpu"))


def for_rounds(count: int | None, backend: str) -> tuple[jax.Device, ...] | None:
    """The devices a one-at-a-time round deals clients to: the first `count` (default 1) CPU
    devices on a CPU; None (every local device) on an accelerator."""
    if backend != "cpu":
        return None
    return tuple(jax.local_devices(backend="cpu")[: count or 1])
