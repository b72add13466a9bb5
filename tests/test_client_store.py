"""sim.client_store: clients' local parts on disk, versioned by round, dtypes kept; what a
resumed run and a pruned store see."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fedjax_split.sim.client_store import ClientStore, load_tree, save_tree


def _part(value: float) -> dict:
    return {
        "encoder": {"layer_1": {"kernel": np.full((2, 3), value, np.float32)}},
        "classifier": {"bias": np.array([value, -value], np.float32)},
    }


def _stack(*parts: dict) -> dict:
    """Parts stacked on a leading client axis, as a round hands them to the store."""
    import jax

    return jax.tree.map(lambda *x: np.stack(x), *parts)


def _equal(a: dict, b: dict) -> bool:
    from fedjax_split.fed.roles import flatten_paths

    fa, fb = flatten_paths(a), flatten_paths(b)
    return fa.keys() == fb.keys() and all(
        fa[k].dtype == fb[k].dtype and np.array_equal(fa[k], fb[k]) for k in fa
    )


def test_trees_keep_every_dtype_bfloat16_included(tmp_path: Path) -> None:
    tree = {
        "a": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
        "b": np.array([1.5, -2.0, 3.140625], dtype=ml_dtypes.bfloat16),
        "c": np.array([7, -1], np.int32),
        "d": np.array([0.5, 1e-4], np.float16),
    }
    save_tree(tmp_path / "t.npz", tree)
    back = load_tree(tmp_path / "t.npz")
    assert _equal(back, tree)
    assert back["b"].dtype == ml_dtypes.bfloat16  # not raw V2 bytes, not float32
    assert not list(tmp_path.glob("*.tmp"))


def test_versions_by_round_and_the_initial_part_for_clients_never_trained(tmp_path: Path) -> None:
    store = ClientStore.create(tmp_path / "clients", _part(0.0))
    store.save(1, [4, 7], _stack(_part(1.0), _part(2.0)))  # row k: the k-th client named
    store.save(3, [7], _stack(_part(3.0)))
    assert store.clients() == [4, 7] and store.rounds(7) == [1, 3]
    assert _equal(store.load(4), _part(1.0))
    assert _equal(store.load(0), _part(0.0))  # never trained: the initial part
    assert store.version(7, at_most=2) == 1 and store.version(7) == 3
    assert _equal(store.load(7, at_most=2), _part(2.0)) and _equal(store.load(7), _part(3.0))
    both = store.load_stacked([7, 0], at_most=1)
    assert both["classifier"]["bias"].tolist() == [[2.0, -2.0], [0.0, -0.0]]
    # a second handle on the same directory reads the initial part from disk
    assert _equal(ClientStore(tmp_path / "clients").initial, _part(0.0))


def test_a_store_that_knows_its_clients_rounds_opens_by_name_not_by_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = ClientStore.create(tmp_path / "clients", _part(0.0))
    writer.save(1, [4], _stack(_part(1.0)))
    # another process's handle, told of round 1; then client 4 trains again in round 2, written
    # by the first handle while the second one's listing of the directory stays stale (NFS)
    reader = ClientStore(tmp_path / "clients", newest={4: 1})
    writer.save(2, [4, 5], _stack(_part(2.0), _part(5.0)))
    monkeypatch.setattr(ClientStore, "rounds", lambda self, client: [1] if client == 4 else [])
    assert _equal(reader.load(4), _part(1.0))  # not yet told: what it knew
    reader.trained(2, [4, 5])
    assert _equal(reader.load(4), _part(2.0)) and _equal(reader.load(5), _part(5.0))
    assert _equal(reader.load(6), _part(0.0))  # never trained
    assert reader.version(4, at_most=1) == 1  # an earlier round still comes from the listing


def test_rewind_forgets_what_came_after_a_checkpoint_and_prune_keeps_what_one_needs(
    tmp_path: Path,
) -> None:
    store = ClientStore.create(tmp_path / "clients", _part(0.0))
    for r in (1, 2, 4, 5):
        store.save(r, [3], _stack(_part(float(r))))
    store.save(2, [6], _stack(_part(20.0)))
    # checkpoints kept: rounds 2 and 4 -> client 3 needs its versions 2 and 4 (and 5, newer)
    store.prune(keep_from=2)
    assert store.rounds(3) == [2, 4, 5] and store.rounds(6) == [2]
    # resuming from round 4: round 5's version was written after the checkpoint
    store.rewind(4)
    assert store.rounds(3) == [2, 4]
    assert _equal(store.load(3), _part(4.0)) and _equal(store.load(3, at_most=3), _part(2.0))
    assert store.nbytes() > 0


def test_create_starts_afresh_over_an_attempt_that_never_checkpointed(tmp_path: Path) -> None:
    store = ClientStore.create(tmp_path / "clients", _part(0.0))
    store.save(1, [0], _stack(_part(9.0)))
    again = ClientStore.create(tmp_path / "clients", _part(5.0))
    assert again.clients() == [] and _equal(again.load(0), _part(5.0))


@pytest.mark.parametrize("bad", ["round_x.npz", "round_1.npz.tmp", "notes.txt"])
def test_stray_files_are_not_versions(tmp_path: Path, bad: str) -> None:
    store = ClientStore.create(tmp_path / "clients", _part(0.0))
    (tmp_path / "clients" / "client_2").mkdir()
    (tmp_path / "clients" / "client_2" / bad).write_text("x")
    assert store.rounds(2) == [] and _equal(store.load(2), _part(0.0))
