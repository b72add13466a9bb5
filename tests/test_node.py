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


def test_a_node_keeps_for_export_the_latest_global_part_it_received(tmp_path) -> None:
    """keep_for_export: the model's description, the initial and the frozen part once, and only
    the global part of the latest evaluation, in its wire dtype (after a resumed server sends an
    older round, that one: it is the run's present)."""
    import json

    from fedjax_split.deploy.node import FROZEN_FILE, MODEL_FILE, keep_for_export, received_global

    frozen = {"encoder": {"w": np.ones((2, 2), np.float32)}}
    node = SimpleNamespace(client_id=2, local0=_part(0.0), frozen=frozen, model_meta={"m": 1})
    s = store(tmp_path, RUN, node)
    d = tmp_path / RUN
    d.mkdir()
    with pytest.raises(UserError, match="holds no global part"):
        received_global(d)
    for r, value in ((1, 1.0), (3, 3.0), (2, 2.0)):
        glob = {"embeddings": {"w": np.full((3,), value, np.float16)}}
        keep_for_export(s, node, glob, r)
        got, after = received_global(d)
        assert after == r and got["embeddings"]["w"].dtype == np.float16
        np.testing.assert_array_equal(got["embeddings"]["w"], value)
        assert len(list(d.glob("global_after_*.npz"))) == 1
    assert json.loads((d / MODEL_FILE).read_text()) == {"m": 1}
    assert (d / FROZEN_FILE).is_file() and (d / "client_2").is_dir()
    from fedjax_split.sim.client_store import ClientStore

    initial = ClientStore(d).initial  # read from initial.npz
    np.testing.assert_array_equal(initial["classifier"]["bias"], _part(0.0)["classifier"]["bias"])
