"""The devices a round deals clients trained one at a time to (`rounds.RoundSpec.devices`).

How many CPU devices JAX shows is a process setting (`fedjax_split.runtime.use_cpu_devices`,
`--cpu-devices`): each device runs its own stream of client steps, and each program compiles
once per device.
"""

from __future__ import annotations

import jax


def for_rounds(count: int | None, backend: str) -> tuple[jax.Device, ...] | None:
    """The devices a one-at-a-time round deals clients to: the first `count` (default 1) CPU
    devices on a CPU; None (every local device) on an accelerator."""
    if backend != "cpu":
        return None
    return tuple(jax.local_devices(backend="cpu")[: count or 1])
