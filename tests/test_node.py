"""deploy.node's store of a client's local parts on its node's disk (the simulation's client
store, for one client; its versioning is tested in test_client_store)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import chex
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


def test_a_node_keeps_for_export_the_latest_global_part_and_its_local_pair(tmp_path) -> None:
    """keep_for_export: the model's description once, and only the latest evaluation's pair (the
    global part in its wire dtype, the client's local part it was evaluated with; after a
    resumed server sends an older round, that one: it is the run's present). The pair outlives
    the store's pruning, which follows checkpoints, not evaluations (the reviewer's case:
    evaluated after round 5, round_5.npz pruned at round 7). A node without a model directory
    to name copies its frozen part; the pretrained local part is not kept (every evaluation
    here used a trained one)."""
    import json

    from fedjax_split.deploy.node import FROZEN_FILE, MODEL_FILE, exported_pair, keep_for_export

    frozen = {"encoder": {"w": np.ones((2, 2), np.float32)}}
    node = SimpleNamespace(client_id=2, local0=_part(0.0), frozen=frozen, model_meta={"m": 1})
    s = store(tmp_path, RUN, node)
    d = tmp_path / RUN
    d.mkdir()
    with pytest.raises(UserError, match="holds no global part"):
        exported_pair(d, 2)
    for r, value in ((1, 1.0), (5, 5.0), (3, 3.0), (5, 5.0)):
        s.save_one(r, 2, _part(value + 0.5))
        glob = {"embeddings": {"w": np.full((3,), value, np.float16)}}
        keep_for_export(s, node, glob, r, _part(value + 0.5))
        got, local, after = exported_pair(d, 2)
        assert after == r and got["embeddings"]["w"].dtype == np.float16
        np.testing.assert_array_equal(got["embeddings"]["w"], value)
        np.testing.assert_array_equal(local["classifier"]["bias"], _part(value + 0.5)[
            "classifier"]["bias"])  # fmt: skip
        assert len(list((d / "export").glob("*.npz"))) == 2
    s.save_one(6, 2, _part(6.5))
    s.save_one(7, 2, _part(7.5))
    s.prune(6)  # checkpoint 6 needs round 6's version: the store drops round 5's, the pair not
    assert 5 not in s.rounds(2)
    _, local, after = exported_pair(d, 2)
    assert after == 5 and float(local["classifier"]["kernel"][0, 0]) == 5.5
    with pytest.raises(UserError, match="client 1 was not evaluated at this node after round 5"):
        exported_pair(d, 1)
    assert json.loads((d / MODEL_FILE).read_text()) == {"m": 1}
    assert (d / FROZEN_FILE).is_file() and (d / "client_2").is_dir()
    assert not (d / "initial.npz").exists()


def test_a_node_names_its_frozen_part_by_sha256_and_keeps_the_pretrained_part_when_used(
    tmp_path,
) -> None:
    """With a model directory and a seed to rebuild it from, model.json records the frozen
    part's sha256 (over each array's path, dtype, shape and bytes, computed here by hand) and
    no copy is written; a client evaluated before it trained leaves the pretrained part."""
    import hashlib
    import json

    from fedjax_split.deploy.node import FROZEN_DIGEST, FROZEN_FILE, MODEL_FILE, keep_for_export
    from fedjax_split.sim.client_store import ClientStore

    w = np.arange(4, dtype=np.float32).reshape(2, 2)
    node = SimpleNamespace(client_id=0, local0=_part(0.0), frozen={"encoder": {"w": w}},
                           model_meta={"model_dir": "/models/base", "seed": 3})  # fmt: skip
    s = store(tmp_path, RUN, node)
    keep_for_export(s, node, {"embeddings": {"w": np.zeros(3, np.float16)}}, 1, node.local0)
    d = tmp_path / RUN
    by_hand = hashlib.sha256(b"encoder/w|float32|(2, 2)\n" + w.tobytes()).hexdigest()
    assert json.loads((d / MODEL_FILE).read_text()) == {
        "model_dir": "/models/base", "seed": 3, FROZEN_DIGEST: by_hand}  # fmt: skip
    assert not (d / FROZEN_FILE).exists()
    np.testing.assert_array_equal(ClientStore(d).initial["classifier"]["bias"], _part(0.0)[
        "classifier"]["bias"])  # fmt: skip


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from run_fixtures import write_tiny_model, write_tiny_sites

    base = tmp_path_factory.mktemp("sites")
    return {"model": write_tiny_model(base / "model"), "dirs": write_tiny_sites(base)}


def _site_config(sites: dict, site_data: str):
    from fedjax_split.run.config import resolve_config

    return resolve_config(overrides={
        "task": "sst2", "model": str(sites["model"]), "site_data": site_data, "clients": 3,
        "critical_layer": 1, "batch_size": 8, "local_epochs": 2, "max_length": 16})  # fmt: skip


def _without_index(batch):
    return batch.replace(example_index=None)


def test_a_site_node_reading_only_its_dir_builds_the_simulations_batches_for_it(
    sites: dict, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--site-data: node k, given only site k's directory, derives the split, the label shares
    and every training and test batch the simulation (all sites in one process) derives for
    client k; only the rows' indices differ, by the sites before it (the server's offset)."""
    from run_fixtures import tsv_rows

    from fedjax_split.deploy import node
    from fedjax_split.deploy.protocol import experiment_values
    from fedjax_split.run import client_data, experiment
    from fedjax_split.run.config import resolve_config
    from fedjax_split.run.sites import NODE_SITES

    monkeypatch.setenv("FEDJAX_SPLIT_CACHE", str(tmp_path / "cache"))
    dirs = sites["dirs"]
    setup = experiment.build(_site_config(sites, ",".join(map(str, dirs))))
    # what the ClientApp resolves from the launcher's run config: no site's path in it
    values = experiment_values({"experiment": json.dumps(setup.config.to_dict())})
    assert values["site_data"] == NODE_SITES
    config = resolve_config(overrides=values)
    labels = setup.pool.labels
    offset = 0
    for k, d in enumerate(dirs):
        n = node.prepare(config, k, tmp_path / f"cache_{k}", site_dir=d)
        sim = setup.partition.clients[k]
        assert n.pool_size == sum(tsv_rows(f) for f in d.glob("*.tsv"))  # its own rows only
        np.testing.assert_array_equal(n.split.train + offset, sim.train)
        np.testing.assert_array_equal(n.split.test + offset, sim.test)
        counts = np.bincount(labels[sim.all], minlength=2)
        np.testing.assert_allclose(n.shares, counts / counts.sum(), atol=1e-6)
        assert n.partition_meta["scheme"] == "sites" and "num_examples" not in n.partition_meta
        for r in (1, 2):
            got = client_data.client_steps(config, n.task, n.pool, n.split.train, k, r)
            want = experiment.round_batches(setup, r)[k]
            assert len(got) == len(want) > 0
            for a, b in zip(got, want, strict=True):
                real = np.asarray(a.example_index) >= 0
                np.testing.assert_array_equal(np.asarray(a.example_index)[real] + offset,
                                              np.asarray(b.example_index)[real])  # fmt: skip
                chex.assert_trees_all_equal(_without_index(a), _without_index(b))
        evals = client_data.client_eval_steps(config, n.task, n.pool, n.split.test)
        assert len(evals) == len(setup.eval_batches[k])
        for a, b in zip(evals, setup.eval_batches[k], strict=True):
            chex.assert_trees_all_equal(_without_index(a), _without_index(b))
        offset += n.pool_size


def test_a_ner_site_node_builds_the_simulations_batches_in_the_configs_vocabulary(
    sites: dict, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NER sites (CoNLL, --entity-types): node k, given only site k's directory, has the run's
    tag vocabulary (a head as wide as the simulation's), its dominant-type shares, and every
    training and test batch the simulation derives for client k."""
    from run_fixtures import NER_TYPES, conll_sentences, write_tiny_ner_sites

    from fedjax_split.deploy import node
    from fedjax_split.deploy.protocol import experiment_values
    from fedjax_split.run import client_data, experiment
    from fedjax_split.run.config import resolve_config

    monkeypatch.setenv("FEDJAX_SPLIT_CACHE", str(tmp_path / "cache"))
    dirs = write_tiny_ner_sites(tmp_path / "ner")
    setup = experiment.build(resolve_config(overrides={
        "task": "ner", "model": str(sites["model"]), "site_data": ",".join(map(str, dirs)),
        "entity_types": NER_TYPES, "critical_layer": 1, "batch_size": 8,
        "max_length": 16}))  # fmt: skip
    config = resolve_config(
        overrides=experiment_values({"experiment": json.dumps(setup.config.to_dict())})
    )
    assert setup.pool.examples.tag_names == ("O", "B-neg", "I-neg", "B-pos", "I-pos")
    labels, offset = setup.pool.labels, 0
    for k, d in enumerate(dirs):
        n = node.prepare(config, k, tmp_path / f"cache_{k}", site_dir=d)
        sim = setup.partition.clients[k]
        assert n.pool.examples.tag_names == setup.pool.examples.tag_names
        rows, test = conll_sentences(d / "train.txt"), d / "test.txt"
        held = conll_sentences(test) if test.exists() else int(rows / 5 + 0.5)  # else 80/20
        assert len(n.split.train) == rows - (0 if test.exists() else held) == len(sim.train)
        assert len(n.split.test) == held
        np.testing.assert_array_equal(n.split.train + offset, sim.train)
        np.testing.assert_array_equal(n.split.test + offset, sim.test)
        counts = np.bincount(labels[sim.all], minlength=3)  # neg, pos, (none)
        np.testing.assert_allclose(n.shares, counts / counts.sum(), atol=1e-6)
        got = client_data.client_steps(config, n.task, n.pool, n.split.train, k, 1)
        want = experiment.round_batches(setup, 1)[k]
        assert len(got) == len(want) > 0
        for a, b in zip(got, want, strict=True):
            chex.assert_trees_all_equal(_without_index(a), _without_index(b))
        evals = client_data.client_eval_steps(config, n.task, n.pool, n.split.test)
        assert len(evals) == len(setup.eval_batches[k]) > 0
        for a, b in zip(evals, setup.eval_batches[k], strict=True):
            chex.assert_trees_all_equal(_without_index(a), _without_index(b))
        offset += n.pool_size


def test_a_site_node_without_its_data_dir_is_one_line(sites: dict) -> None:
    from fedjax_split.deploy import node
    from fedjax_split.run.sites import NODE_SITES

    with pytest.raises(UserError, match="data-dir=DIR") as err:
        node.prepare(_site_config(sites, NODE_SITES), 1, None)
    assert "partition-id=1" in str(err.value) and "\n" not in str(err.value)


def test_a_nodes_clients_from_its_node_config() -> None:
    from fedjax_split.deploy.node import node_clients

    assert node_clients({"partition-id": 4}) == [4]
    assert node_clients({"partition-ids": "0-3"}) == [0, 1, 2, 3]
    assert node_clients({"partition-ids": "7, 0,4-5"}) == [7, 0, 4, 5]
    assert node_clients({"partition-ids": "2"}) == [2]
    for bad, why in (("3-1", "write ids and ranges"), ("a-b", "write ids and ranges"),
                     ("0-2,2", "names a client twice"), ("", "write ids and ranges")):  # fmt: skip
        with pytest.raises(UserError, match=why):
            node_clients({"partition-ids": bad})
    with pytest.raises(UserError, match="not both"):
        node_clients({"partition-id": 0, "partition-ids": "0-1"})
    with pytest.raises(UserError, match="give the SuperNode its client"):
        node_clients({"state-dir": "/x"})


def test_a_node_config_naming_no_whole_client_id_or_too_many_is_refused() -> None:
    from fedjax_split.deploy.node import node_clients

    for bad in ("1.5", "-1", "one"):
        with pytest.raises(UserError, match="is not a client id"):
            node_clients({"partition-id": bad})
    with pytest.raises(UserError, match="more clients than a node can hold"):
        node_clients({"partition-ids": "0-1000000000"})
