"""Run checkpoints: exact round trip of mixed-dtype pytrees, keep-last-2, atomicity, bad files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from fedjax_split.errors import UserError
from fedjax_split.run import checkpoint
from fedjax_split.run.checkpoint import MANIFEST, RunCheckpointer


class _State(NamedTuple):
    weights: dict
    count: jnp.ndarray


def _tree(r: int) -> dict:
    """A run-like state whose every leaf depends on the round, with bf16/fp16/int leaves."""
    rng = np.random.default_rng(r)
    return {
        "server": _State(
            weights={
                "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                "h": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
            },
            count=jnp.int32(r),
        ),
        # stacked client local parts: distinct per client
        "local": {"k": jnp.asarray(rng.normal(size=(3, 2, 2)), jnp.float16)},
        "steps": np.arange(4, dtype=np.int64) + r,
    }


def test_round_trip_keeps_values_dtypes_and_structure(tmp_path: Path) -> None:
    ck = RunCheckpointer(tmp_path / "ck")
    assert ck.latest_round() is None
    saved = _tree(7)
    ck.save(7, saved, {"seed": 3, "history": [{"round": 1, "loss": 0.5}]})
    state, meta = RunCheckpointer(tmp_path / "ck").restore(_tree(0))
    assert meta == {"seed": 3, "history": [{"round": 1, "loss": 0.5}], "round": 7}
    assert isinstance(state["server"], _State)
    assert state["server"].weights["h"].dtype == jnp.bfloat16
    assert state["local"]["k"].dtype == jnp.float16
    assert state["server"].count.dtype == jnp.int32 and int(state["server"].count) == 7
    assert state["steps"].dtype == np.int64
    for a, b in zip(
        [saved["server"].weights["w"], saved["server"].weights["h"], saved["local"]["k"]],
        [state["server"].weights["w"], state["server"].weights["h"], state["local"]["k"]],
        strict=True,
    ):
        # compare bit patterns: exactness, not closeness
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(state["steps"], np.arange(4) + 7)
    assert np.asarray(state["server"].weights["h"]).dtype == ml_dtypes.bfloat16


def test_keeps_last_two_and_restores_a_given_round(tmp_path: Path) -> None:
    ck = RunCheckpointer(tmp_path)
    for r in (1, 2, 3):
        ck.save(r, _tree(r), {})
    assert ck.all_rounds() == [2, 3]
    assert ck.latest_round() == 3
    state, meta = ck.restore(_tree(0), round_=2)
    assert meta["round"] == 2 and int(state["server"].count) == 2


def test_failed_save_leaves_previous_checkpoint_latest_and_readable(tmp_path: Path) -> None:
    ck = RunCheckpointer(tmp_path)
    ck.save(1, _tree(1), {"ok": True})
    with pytest.raises(TypeError):  # JSON cannot hold an object: the save dies half-way
        ck.save(2, _tree(2), {"bad": object()})
    ck = RunCheckpointer(tmp_path)
    assert ck.latest_round() == 1
    state, meta = ck.restore(_tree(0))
    assert meta["ok"] is True and int(state["server"].count) == 1


_SAVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from fedjax_split.run.checkpoint import MANIFEST, RunCheckpointer
    ck = RunCheckpointer(sys.argv[1])
    r = 0
    while True:
        r += 1
        state = {"x": np.full((1 << 20,), r, np.float32), "r": np.asarray(r, np.int64)}
        ck.save(r, state, {"r": r})
        print(r, flush=True)
    """
)


def test_process_killed_mid_save_leaves_a_readable_latest(tmp_path: Path) -> None:
    """SIGKILL a process that saves 4 MB checkpoints back to back, at several moments."""
    for delay in (0.0, 0.05, 0.13):
        d = tmp_path / f"ck{delay}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(d)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # one save completed
        assert first.strip() == "1"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ck = RunCheckpointer(d)
        latest = ck.latest_round()
        assert latest is not None and latest >= 1
        state, meta = ck.restore(
            {"x": np.zeros((1 << 20,), np.float32), "r": np.asarray(0, np.int64)}
        )
        assert meta["r"] == latest and int(state["r"]) == latest
        assert np.all(np.asarray(state["x"]) == latest)


@pytest.mark.parametrize("manifest", ["kept", "missing", "damaged"])
def test_corrupt_checkpoint_is_a_one_line_user_error(tmp_path: Path, manifest: str) -> None:
    """With its manifest (every step written now) a changed file is named before orbax reads;
    a step from before the manifest, or whose manifest is damaged itself, fails in orbax's read,
    one line too."""
    ck = RunCheckpointer(tmp_path)
    ck.save(1, _tree(1), {})
    listed = json.loads((tmp_path / "1" / MANIFEST).read_text())["files"]
    assert any(name.startswith("state/") for name in listed)
    if manifest == "missing":
        (tmp_path / "1" / MANIFEST).unlink()
    elif manifest == "damaged":
        (tmp_path / "1" / MANIFEST).write_text('{"files": {"state/x": [1]')
    for f in sorted((tmp_path / "1" / "state").rglob("*")):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(UserError) as err:
        RunCheckpointer(tmp_path).restore(_tree(0))
    assert "\n" not in str(err.value)
    if manifest == "kept":
        assert "is damaged (state/" in str(err.value)
        assert "is missing or not the file it wrote" in str(err.value)
    else:
        assert "is unreadable (" in str(err.value)


def test_a_checkpoint_with_its_files_intact_restores_and_names_its_rounds(tmp_path: Path) -> None:
    ck = RunCheckpointer(tmp_path)
    ck.save(1, _tree(1), {})
    ck.save(2, _tree(2), {})
    (tmp_path / "2" / MANIFEST).write_text('{"files": {"state/x": [1]}}')  # unreadable: unused
    state, meta = RunCheckpointer(tmp_path).restore(_tree(0), 1)
    assert meta["round"] == 1
    assert RunCheckpointer(tmp_path).restore(_tree(0), 2)[1]["round"] == 2
    with pytest.raises(UserError, match=r"of round 7 in .* \(it has round\(s\) 1, 2\)$"):
        RunCheckpointer(tmp_path).restore(_tree(0), 7)


def test_mismatched_target_is_a_user_error(tmp_path: Path) -> None:
    ck = RunCheckpointer(tmp_path)
    ck.save(1, {"a": np.zeros((3,), np.float32)}, {})
    with pytest.raises(UserError):
        ck.restore({"a": np.zeros((4,), np.float32)})


def test_no_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no complete checkpoint"):
        RunCheckpointer(tmp_path / "none").restore({"a": np.zeros(1)})


def _frozen(value: float) -> dict:
    return {"emb": {"w": jnp.full((64, 8), value, jnp.float32)}, "ln": {"b": jnp.ones(8)}}


def test_per_run_arrays_are_written_once_and_restored_as_if_each_step_held_them(
    tmp_path: Path,
) -> None:
    """`per_run` keys: one file for the run (none in the steps), restored with the state's
    structure and types bit for bit, by `restore_untyped` too; a file no kept step names goes."""
    import jax

    ck = RunCheckpointer(tmp_path)
    for r in (1, 2, 3):
        ck.save(r, {**_tree(r), "frozen": _frozen(0.5)}, {}, per_run=("frozen",))
    [one] = list((tmp_path / "per_run").iterdir())
    assert one.name.startswith("frozen-")
    state, meta = RunCheckpointer(tmp_path).restore({**_tree(0), "frozen": _frozen(0.0)}, 2)
    assert int(state["server"].count) == 2 and isinstance(state["frozen"]["emb"]["w"], jax.Array)
    np.testing.assert_array_equal(np.asarray(state["frozen"]["emb"]["w"]), 0.5)
    untyped, _ = RunCheckpointer(tmp_path).restore_untyped()
    np.testing.assert_array_equal(untyped["frozen"]["ln"]["b"], 1.0)
    ck.save(4, {**_tree(4), "frozen": _frozen(0.25)}, {}, per_run=("frozen",))  # 3 still names 0.5
    assert len(list((tmp_path / "per_run").iterdir())) == 2
    ck.save(5, {**_tree(5), "frozen": _frozen(0.25)}, {}, per_run=("frozen",))
    [left] = list((tmp_path / "per_run").iterdir())  # steps 4 and 5 name the same file
    assert left.name != one.name


def test_a_step_without_the_per_run_arrays_is_smaller_by_their_bytes(tmp_path: Path) -> None:
    """What the per-run file saves: a step that holds the frozen arrays costs their bytes."""
    size = {}
    frozen = {"emb": {"w": np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)}}
    for name, per_run in (("each", ()), ("once", ("frozen",))):
        ck = RunCheckpointer(tmp_path / name)
        ck.save(1, {"w": np.zeros(4, np.float32), "frozen": frozen}, {}, per_run=per_run)
        size[name] = sum(f.stat().st_size for f in (tmp_path / name / "1").rglob("*")
                         if f.is_file())  # fmt: skip
    assert size["each"] - size["once"] >= 0.75 * 64 * 64 * 4  # compressed: random floats, little


def test_a_changed_or_missing_per_run_file_is_a_one_line_error(tmp_path: Path) -> None:
    from fedjax_split.sim.client_store import save_tree

    ck = RunCheckpointer(tmp_path)
    ck.save(1, {"a": np.zeros(3, np.float32), "frozen": _frozen(1.0)}, {}, per_run=("frozen",))
    [path] = list((tmp_path / "per_run").iterdir())
    save_tree(path, {"emb": {"w": np.full((64, 8), 1.0, np.float32)}, "ln": {"b": np.zeros(8)}})
    target = {"a": np.zeros(3, np.float32), "frozen": _frozen(0.0)}
    for restore in (lambda: RunCheckpointer(tmp_path).restore(target),
                    lambda: RunCheckpointer(tmp_path).restore_untyped()):  # fmt: skip
        with pytest.raises(UserError, match="sha256 differs") as err:
            restore()
        assert "\n" not in str(err.value) and path.name in str(err.value)
    path.unlink()
    with pytest.raises(UserError, match="missing or unreadable"):
        RunCheckpointer(tmp_path).restore(target)


def _server_state(wire: str) -> Any:
    """A server state one FedAdam step past its start, as training leaves it: an fp32 master with
    values no 16-bit dtype holds exactly, its wire image, an integer leaf, Adam's moments."""
    import jax

    from fedjax_split.fed.server import init_server_state, server_update

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(64,)), jnp.float32), "n": jnp.int32(5)}  # fmt: skip
    opt = optax.adam(1e-2)
    state = init_server_state(params, opt, wire)
    mean = jax.tree.map(lambda x: x.astype(jnp.float32) + 0.1 if x.dtype != jnp.int32 else x,
                        state.global_params)  # fmt: skip
    return server_update(state, mean, opt, wire)


def _saved_arrays(step: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of the arrays orbax wrote in a step, from its own metadata."""
    import jax
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().metadata(step / "state").item_metadata.tree
    return {m.name: (tuple(m.shape), np.dtype(m.dtype).name) for m in jax.tree.leaves(tree)}


def _assert_same(got: Any, want: Any) -> None:
    import jax

    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_a_server_state_is_stored_without_its_wire_copy_and_rebuilt_bit_for_bit(
    tmp_path: Path, wire: str
) -> None:
    """The step holds the master, not `global_params` (its wire image: the same numbers twice
    with an fp32 wire); restored, typed or not, the wire copy is the saved one, dtype for dtype,
    and equals the master cast to the wire dtype by numpy."""
    import jax

    from fedjax_split.fed.server import ServerState

    saved = _server_state(wire)
    ck = RunCheckpointer(tmp_path)
    ck.save(1, {"server_state": saved, "x": jnp.ones(3)}, {})
    names = _saved_arrays(tmp_path / "1")
    assert not [n for n in names if "global_params" in n]
    assert names["server_state.master.w"] == ((64, 64), "float32")
    # what the step holds: the master, Adam's two moments and count, the round, x; no more
    held = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in names.values())
    floats = (64 * 64 + 64) * 4  # w and b in fp32
    assert held == 3 * floats + 3 * 4 + 4 + 4 + 3 * 4  # n thrice; Adam's count; round; x
    target = {"server_state": jax.tree.map(jnp.zeros_like, saved), "x": jnp.zeros(3)}
    state, _ = RunCheckpointer(tmp_path).restore(target)
    assert isinstance(state["server_state"], ServerState)
    _assert_same(state["server_state"], saved)
    by_numpy = {k: np.asarray(v).astype(wire) if k != "n" else np.asarray(v)
                for k, v in saved.master.items()}  # fmt: skip
    _assert_same(state["server_state"].global_params, by_numpy)
    # its own buffers: a donating round (as the simulation's) may donate the whole state
    jax.block_until_ready(jax.jit(lambda s: s, donate_argnums=0)(state["server_state"]))
    untyped, _ = RunCheckpointer(tmp_path).restore_untyped()
    _assert_same(untyped["server_state"]["global_params"], saved.global_params)
    _assert_same(untyped["server_state"]["master"], saved.master)


def test_a_checkpoint_with_the_wire_copy_still_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step written before server states were stored without their wire copy (the same orbax
    save of the whole state: `_without_wire` undone) restores as it was, typed and untyped, and
    a later step beside it is written in the new layout."""
    import jax

    from fedjax_split.run import checkpoint

    saved = {"server_state": _server_state("float16"), "frozen": _frozen(0.5)}
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_without_wire", lambda state: (state, {}))
        RunCheckpointer(tmp_path).save(1, saved, {"seed": 1}, per_run=("frozen",))
    assert "server_state.global_params.w" in _saved_arrays(tmp_path / "1")
    target = jax.tree.map(jnp.zeros_like, saved)
    state, meta = RunCheckpointer(tmp_path).restore(target)
    assert meta["seed"] == 1 and checkpoint.REBUILT not in meta
    _assert_same(state, saved)
    untyped, _ = RunCheckpointer(tmp_path).restore_untyped()
    _assert_same(untyped["server_state"]["global_params"], saved["server_state"].global_params)
    RunCheckpointer(tmp_path).save(2, state, {"seed": 1}, per_run=("frozen",))
    assert "server_state.global_params.w" not in _saved_arrays(tmp_path / "2")
    _assert_same(RunCheckpointer(tmp_path).restore(target)[0], saved)


def test_a_wire_copy_that_is_not_the_masters_image_is_stored_whole(tmp_path: Path) -> None:
    """Only a copy the master rebuilds bit for bit is left out: another is saved and restored."""
    import jax

    state = _server_state("float16")
    odd = state._replace(global_params={**state.global_params,
                                        "b": state.global_params["b"] + 1})  # fmt: skip
    RunCheckpointer(tmp_path).save(1, {"server_state": odd}, {})
    assert "server_state.global_params.b" in _saved_arrays(tmp_path / "1")
    got, _ = RunCheckpointer(tmp_path).restore({"server_state": jax.tree.map(jnp.zeros_like, odd)})
    _assert_same(got["server_state"], odd)


def test_the_manifest_hash_reads_a_large_file_in_chunks_and_matches_sha256(tmp_path: Path) -> None:
    """The manifest's digest of a file larger than one read (1 MiB) is the file's sha256, without
    hashlib.file_digest (Python 3.11+; the package supports 3.10)."""
    data = np.random.default_rng(0).bytes(3 * 2**20 + 123)
    f = tmp_path / "d"
    f.write_bytes(data)
    assert checkpoint._sha256(f) == hashlib.sha256(data).hexdigest()
