"""Orbax checkpoints of a whole run: arrays (server state, every client's local part) + JSON meta.

A checkpoint is one orbax step directory `<run_dir>/checkpoints/<round>/` holding two items:
`state` (any pytree of arrays; dtypes such as bf16/fp16 and integer leaves survive) and `meta` (a
JSON object: round, seed, partition, metrics so far, ...). Saving is synchronous and atomic: orbax
writes into a temporary directory and renames it when complete, and `latest_round` only ever sees
complete steps, so a process killed mid-save leaves the previous checkpoint as the latest one.

Arrays that never change during a run (the frozen part: LoRA's base weights, the layers FedBT
never trains) are stored once per run, not in every checkpoint: `save(..., per_run=("frozen",))`
writes them to `<run_dir>/checkpoints/per_run/<name>-<digest>.npz` (before the step, so a step
never names a missing file) and the step's meta records their sha256 (`PER_RUN`). A restore reads
them back, checks the digest (a changed or damaged file is a one-line error) and returns them in
the state as if the step held them. A per-run file that no kept step names is deleted.

A server state (`fed.server.ServerState`) is stored without its wire copy: `global_params` is
always `cast_to_wire(master, wire dtype)` (`init_server_state`, `server_update`), so the step holds
the fp32 master only, its meta records the wire dtype (`REBUILT`), and a restore rebuilds the copy
bit for bit (with an fp32 wire the two were the same numbers twice). A state whose copy is not its
master's image is stored whole, and a step written before (with `global_params`) restores as is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from fedjax_split.atomic import write_text
from fedjax_split.errors import UserError
from fedjax_split.fed.server import ServerState
from fedjax_split.fed.wire import WIRE_DTYPES, cast_to_wire
from fedjax_split.sim.client_store import load_tree, save_tree, tree_digest

logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every step at INFO/WARNING

MANIFEST = "fedjax_split_files.json"  # in each step directory: its files' sha256
PER_RUN = "per_run"  # the meta's {name: sha256} of the arrays stored once per run; their dir
REBUILT = "wire_from_master"  # the meta's {key: wire dtype} of server states saved without
# their wire copy (`global_params`), which a restore rebuilds from the master
_PER_RUN_FILE = re.compile(r"^(\w+)-([0-9a-f]{16})\.npz$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


class RunCheckpointer:
    """Save/restore run checkpoints under `directory`, keeping the last `max_to_keep`."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2) -> None:
        self.directory = Path(directory).absolute()
        # This process alone (process 0 of a multi-process simulation writes, and every process
        # may read): orbax's default would wait for every process at each call.
        me = jax.process_index() if jax.distributed.is_initialized() else 0
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=False, create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}
            ),
        )  # fmt: skip
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # noqa: BLE001 - an unreadable directory is the user's to fix
            raise UserError(f"checkpoint dir {str(self.directory)!r} is unreadable ({e})") from None
        self._checked: set[str] = set()  # digests of per-run files this process wrote or read

    def latest_round(self) -> int | None:
        """The newest complete checkpoint's round, or None when there is none."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_rounds(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(
        self, round_: int, state: Any, meta: dict[str, Any], per_run: Collection[str] = ()
    ) -> Path:
        """Write checkpoint `round_` (blocking until complete and renamed into place). `per_run`:
        keys of `state` (a dict) whose arrays never change during the run, stored once."""
        self.directory.mkdir(parents=True, exist_ok=True)
        refs = {k: self._save_per_run(k, state[k]) for k in per_run if k in state}
        if refs:
            state = {k: v for k, v in state.items() if k not in refs}
            meta = {**meta, PER_RUN: refs}
        state, rebuilt = _without_wire(state)
        if rebuilt:
            meta = {**meta, REBUILT: rebuilt}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_host_local(state)),
            meta=ocp.args.JsonSave(dict(meta, round=round_)),
        )
        self._manager.save(round_, args=args, force=True)
        self._manager.wait_until_finished()
        _write_manifest(self.directory / str(round_))
        self._prune_per_run()
        return self.directory / str(round_)

    def _per_run_path(self, name: str, digest: str) -> Path:
        return self.directory / PER_RUN / f"{name}-{digest[:16]}.npz"

    def _save_per_run(self, name: str, tree: Any) -> str:
        """Writes `tree` once (kept while its content is the same); its digest."""
        digest = tree_digest(tree)
        path = self._per_run_path(name, digest)
        if digest not in self._checked or not path.is_file():
            if not (path.is_file() and _digest_of_file(path) == digest):
                save_tree(path, tree)  # atomic: a reader sees the whole file or none
            self._checked.add(digest)
        return digest

    def _prune_per_run(self) -> None:
        """Deletes the per-run files that no kept checkpoint names."""
        where = self.directory / PER_RUN
        if not where.is_dir():
            return
        named = set()
        for step in self.all_rounds():
            try:
                meta = self._read(step, self.directory / str(step), meta=ocp.args.JsonRestore())
            except UserError:  # an unreadable step: keep every file rather than guess
                return
            refs = meta.meta.get(PER_RUN, {}) if isinstance(meta.meta, dict) else {}
            named.update(self._per_run_path(k, d).name for k, d in refs.items())
        for f in where.iterdir():
            if _PER_RUN_FILE.match(f.name) and f.name not in named:
                f.unlink(missing_ok=True)

    def restore_untyped(self, round_: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore without a target: nested dicts of arrays as saved (NamedTuples become dicts).

        For tools (export) that need the arrays but not the exact Python structure.
        """
        return self._restore(None, round_)

    def restore(self, target: Any, round_: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore checkpoint `round_` (default: latest) into the structure/dtypes of `target`.

        `target` is a pytree like the saved state (e.g. freshly initialised); a checkpoint that is
        missing, corrupt or shaped differently raises a one-line UserError.
        """
        state, meta = self._restore(target, round_)
        _check_like(state, target, self.directory / str(meta["round"]))
        # JAX arrays where the target has them: the per-run arrays are read as numpy, and with
        # several processes orbax restores numpy arrays too
        return jax.tree.map(
            lambda x, t: jax.numpy.asarray(x) if isinstance(t, jax.Array) else x, state, target
        ), meta

    def _restore(self, target: Any, round_: int | None) -> tuple[Any, dict[str, Any]]:
        """The step's state (into `target`'s structure; None: as saved) with its per-run arrays,
        and its meta."""
        step = self.latest_round() if round_ is None else round_
        where = self.directory / str(step)
        if step is None:
            raise UserError(
                f"no complete checkpoint in {str(self.directory)!r}; run without --resume"
            )
        if step not in self.all_rounds():
            kept = ", ".join(map(str, self.all_rounds()))
            raise UserError(f"no checkpoint of round {step} in {str(self.directory)!r} (it has "
                            f"round(s) {kept})")  # fmt: skip
        _check_manifest(where)
        meta = self._read(step, where, meta=ocp.args.JsonRestore()).meta
        if not isinstance(meta, dict) or meta.get("round") != step:
            raise UserError(
                f"checkpoint {str(where)!r} has bad metadata; delete it or start afresh"
            )
        refs, rebuilt = meta.get(PER_RUN, {}), meta.get(REBUILT, {})
        if target is None:
            state_args = ocp.args.StandardRestore()
        else:
            like = {k: v for k, v in target.items() if k not in refs} if refs else target
            if rebuilt:
                like = {k: _stored(v) if k in rebuilt and isinstance(v, ServerState) else v
                        for k, v in like.items()}  # fmt: skip
            state_args = ocp.args.StandardRestore(_host_local(like))
        state = self._read(step, where, state=state_args).state
        if rebuilt:
            state = {k: _rebuilt(v, rebuilt[k], typed=target is not None) if k in rebuilt else v
                     for k, v in state.items()}  # fmt: skip
        if refs:
            state = {**state, **{k: self._load_per_run(k, d, where) for k, d in refs.items()}}
        return state, meta

    def _read(self, step: int, where: Path, **items: Any) -> Any:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types on bad files
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"checkpoint {str(where)!r} is unreadable ({reason}); delete that directory to use "
                "an earlier checkpoint, or start a fresh run"
            ) from None

    def _load_per_run(self, name: str, digest: str, where: Path) -> Any:
        """The per-run arrays `name` a step names, checked against its digest."""
        path = self._per_run_path(name, digest)
        try:
            tree = load_tree(path)
        except (OSError, ValueError, KeyError):
            tree = None
        if tree is None or tree_digest(tree) != digest:
            raise UserError(
                f"checkpoint {str(where)!r} needs {str(path)!r}, which is "
                f"{'missing or unreadable' if tree is None else 'not the file it wrote'} "
                "(its arrays' sha256 differs); restore that file, or start a fresh run"
            )
        self._checked.add(digest)
        return tree

    def close(self) -> None:
        self._manager.close()


def _without_wire(state: Any) -> tuple[Any, dict[str, str]]:
    """`state` (a dict) with each server state whose wire copy is its master's image stored as
    `_stored` has it, and {key: wire dtype} of those; other states are kept whole."""
    if not isinstance(state, dict):
        return state, {}
    rebuilt = {k: d for k, v in state.items()
               if isinstance(v, ServerState) and (d := _wire_of(v)) is not None}  # fmt: skip
    return {k: _stored(v) if k in rebuilt else v for k, v in state.items()}, rebuilt


def _stored(state: ServerState) -> dict[str, Any]:
    """What a checkpoint holds of a server state: every field but the wire copy."""
    return {f: getattr(state, f) for f in ServerState._fields if f != "global_params"}


def _wire_of(state: ServerState) -> str | None:
    """The wire dtype whose image of the master is `state.global_params` bit for bit, or None."""
    dtypes = {
        np.dtype(x.dtype).name
        for x in jax.tree.leaves(state.global_params)
        if jnp.issubdtype(x.dtype, jnp.floating)  # bfloat16 too (numpy's floating omits it)
    }
    name = dtypes.pop() if len(dtypes) == 1 else "float32" if not dtypes else None
    if name not in WIRE_DTYPES:  # several floating dtypes, or one no wire has
        return None
    image, held = cast_to_wire(state.master, name), state.global_params
    if jax.tree.structure(image) != jax.tree.structure(held):
        return None
    pairs = zip(jax.tree.leaves(image), jax.tree.leaves(held), strict=True)
    return name if all(_same_bits(a, b) for a, b in pairs) else None


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


def _rebuilt(stored: Any, dtype: str, *, typed: bool) -> Any:
    """A server state from what a step holds of it (`_stored`): the wire copy cast from the
    master; a ServerState when restored into a target, else a dict like the old layout's. Its own
    buffers: an fp32 cast would alias the master, which a donating round would donate twice."""
    wire = jax.tree.map(lambda x: jnp.array(x, copy=True), cast_to_wire(stored["master"], dtype))
    if typed:
        return ServerState(global_params=wire, **stored)
    return {"global_params": wire, **stored}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:  # in chunks: a step's data file may hold gigabytes
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(step_dir: Path) -> dict[str, tuple[int, str]]:
    """Each file of a checkpoint step (but the manifest): (size, sha256)."""
    return {
        str(f.relative_to(step_dir)): (f.stat().st_size, _sha256(f))
        for f in sorted(step_dir.rglob("*")) if f.is_file() and f.name != MANIFEST
    }  # fmt: skip


def _write_manifest(step_dir: Path) -> None:
    """The step's files and their sha256, so that a damaged one is named before orbax reads it
    (tensorstore fails on it mid-read, its other reads calling back into a closed event loop)."""
    write_text(step_dir / MANIFEST, json.dumps({"files": _files(step_dir)}, indent=1))


def _check_manifest(where: Path) -> None:
    """A one-line UserError when a file the step's manifest lists is missing or changed. A step
    written before the manifest existed, or whose manifest itself is unreadable (a crash while
    writing it), is read as is: orbax then decides."""
    try:
        files = json.loads((where / MANIFEST).read_text())["files"]
        listed = {str(k): (int(v[0]), str(v[1])) for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return
    for name, (size, digest) in listed.items():
        path = where / name
        if not path.is_file() or path.stat().st_size != size or _sha256(path) != digest:
            raise UserError(
                f"checkpoint {str(where)!r} is damaged ({name} is missing or not the file it "
                "wrote); delete that directory to use an earlier checkpoint, or start a fresh run"
            )


def _digest_of_file(path: Path) -> str | None:
    try:
        return tree_digest(load_tree(path))
    except (OSError, ValueError, KeyError):
        return None


def _several_processes() -> bool:
    return jax.distributed.is_initialized() and jax.process_count() > 1


def _host_local(tree: Any) -> Any:
    """With several processes, JAX arrays as numpy arrays: orbax refuses an array that lives on
    one process's device in a multi-process job (each process's server state is its own copy)."""
    if not _several_processes():
        return tree
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def _check_like(state: Any, target: Any, where: Path) -> None:
    """A restored tree must have the target's structure, shapes and dtypes."""
    s_leaves, s_def = jax.tree.flatten(state)
    t_leaves, t_def = jax.tree.flatten(target)
    ok = s_def == t_def and all(
        np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
        if not isinstance(b, jax.Array)
        else (a.shape == b.shape and a.dtype == b.dtype)
        for a, b in zip(s_leaves, t_leaves, strict=True)
    )
    if not ok:
        raise UserError(
            f"checkpoint {str(where)!r} does not match this run's model/clients; resume with the "
            "settings it was written with, or use another --output-dir"
        )
