"""How many CPU devices JAX shows: asked for before the backends start, checked after."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from fedjax_split.errors import UserError
from fedjax_split.sim import devices


def test_after_start_the_count_is_kept_or_a_user_error() -> None:
    have = len(jax.devices("cpu"))  # started by now (conftest forces 2)
    assert have == 2
    assert devices.use_cpu_devices(None) == have
    assert devices.use_cpu_devices(have) == have
    assert devices.use_cpu_devices(1) == have  # more than asked for: the first are used
    with pytest.raises(UserError, match="restart the runtime"):
        devices.use_cpu_devices(have + 1)
    with pytest.raises(UserError, match="at least 1"):
        devices.use_cpu_devices(0)
    assert len(jax.devices("cpu")) == have


def test_before_start_the_count_is_applied() -> None:
    """In a fresh process (no XLA_FLAGS), the count asked for is the count JAX starts with."""
    code = (
        "import jax; from fedjax_split.sim.devices import use_cpu_devices as u; "
        "print(u(3), len(jax.devices('cpu')), u(None))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["3", "3", "3"]


def test_rounds_deal_to_the_first_count_cpu_devices() -> None:
    cpus = jax.local_devices(backend="cpu")
    assert devices.for_rounds(None, "cpu") == (cpus[0],)
    assert devices.for_rounds(2, "cpu") == tuple(cpus[:2])
    assert devices.for_rounds(2, "gpu") is None  # every local accelerator
