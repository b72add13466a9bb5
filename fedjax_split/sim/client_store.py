"""Every client's local (personal) part on disk, so that memory holds only the sampled clients'.

Why: in FedNLP's cross-device regime hundreds to thousands of clients each keep a local part, and a
few are sampled per round; holding them all stacked in memory grows with the number of clients
(docs/benchmarks.md measures it). Here a client's part is a file written when the client trains,
and read when it is sampled or evaluated; a client that never trained has the shared initial part.

Layout under the store's directory: `initial.npz` (the part every client starts from) and
`client_<id>/round_<r>.npz`, one file per round the client trained in, each written atomically
(a temporary name, then a rename), so a process killed mid-write leaves the previous version.
Versions make exact resumption cheap: a checkpoint of round r needs no copy of the clients,
`load(i, at_most=r)` gives client i's part as it was after round r, `rewind(r)` drops what a run
killed after its last checkpoint wrote later, and `prune(r0)` deletes only versions no kept
checkpoint (the oldest kept being round r0) can need.

Arrays keep their dtype, bfloat16 included (numpy's npz format cannot name it: such arrays are
stored as their bits with the dtype's name beside them).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from fedjax_split import atomic
from fedjax_split.fed.roles import flatten_paths, unflatten_paths

_ROUND_FILE = re.compile(r"^round_(\d+)\.npz$")
_CLIENT_DIR = re.compile(r"^client_(\d+)$")
_DTYPES = "__dtypes__"  # entry of the npz naming each array's dtype


def save_tree(path: Path, tree: Any) -> None:
    """Writes a nested dict of arrays atomically, every dtype kept (bf16 as its bits)."""
    flat = {p: np.asarray(x) for p, x in flatten_paths(tree).items()}
    arrays, dtypes = {}, []
    for p, x in flat.items():
        dtypes.append(f"{p}={x.dtype.name}")
        # numpy's own dtypes as they are; user-defined ones (ml_dtypes' bfloat16) as their bits
        arrays[p] = x if x.dtype.isbuiltin == 1 else x.view(f"u{x.itemsize}")
    arrays[_DTYPES] = np.asarray(dtypes)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.atomic_write(path, lambda f: np.savez(f, **arrays))


def tree_digest(tree: Any) -> str:
    """sha256 of a nested dict of arrays: every leaf's path, dtype, shape and bytes. It names the
    content, not a file's bytes (an npz's zip entries carry their write time), so that a copy
    written once and read back later can be checked against it."""
    h = hashlib.sha256()
    for p, x in sorted(flatten_paths(tree).items()):
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{p}|{a.dtype.name}|{a.shape}\n".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def load_tree(path: Path) -> Any:
    """Inverse of `save_tree`."""
    with np.load(path) as z:
        dtypes = dict(entry.split("=", 1) for entry in z[_DTYPES].tolist())
        flat = {}
        for p, name in dtypes.items():
            x = np.array(z[p])
            flat[p] = x if x.dtype.name == name else x.view(np.dtype(getattr(ml_dtypes, name)))
    return unflatten_paths(flat)


class ClientStore:
    """Clients' local parts under `directory` (see the module docstring). `initial`: the part a
    client that never trained has, when it is not to be read from `initial.npz` (a federated
    node rebuilds it from the checkpoint it starts from). `newest`: client -> the round of its
    newest part, when the caller knows it (a simulation does, from its sampled clients): `load`
    then opens that file by name instead of listing the client's directory, which a host of a
    multi-process run on a shared filesystem (NFS) may see stale (`trained` keeps it current)."""

    def __init__(
        self, directory: str | Path, initial: Any = None, newest: dict[int, int] | None = None
    ) -> None:
        self.directory = Path(directory)
        self._initial: Any = initial
        self._newest = None if newest is None else dict(newest)

    @classmethod
    def create(cls, directory: str | Path, initial: Any) -> ClientStore:
        """A fresh store: whatever an earlier attempt at the run left there (never a checkpointed
        run: the caller checks) is removed, and the initial part written."""
        store = cls(directory)
        if store.directory.exists():
            shutil.rmtree(store.directory)
        save_tree(store.directory / "initial.npz", initial)
        store._initial = initial
        return store

    @property
    def initial(self) -> Any:
        if self._initial is None:
            self._initial = load_tree(self.directory / "initial.npz")
        return self._initial

    def _client_dir(self, client: int) -> Path:
        return self.directory / f"client_{int(client)}"

    def path(self, client: int, round_: int) -> Path:
        """The file of `client`'s part written in round `round_`."""
        return self._client_dir(client) / f"round_{int(round_)}.npz"

    def rounds(self, client: int) -> list[int]:
        """Rounds in which `client`'s part was written, oldest first."""
        d = self._client_dir(client)
        if not d.is_dir():
            return []
        found = (_ROUND_FILE.match(p.name) for p in d.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def clients(self) -> list[int]:
        """Clients with at least one version on disk."""
        if not self.directory.is_dir():
            return []
        found = (_CLIENT_DIR.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def version(self, client: int, at_most: int | None = None) -> int | None:
        """The round of `client`'s newest part written by round `at_most` (None: never trained)."""
        if at_most is None and self._newest is not None:
            return self._newest.get(int(client))
        rounds = [r for r in self.rounds(client) if at_most is None or r <= at_most]
        return rounds[-1] if rounds else None

    def load(self, client: int, at_most: int | None = None) -> Any:
        """`client`'s local part as it was after round `at_most` (default: its newest)."""
        r = self.version(client, at_most)
        if r is None:
            return self.initial
        return load_tree(self.path(client, r))

    def load_stacked(self, clients: Sequence[int], at_most: int | None = None) -> Any:
        """The parts of `clients`, stacked on a leading axis (what a round trains)."""
        import jax

        parts = [self.load(c, at_most) for c in clients]
        return jax.tree.map(lambda *x: np.stack(x), *parts)

    def save(self, round_: int, clients: Iterable[int], stacked: Any) -> None:
        """Writes each client's new part (row k of `stacked` for the k-th client) as round_'s."""
        import jax

        host = jax.tree.map(np.asarray, stacked)
        for k, c in enumerate(clients):
            self.save_one(round_, c, jax.tree.map(lambda x, k=k: x[k], host))

    def save_one(self, round_: int, client: int, part: Any) -> None:
        """Writes one client's new part as round_'s."""
        save_tree(self.path(client, round_), part)
        self.trained(round_, [client])

    def trained(self, round_: int, clients: Iterable[int]) -> None:
        """Notes that `clients` wrote their part of `round_` (here or in another process), for
        `load` to open by name when the store knows its clients' newest rounds."""
        if self._newest is not None:
            self._newest.update({int(c): int(round_) for c in clients})

    def rewind(self, round_: int) -> None:
        """Deletes versions written after round `round_` (a resumed run redoes those rounds)."""
        for c in self.clients():
            for r in self.rounds(c):
                if r > round_:
                    (self._client_dir(c) / f"round_{r}.npz").unlink(missing_ok=True)

    def prune(self, keep_from: int) -> None:
        """Deletes versions that no checkpoint of a round >= `keep_from` can need: for each client,
        those older than its newest version written by round `keep_from`."""
        for c in self.clients():
            base = self.version(c, keep_from)
            if base is None:
                continue
            for r in self.rounds(c):
                if r < base:
                    (self._client_dir(c) / f"round_{r}.npz").unlink(missing_ok=True)

    def nbytes(self) -> int:
        """Bytes of everything on disk."""
        if not self.directory.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.directory.rglob("*.npz"))
