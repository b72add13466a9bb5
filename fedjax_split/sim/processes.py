"""One simulation over several JAX processes: who trains which client, and what they exchange.

A round's sampled clients are dealt over every device of every process (client i of the round to
device i % D of `devices.for_rounds`' list, the processes' devices in process order), as one
process deals them over its own devices. Each process trains its clients one at a time
(`sim.rounds`), then the processes exchange what a server would receive: every client's upload
and figures, gathered in client order (`gather_clients`), never a local part. Every process then
runs the same aggregation on the same inputs in the same order, so each holds the same server
state, equal bit for bit to a one-process run's. Process 0 writes the run directory; each process
writes the local parts of the clients it trained into the run's client store, which is why the
run directory must be on a filesystem every process sees.

Exchanges go through JAX's own collectives (`jax.experimental.multihost_utils`: gloo on CPUs,
NCCL on GPUs); with one process every function here is the identity or does nothing.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def count() -> int:
    """Processes in this simulation (1 without JAX's distributed runtime)."""
    return jax.process_count()


def index() -> int:
    """This process's index; 0 writes the run directory."""
    return jax.process_index()


def writes() -> bool:
    """Whether this process writes the run's files (config, metrics, checkpoints, summary)."""
    return index() == 0


def barrier(name: str) -> None:
    """Waits until every process has reached `name` (e.g. every client's part is on disk)."""
    if count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def owners(devices: Sequence[Any], num_clients: int) -> list[int]:
    """The process that trains each of a round's `num_clients` clients: that of device i % D."""
    return [devices[i % len(devices)].process_index for i in range(num_clients)]


def _allgather(tree: Any) -> Any:
    """Every process's `tree` (same structure and shapes everywhere), stacked [P, ...] on host."""
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=False)


def gather_clients(own: dict[int, Any], owner: Sequence[int], like: Any = None) -> list[Any]:
    """Every client's tree in client order, each process giving those it trained (`own`:
    position -> tree, the positions whose `owner` is this process). Trees are padded to the
    largest process's count with zeros (never read) and come back as host arrays. `like`: the
    trees' shapes and dtypes (`jax.ShapeDtypeStruct`s), needed by a process that trained none."""
    if count() == 1:
        return [own[i] for i in range(len(owner))]
    me = index()
    slots = max(owner.count(p) for p in range(count()))
    mine = [own[i] for i, p in enumerate(owner) if p == me]
    if not mine and like is None:
        raise ValueError(f"process {me} trained none of the round's clients; pass `like`")
    zeros = lambda x: np.zeros(np.shape(x), x.dtype)  # noqa: E731
    template = jax.tree.map(zeros, mine[0] if mine else like)
    padded = mine + [template] * (slots - len(mine))
    stacked = jax.tree.map(lambda *x: np.stack([np.asarray(v) for v in x]), *padded)
    gathered = _allgather(stacked)  # [P, slots, ...]
    seen = [0] * count()
    out = []
    for p in owner:
        out.append(jax.tree.map(lambda x, p=p, k=seen[p]: x[p, k], gathered))
        seen[p] += 1
    return out


def gather_bytes(data: bytes) -> list[bytes]:
    """Every process's bytes, in process order."""
    if count() == 1:
        return [data]
    sizes = _allgather(np.asarray([len(data)], np.int32))[:, 0]
    buffer = np.zeros(int(sizes.max()), np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    rows = _allgather(buffer)
    return [rows[p, : int(n)].tobytes() for p, n in enumerate(sizes)]


def gather_json(value: Any) -> list[Any]:
    """Every process's JSON value, in process order (floats keep their bits: JSON's repr of a
    Python float is exact)."""
    return [json.loads(b) for b in gather_bytes(json.dumps(value).encode())]


def gather_arrays(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every process's named host arrays (any shapes), in process order; no pickles."""

    def pack(x: dict[str, np.ndarray]) -> bytes:
        f = io.BytesIO()
        np.savez(f, **x)
        return f.getvalue()

    def unpack(b: bytes) -> dict[str, np.ndarray]:
        with np.load(io.BytesIO(b), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    return [unpack(b) for b in gather_bytes(pack(arrays))]
