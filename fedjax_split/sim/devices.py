"""The devices a round deals clients trained one at a time to (`sim.round_spec.RoundSpec.devices`).

How many CPU devices JAX shows is a process setting (`fedjax_split.runtime.use_cpu_devices`,
`--cpu-devices`): each device runs its own stream of client steps, and each program compiles
once per device. With several processes (`sim.processes`) the list spans them all, each
process's devices after the previous process's, so that client i of a round goes to the same
place in the list whatever the processes.
"""

from __future__ import annotations

import jax


def for_rounds(count: int | None, backend: str) -> tuple[jax.Device, ...] | None:
    """The devices a one-at-a-time round deals clients to: the first `count` (default 1) CPU
    devices of each process on a CPU; on an accelerator every device (None in one process:
    every local device)."""
    if backend != "cpu":
        return None if jax.process_count() == 1 else tuple(jax.devices())
    every = jax.devices("cpu")
    return tuple(
        d
        for p in range(jax.process_count())
        for d in [d for d in every if d.process_index == p][: count or 1]
    )
