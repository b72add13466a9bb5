"""Orbax checkpoints of a whole run: arrays (server state, every client's local part) + JSON meta.

A checkpoint is one orbax step directory `<run_dir>/checkpoints/<round>/` holding two items:
`state` (any pytree of arrays; dtypes such as bf16/fp16 and integer leaves survive) and `meta` (a
JSON object: round, seed, partition, metrics so far, ...). Saving is synchronous and atomic: orbax
writes into a temporary directory and renames it when complete, and `latest_round` only ever sees
complete steps, so a process killed mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fedjax_split.errors import UserError

logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every step at INFO/WARNING


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

    def latest_round(self) -> int | None:
        """The newest complete checkpoint's round, or None when there is none."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_rounds(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, round_: int, state: Any, meta: dict[str, Any]) -> Path:
        """Write checkpoint `round_` (blocking until complete and renamed into place)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_host_local(state)),
            meta=ocp.args.JsonSave(dict(meta, round=round_)),
        )
        self._manager.save(round_, args=args, force=True)
        self._manager.wait_until_finished()
        return self.directory / str(round_)

    def restore_untyped(self, round_: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore without a target: nested dicts of arrays as saved (NamedTuples become dicts).

        For tools (export) that need the arrays but not the exact Python structure.
        """
        return self._restore(ocp.args.StandardRestore(), round_)

    def restore(self, target: Any, round_: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore checkpoint `round_` (default: latest) into the structure/dtypes of `target`.

        `target` is a pytree like the saved state (e.g. freshly initialised); a checkpoint that is
        missing, corrupt or shaped differently raises a one-line UserError.
        """
        state, meta = self._restore(ocp.args.StandardRestore(_host_local(target)), round_)
        _check_like(state, target, self.directory / str(meta["round"]))
        if _several_processes():  # back to JAX arrays, as one process restores them
            state = jax.tree.map(
                lambda x, t: jax.numpy.asarray(x) if isinstance(t, jax.Array) else x, state, target
            )
        return state, meta

    def _restore(self, state_args: Any, round_: int | None) -> tuple[Any, dict[str, Any]]:
        step = self.latest_round() if round_ is None else round_
        where = self.directory / str(step)
        if step is None:
            raise UserError(
                f"no complete checkpoint in {str(self.directory)!r}; run without --resume"
            )
        if step not in self.all_rounds():
            raise UserError(f"no checkpoint of round {step} in {str(self.directory)!r}")
        args = ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
        try:
            restored = self._manager.restore(step, args=args)
            state, meta = restored.state, restored.meta
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types on bad files
            reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise UserError(
                f"checkpoint {str(where)!r} is unreadable ({reason}); delete it to resume from an "
                "earlier one, or start a fresh run without --resume"
            ) from None
        if not isinstance(meta, dict) or meta.get("round") != step:
            raise UserError(
                f"checkpoint {str(where)!r} has bad metadata; delete it or start afresh"
            )
        return state, meta

    def close(self) -> None:
        self._manager.close()


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
