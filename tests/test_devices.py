"""The devices a one-at-a-time round deals its clients to."""

from __future__ import annotations

import jax

from fedjax_split.sim import devices


def test_rounds_deal_to_the_first_count_cpu_devices() -> None:
    cpus = jax.local_devices(backend="cpu")
    assert devices.for_rounds(None, "cpu") == (cpus[0],)
    assert devices.for_rounds(2, "cpu") == tuple(cpus[:2])
    assert devices.for_rounds(2, "gpu") is None  # every local accelerator
