"""deploy.node's LocalStore: a client's local parts on its node's disk, by round."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.deploy.node import LocalStore

RUN = "0123456789abcdef"


def _part(value: float) -> dict:
    return {"classifier": {"kernel": np.full((2, 3), value, np.float32),
                           "bias": np.arange(3, dtype=np.float32) + value}}  # fmt: skip


def test_load_gives_the_part_of_the_newest_round_at_most_asked(tmp_path) -> None:
    store = LocalStore(tmp_path, RUN, 1)
    assert store.load(5) is None  # nothing trained yet: the node starts from the pretrained part
    for r in (1, 2, 4):
        store.save(r, _part(float(r) + 0.1))
    r, part = store.load(3)
    assert r == 2
    np.testing.assert_array_equal(part["classifier"]["kernel"], _part(2.1)["classifier"]["kernel"])
    assert part["classifier"]["bias"].dtype == np.float32
    assert store.load(4)[0] == 4 and store.load(0) is None
    assert store.directory == tmp_path / RUN / "client_1"


def test_prune_keeps_what_a_resume_from_the_checkpoint_can_need(tmp_path) -> None:
    store = LocalStore(tmp_path, RUN, 0)
    for r in (1, 2, 3, 5, 6):
        store.save(r, _part(r))
    store.prune(keep_from=4)  # the server's checkpoint is round 4: round 3's part and later stay
    assert store.rounds() == [3, 5, 6]
    store.prune(keep_from=0)
    assert store.rounds() == [3, 5, 6]


def test_a_save_is_atomic_and_run_ids_are_checked(tmp_path) -> None:
    store = LocalStore(tmp_path, RUN, 0)
    store.save(1, _part(1.0))
    assert [p.name for p in store.directory.iterdir()] == ["round_1.npz"]  # no temporary left
    with pytest.raises(ValueError, match="bad run id"):
        LocalStore(tmp_path, "../escape", 0)
