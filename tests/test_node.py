"""deploy.node's store of a client's local parts on its node's disk (the simulation's client
store, for one client; its versioning is tested in test_client_store)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fedjax_split.deploy.node import local_part, store
from fedjax_split.errors import UserError

RUN = "0123456789abcdef"


def _part(value: float) -> dict:
    return {"classifier": {"kernel": np.full((2, 3), value, np.float32),
                           "bias": np.arange(3, dtype=np.float32) + value}}  # fmt: skip


def test_a_nodes_parts_by_round_under_its_run_and_the_pretrained_part_before(tmp_path) -> None:
    node = SimpleNamespace(client_id=1, local0=_part(0.0))
    s = store(tmp_path, RUN, node)
    np.testing.assert_array_equal(local_part(node, s, 5)["classifier"]["kernel"], 0.0)
    for r in (1, 3, 4):
        s.save_one(r, node.client_id, _part(float(r) + 0.1))
    assert sorted(p.name for p in (tmp_path / RUN / "client_1").iterdir()) == [
        "round_1.npz", "round_3.npz", "round_4.npz"]  # fmt: skip
    np.testing.assert_array_equal(local_part(node, s, 3)["classifier"]["kernel"], _part(3.1)[
        "classifier"]["kernel"])  # fmt: skip
    np.testing.assert_array_equal(local_part(node, s, 2)["classifier"]["bias"], _part(1.1)[
        "classifier"]["bias"])  # fmt: skip
    np.testing.assert_array_equal(local_part(node, s, 0)["classifier"]["kernel"], 0.0)


def test_a_part_of_another_model_or_a_bad_run_id_is_refused(tmp_path) -> None:
    node = SimpleNamespace(client_id=0, local0=_part(0.0))
    s = store(tmp_path, RUN, node)
    s.save_one(2, 0, {"classifier": {"kernel": np.zeros((4, 3), np.float32),
                                     "bias": np.zeros(3, np.float32)}})  # fmt: skip
    with pytest.raises(UserError, match="does not fit this model"):
        local_part(node, s, 2)
    with pytest.raises(ValueError, match="bad run id"):
        store(tmp_path, "../elsewhere", node)
