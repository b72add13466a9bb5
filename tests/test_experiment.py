"""fedjax_split.run.experiment (run_experiment as a library, in this process): what a run writes
and its accounting, personalised metrics against transformers' PyTorch BERT, partial
participation, 16-bit wire bytes counted by hand, the c = 0 and c = L edge cases, --freeze,
--packing, token tasks. The command line around it is tests/test_train.py's; the export,
tests/test_export.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from fedcore_helpers import dp_reference_epsilon
from run_fixtures import private_cache, tiny_sst2_files, write_tiny_model, write_tiny_sst2  # noqa: F401

from fedjax_split import export, train
from fedjax_split.data import sources
from fedjax_split.run import experiment
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir
from fedjax_split.tasks import registry as tasks


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_sst2_files(tmp_path_factory.mktemp("exp"))


def _config(files: dict[str, Path], name: str, **kw: object) -> dict:
    return {
        "task": "sst2",
        "model": str(files["model"]),
        "data_dir": str(files["data"]),
        "output_dir": str(files["base"] / name),
        "clients": 3,
        "rounds": 2,
        "local_epochs": 1,
        "batch_size": 32,
        "lr": 1e-3,
        "max_length": 16,
        **kw,
    }


def _global_count_by_hand(model_dir: Path, c: int) -> int:
    """Parameters of the embeddings and encoder layers 0..c-1, from the HF config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    emb = (cfg["vocab_size"] + cfg["max_position_embeddings"] + cfg["type_vocab_size"]) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    return emb + c * layer


@pytest.fixture(scope="module")
def straight(files: dict[str, Path]) -> Path:
    """Four rounds of every client, two epochs of one batch each (test_train's command line
    runs the same settings)."""
    cfg = _config(files, "straight", rounds=4, local_epochs=2, critical_layer=1, seed=0)
    experiment.run_experiment(cfg, progress=False)
    return files["base"] / "straight"


def test_a_run_writes_every_output_and_its_accounting(
    files: dict[str, Path], straight: Path
) -> None:
    for name in ("metrics.jsonl", "summary.json", "config.json", "partition.json"):
        assert (straight / name).is_file(), name
    records = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    per_round = records[0]["bytes_up"]
    # tiny BERT, c=1 of 2: global = embeddings + layer_0 in fp32 for 3 clients
    assert per_round == records[0]["bytes_down"] > 0
    for i, r in enumerate(records, 1):
        assert r["cum_bytes_up"] == i * per_round and r["cum_bytes"] == 2 * i * per_round
        assert np.isfinite(r["train_loss"]) and r["seconds"] >= 0
        assert r["train_seconds"] > 0 and r["eval_seconds"] > 0  # tiny runs evaluate every round
        assert r["seconds"] == pytest.approx(r["train_seconds"] + r["eval_seconds"], abs=1e-9)
        assert len(r["clients"]) == 3 and len(r["train_loss_clients"]) == 3
        mean = np.mean([c["accuracy"] for c in r["clients"]])
        assert r["accuracy"] == pytest.approx(mean, abs=1e-12)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["primary_metric"] == "accuracy"
    # rounded for reading (metrics.jsonl keeps the exact figures); bytes exact beside their MB
    assert summary["final"]["accuracy"] == round(records[-1]["accuracy"], 4)
    for key in ("seconds", "train_seconds", "eval_seconds"):
        assert summary[key] == pytest.approx(sum(r[key] for r in records), abs=0.051)
    assert summary["cum_bytes"] == records[-1]["cum_bytes"]
    assert summary["cum_mb"] == round(records[-1]["cum_bytes"] / 1e6, 1)
    # the label priors alone, by hand: each client's majority training label on its own test
    part = json.loads((straight / "partition.json").read_text())
    pool = sources.load_examples(tasks.get_task("sst2"), data_dir=files["data"])
    labels = np.asarray(pool.labels)
    own = [np.mean(labels[c["test"]] == np.bincount(labels[c["train"]]).argmax())
           for c in part["clients"]]  # fmt: skip
    assert summary["majority_label"] == pytest.approx(np.mean(own), abs=5e-5)
    # plot.png: accuracy against rounds and against MB, the priors' figure dashed
    assert summary["plot"] == str(straight / "plot.png")
    assert (straight / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((straight / "config.json").read_text())
    assert config["critical_layer"] == 1 and config["clients"] == 3
    part = json.loads((straight / "partition.json").read_text())
    assert "clients" in part or "train" in json.dumps(part)
    assert part["label_names"] == ["negative", "positive"]  # sst2's, the shares' columns
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["3", "4"]


def test_keep_checkpoints_1_leaves_the_latest_checkpoint_and_the_versions_it_needs(
    files: dict[str, Path], straight: Path
) -> None:
    cfg = _config(files, "keep1", rounds=4, local_epochs=2, critical_layer=1, seed=0,
                  keep_checkpoints=1)  # fmt: skip
    experiment.run_experiment(cfg, progress=False)
    run = files["base"] / "keep1"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]
    versions = sorted(p.name for p in (run / "clients").rglob("round_*.npz"))
    assert versions == ["round_4.npz"] * 3  # every client trained in round 4
    # the same trajectory as the run that keeps two, and its client 0 still exports
    def accuracies(d: Path) -> list[float]:
        return [json.loads(x)["accuracy"] for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert accuracies(run) == accuracies(straight)
    kept, want = (export.personalised_params(d, 0)[0] for d in (run, straight))
    chex.assert_trees_all_equal(kept, want, strict=True)  # values, dtypes and shapes


def test_progress_inside_rounds_and_the_time_left_change_no_result(
    files: dict[str, Path], straight: Path, capsys, monkeypatch
) -> None:
    """The run of `straight` with progress on (lines unthrottled): stderr has the compile line
    before round 1, lines inside each round (clients, steps), the time left after round 1; the
    records are the same as without progress, bit for bit."""
    from fedjax_split.run import outputs

    monkeypatch.setattr(outputs, "LINE_SECONDS", 0.0)
    capsys.readouterr()
    cfg = _config(files, "straight_progress", rounds=4, local_epochs=2, critical_layer=1, seed=0)
    experiment.run_experiment(cfg, progress=True)
    lines = capsys.readouterr().err.splitlines()
    compiling = [i for i, x in enumerate(lines) if "compiling" in x]
    assert [lines[i] for i in compiling] == [
        "round 1: compiling the client program (the first round only) ..."
    ]
    ends = [next(i for i, x in enumerate(lines) if x.startswith(f"round {r} |")) for r in (1, 2)]
    inside = [x for x in lines[compiling[0] + 1 : ends[0]] if x.startswith("round 1: ")]
    line = r"round 1: \d/3 clients done, \d+/\d+ steps(, [\d,]+ examples/s)?"
    assert inside and all(re.fullmatch(line, x) for x in inside)
    assert any(x.startswith("round 2: ") for x in lines[ends[0]:ends[1]])
    assert lines[ends[0]].endswith(" left")  # the time left, after the first round
    assert not lines[-1].endswith(" left")  # none after the last

    def results(run_dir: Path) -> list:
        drop = ("seconds", "train_seconds", "eval_seconds", "cum_seconds", "compile_seconds")
        return [{k: v for k, v in json.loads(x).items() if k not in drop}
                for x in (run_dir / "metrics.jsonl").read_text().splitlines()]  # fmt: skip

    assert results(files["base"] / "straight_progress") == results(straight)


@pytest.fixture(scope="module")
def partial_fp16(files: dict[str, Path]) -> Path:
    """2 of 3 clients per round, 16-bit wire, critical layer 1 of 2."""
    cfg = _config(files, "partial", clients_per_round=2, quantize="fp16", critical_layer=1)
    experiment.run_experiment(cfg, progress=False)
    return files["base"] / "partial"


def test_fp16_wire_bytes_counted_by_hand(files: dict[str, Path], partial_fp16: Path) -> None:
    records = [json.loads(x) for x in (partial_fp16 / "metrics.jsonl").read_text().splitlines()]
    per_client = 2 * _global_count_by_hand(files["model"], 1)  # fp16: 2 bytes per parameter
    for r in records:
        assert len(r["clients_sampled"]) == 2
        assert r["bytes_up"] == r["bytes_down"] == 2 * per_client
    assert records[-1]["cum_bytes"] == 2 * 2 * 2 * per_client
    state, _ = RunCheckpointer(checkpoint_dir(partial_fp16)).restore_untyped()
    leaves = jax.tree.leaves(state["server_state"]["global_params"])
    assert {np.asarray(x).dtype for x in leaves} == {np.dtype("float16")}


def test_trained_mean_is_over_the_clients_sampled_so_far(partial_fp16: Path) -> None:
    """With 2 of 3 clients a round, the mean over all clients includes one that may not have
    trained yet; trained_mean is over exactly the clients sampled up to that round. With a local
    part there is no single global model, hence no pooled figure."""
    records = [json.loads(x) for x in (partial_fp16 / "metrics.jsonl").read_text().splitlines()]
    trained: set[int] = set()
    for r in records:
        trained |= set(r["clients_sampled"])
        per_client = {pc["client"]: pc["accuracy"] for pc in r["clients"]}
        assert r["accuracy"] == pytest.approx(np.mean(list(per_client.values())))
        want = np.mean([per_client[c] for c in sorted(trained)])
        assert r["trained_mean"]["accuracy"] == pytest.approx(want)
        assert "pooled" not in r
    assert len(set(records[0]["clients_sampled"])) == 2  # round 1: one client never trained


def test_only_sampled_clients_local_parts_change(
    files: dict[str, Path], partial_fp16: Path
) -> None:
    from fedjax_split.fed.roles import split_params
    from fedjax_split.models.hf_checkpoint import load_pretrained
    from fedjax_split.sim.client_store import ClientStore

    first = json.loads((partial_fp16 / "metrics.jsonl").read_text().splitlines()[0])
    store = ClientStore(partial_fp16 / experiment.CLIENTS_DIR)
    _, initial_local = split_params(load_pretrained(files["model"], num_labels=2).params, 1)
    for k in range(3):
        # a version of round 1 exactly for the sampled clients; the others have the initial part
        assert (store.version(k, at_most=1) == 1) == (k in first["clients_sampled"])
        local_k = store.load(k, at_most=1)
        same = all(
            np.array_equal(a, np.asarray(b))
            for a, b in zip(jax.tree.leaves(local_k), jax.tree.leaves(initial_local), strict=True)
        )
        assert same == (k not in first["clients_sampled"]), k
    # the checkpoint holds the server's state only: no copy of any client's local part
    state, meta = RunCheckpointer(checkpoint_dir(partial_fp16)).restore_untyped(1)
    assert meta["round"] == 1 and set(state) == {"server_state"}


def test_the_client_store_trains_what_clients_held_in_memory_train(files: dict[str, Path]) -> None:
    """Two rounds of 2 of 3 clients through run_experiment (local parts in the client store, read
    back for each round) against the same rounds with every client's local part held stacked
    in memory: the same server state and local parts, bit for bit."""
    from fedjax_split.sim import rounds
    from fedjax_split.sim.client_store import ClientStore

    cfg = experiment.resolve_config(overrides=_config(
        files, "store_vs_memory", clients_per_round=2, critical_layer=1, rounds=2))  # fmt: skip
    experiment.run_experiment(cfg, progress=False)
    setup = experiment.build(cfg)  # the same start, held in memory
    model = setup.model
    stacked = rounds.replicate(model.local0, cfg.federation.clients)
    state = rounds.init_server_state(
        model.global0, model.round_spec.server_optimizer, model.round_spec.wire_dtype
    )
    for r in (1, 2):
        fed = cfg.federation
        sampled = rounds.sample_clients(fed.clients, fed.sampled_clients, cfg.seed, r)
        n = np.asarray([len(setup.partition.clients[i].train) for i in sampled], np.float32)
        state, new, _ = rounds.run_round(
            model.round_spec, state, rounds.take_clients(stacked, sampled), n,
            experiment.round_batches(setup, r), jax.random.key(cfg.seed), client_ids=sampled,
            frozen=model.frozen,
        )  # fmt: skip
        stacked = rounds.put_clients(stacked, sampled, new)
    store = ClientStore(cfg.run_dir / experiment.CLIENTS_DIR)
    for k in range(cfg.federation.clients):
        held = jax.tree.map(lambda x, k=k: np.asarray(x[k]), stacked)
        chex.assert_trees_all_equal(store.load(k), held, strict=True)  # bit for bit, dtypes too
    saved, _ = RunCheckpointer(checkpoint_dir(cfg.run_dir)).restore_untyped()
    chex.assert_trees_all_equal(saved["server_state"]["master"], state.master, strict=True)


def test_personalised_metrics_match_transformers(
    files: dict[str, Path], partial_fp16: Path
) -> None:
    """Each client's exported model, run by transformers' PyTorch BERT on that client's test
    examples (from partition.json), gives the accuracy the run reported for that client."""
    torch = pytest.importorskip("torch")
    from transformers import BertForSequenceClassification, BertTokenizerFast

    last = json.loads((partial_fp16 / "metrics.jsonl").read_text().splitlines()[-1])
    part = json.loads((partial_fp16 / "partition.json").read_text())
    pool = sources.load_examples(tasks.get_task("sst2"), data_dir=files["data"])
    accs = []
    for k in range(3):
        out = export.export_client(partial_fp16, k, files["base"] / f"export{k}")
        model = BertForSequenceClassification.from_pretrained(out).eval()
        tok = BertTokenizerFast.from_pretrained(out)
        test = part["clients"][k]["test"]
        enc = tok(
            [pool.texts_a[i] for i in test],
            padding=True,
            truncation=True,
            max_length=16,
            return_tensors="pt",
        )
        with torch.no_grad():
            pred = model(**enc).logits.argmax(-1).numpy()
        accs.append(float(np.mean(pred == np.asarray(pool.labels)[test])))
    assert [c["accuracy"] for c in last["clients"]] == pytest.approx(accs, abs=1e-12)
    assert last["accuracy"] == pytest.approx(np.mean(accs), abs=1e-12)


@pytest.mark.parametrize("critical_layer", [0, None], ids=["c=0", "c=L"])
def test_edge_critical_layers(files: dict[str, Path], critical_layer: int | None) -> None:
    name = f"edge_{critical_layer}"
    summary = experiment.run_experiment(
        _config(files, name, critical_layer=critical_layer, rounds=1), progress=False
    )
    if critical_layer == 0:  # nothing global: nothing is sent
        assert summary["cum_bytes"] == 0 and summary["global_params"] == 0
    else:  # everything global (FedAvg): 3 clients x all parameters x 4 bytes, both ways
        assert summary["local_params_per_client"] == 0
        assert summary["cum_bytes"] == 2 * 3 * 4 * summary["global_params"]
        assert summary["critical_layer"] == summary["num_layers"] == 2
        # one global model: the pooled figure is its accuracy over every client's test rows
        parts = json.loads((files["base"] / name / "partition.json").read_text())["clients"]
        sizes = [len(c["test"]) for c in parts]
        accs = [pc["accuracy"] for pc in summary["final"]["clients"]]
        want = sum(a * n for a, n in zip(accs, sizes, strict=True)) / sum(sizes)
        assert summary["final"]["pooled"]["accuracy"] == pytest.approx(want)
    assert np.isfinite(summary["final"]["accuracy"])


def test_packing_setting_reaches_every_rounds_batches(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--packing is wired through: every round trains on packed segments (prefetched ones too)."""
    from fedjax_split.sim import rounds

    seen, chunks = [], []
    real_run_round = rounds.run_round

    def spy(spec, state, local, num_examples, segments, *a, **kw):
        seen.append(all(s.packed for steps in segments for s in steps))
        chunks.append(spec.chunk_size)
        return real_run_round(spec, state, local, num_examples, segments, *a, **kw)

    monkeypatch.setattr(rounds, "run_round", spy)
    for packing in (True, False):
        name = f"packing_{packing}"
        seen.clear()
        summary = experiment.run_experiment(
            _config(files, name, packing=packing, critical_layer=1, cpu_devices=1 + packing),
            progress=False,
        )
        assert seen == [packing, packing]  # two rounds, the second one prefetched
        assert chunks[-1] == 1  # no --chunk-size on a CPU: clients one at a time
        assert summary["round_devices"] == 1 + packing  # --cpu-devices (conftest has 2)
        assert json.loads((files["base"] / name / "config.json").read_text())["packing"] is packing
        assert np.isfinite(summary["final"]["accuracy"])


def test_evaluate_maps_groups_by_example_index_and_means_over_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MNLI: matched/mismatched accuracy per client via each row's pool index; the unweighted
    mean over all clients, over the trained ones, and (nothing local) the pooled figure."""
    from types import SimpleNamespace

    from fedjax_split.sim import evaluation
    from fedjax_split.sim.evaluation import ClientPredictions
    from fedjax_split.tasks import registry as tasks

    groups = np.array(["matched", "mismatched", "matched", "mismatched", "matched", "matched"])
    results = [  # client 0: rows 3, 0, 1 (sorted by length); client 1: rows 5, 2
        ClientPredictions(np.array([1, 0, 2]), np.array([1, 0, 0]), np.array([3, 0, 1])),
        ClientPredictions(np.array([2, 1]), np.array([2, 0]), np.array([5, 2])),
    ]
    monkeypatch.setattr(evaluation, "evaluate_personalised", lambda *a, **k: results)
    setup = SimpleNamespace(
        model=SimpleNamespace(apply=None, num_local=0, task=tasks.get_task("mnli")),
        eval_batches=[["client 0's batches"], ["client 1's batches"]],
        pool=SimpleNamespace(examples=SimpleNamespace(groups=groups)),
    )
    store = SimpleNamespace(load=lambda client: {})
    state = SimpleNamespace(global_params={})
    out = experiment.evaluate(setup, state, frozen={}, store=store, trained={0})
    c0, c1 = out["clients"]
    # client 0: row 3 (mismatched) right, row 0 (matched) right, row 1 (mismatched) wrong
    assert c0["accuracy"] == pytest.approx(2 / 3)
    assert c0["accuracy_matched"] == 1.0 and c0["accuracy_mismatched"] == 0.5
    # client 1: row 5 (matched) right, row 2 (matched) wrong; no mismatched rows
    assert c1["accuracy"] == 0.5 and c1["accuracy_matched"] == 0.5
    assert "accuracy_mismatched" not in c1
    assert out["accuracy"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert out["accuracy_matched"] == pytest.approx(0.75)
    assert out["accuracy_mismatched"] == pytest.approx(0.5)  # over the clients that have it
    # trained at least once: client 0 alone
    assert out["trained_mean"] == {k: c0[k] for k in c0 if k != "client"}
    # pooled: 5 rows, 3 right; matched rows 0, 5 right and 2 wrong; mismatched 3 right, 1 wrong
    assert out["pooled"]["accuracy"] == pytest.approx(3 / 5)
    assert out["pooled"]["accuracy_matched"] == pytest.approx(2 / 3)
    assert out["pooled"]["accuracy_mismatched"] == pytest.approx(1 / 2)


def test_a_split_runs_last_evaluation_scores_the_global_model_on_each_clients_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a local part, the last evaluation also scores the global model, the global part with
    the initial local part, on each client's own split; the gain is each client's personal
    figure minus that one, mean over clients; a client without test rows (client 1) is in
    neither; no global scoring before the last evaluation."""
    from types import SimpleNamespace

    from fedjax_split.sim import evaluation
    from fedjax_split.sim.evaluation import ClientPredictions

    initial, personal = {"head": "initial"}, {0: {"head": 0}, 1: {"head": 1}, 2: {"head": 2}}
    labels = {0: [1, 1, 0, 0], 1: [], 2: [0, 1]}
    own = {0: [1, 1, 0, 1], 1: [], 2: [0, 1]}  # 3/4 and 2/2 right
    initial_says = {0: [0, 0, 0, 0], 1: [], 2: [0, 0]}  # 2/4 and 1/2 right
    loaded: list[object] = []

    def fake(apply, params, load, batches, ids, objective):
        parts = {i: load(i) for i in ids}
        loaded.append(list(parts.values()))
        rows = [initial_says[i] if parts[i] is initial else own[i] for i in ids]
        return [ClientPredictions(np.array(r), np.array(labels[i]), np.arange(len(r)))
                for i, r in zip(ids, rows, strict=True)]  # fmt: skip

    monkeypatch.setattr(evaluation, "evaluate_personalised", fake)
    setup = SimpleNamespace(
        model=SimpleNamespace(apply=None, num_local=7, local0=initial,
                              task=tasks.get_task("rotten_tomatoes")),
        eval_batches=[["b"], [], ["b"]], pool=SimpleNamespace(examples=SimpleNamespace()),
    )  # fmt: skip
    store = SimpleNamespace(load=personal.__getitem__)
    state = SimpleNamespace(global_params={})
    early = experiment.evaluate(setup, state, frozen={}, store=store, trained={0, 2})
    assert len(loaded) == 1 and "personalization_gain" not in early and "pooled" not in early
    out = experiment.evaluate(setup, state, frozen={}, store=store, trained={0, 2}, last=True)
    assert loaded[-1] == [initial] * 3  # every client: the one initial part
    assert out["clients"] == [{"client": 0, "accuracy": 0.75}, {"client": 2, "accuracy": 1.0}]
    assert out["global_clients"] == [{"client": 0, "accuracy": 0.5},
                                     {"client": 2, "accuracy": 0.5}]  # fmt: skip
    assert out["personalization_gain"]["accuracy"] == pytest.approx(((0.75 - 0.5) + 0.5) / 2)
    assert out["worst_client"] == {"accuracy": 0.75}
    assert out["p10_client"]["accuracy"] == pytest.approx(0.75 + 0.1 * 0.25)
    assert "pooled" not in out  # no single trained global model: no pooled figure


def _hand_p10(values: list[float]) -> float:
    """The 10th percentile by linear interpolation, from its definition."""
    xs = sorted(values)
    pos = 0.1 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def test_a_small_runs_per_client_figures_by_hand(files: dict[str, Path]) -> None:
    """Three sites, one with two training examples and no test split; c=1 of 2, one client a
    round: summary.json, the done line and the last record give the worst client, the 10th
    percentile and the gain, each as computed by hand from the record's per-client figures;
    the client without a test split is in none of them; a client never sampled still holds the
    initial local part, so its personal and global figures are equal."""
    sites = [write_tiny_sst2(files["base"] / "pc_sites" / f"s{k}", seed=20 + k, **kw)
             for k, kw in enumerate(({"n_train": 40, "n_dev": 12}, {"n_train": 2, "n_dev": 0},
                                     {"n_train": 30, "n_dev": 10, "positive": 0.8},
                                     {"n_train": 24, "n_dev": 8, "positive": 0.2}))]  # fmt: skip
    cfg = _config(files, "per_client", data_dir=None, clients=4, critical_layer=1,
                  site_data=",".join(map(str, sites)), clients_per_round=1, rounds=2, seed=3)
    summary = experiment.run_experiment(cfg, progress=False)
    run = files["base"] / "per_client"
    last = _records(run)[-1]
    assert json.loads((run / "partition.json").read_text())["clients"][1]["test"] == []
    personal = {c["client"]: c["accuracy"] for c in last["clients"]}
    theirs = {c["client"]: c["accuracy"] for c in last["global_clients"]}
    assert sorted(personal) == sorted(theirs) == [0, 2, 3]  # site 1 has no test split
    assert last["worst_client"]["accuracy"] == min(personal.values())
    assert last["p10_client"]["accuracy"] == pytest.approx(_hand_p10(list(personal.values())))
    gain = np.mean([personal[c] - theirs[c] for c in personal])
    assert last["personalization_gain"]["accuracy"] == pytest.approx(gain)
    sampled = {c for r in _records(run) for c in r["clients_sampled"]}
    never = set(personal) - sampled
    assert never and all(personal[c] == theirs[c] for c in never)
    assert any(personal[c] != theirs[c] for c in personal if c in sampled)
    assert "global_clients" not in _records(run)[0]  # the last evaluation only
    on_disk = json.loads((run / "summary.json").read_text())["final"]
    for key in ("worst_client", "p10_client", "personalization_gain"):
        assert on_disk[key]["accuracy"] == round(last[key]["accuracy"], 4)
    line = train.done_line(summary).splitlines()[0]
    assert (f"(mean over clients; worst client {min(personal.values()):.4f}, 10th percentile "
            f"{_hand_p10(list(personal.values())):.4f}, personalisation gain {gain:+.4f})") in line


def test_a_run_with_nothing_local_has_no_gain_but_its_spread(files: dict[str, Path]) -> None:
    """c = L: every client's model is the global model, so there is no gain to give; the worst
    client and the 10th percentile are there, by hand."""
    cfg = _config(files, "per_client_cL", critical_layer=2, rounds=1)
    summary = experiment.run_experiment(cfg, progress=False)
    last = _records(files["base"] / "per_client_cL")[-1]
    figures = [c["accuracy"] for c in last["clients"]]
    assert last["worst_client"]["accuracy"] == min(figures)
    assert last["p10_client"]["accuracy"] == pytest.approx(_hand_p10(figures))
    assert "personalization_gain" not in last and "global_clients" not in last
    assert "personalisation gain" not in train.done_line(summary)


def test_freeze_sends_nothing_frozen_and_keeps_it_bit_identical(files: dict[str, Path]) -> None:
    """--critical-layer L --freeze 'embeddings\\.': every parameter but the embeddings is global
    and sent (4 bytes each, each way, per client); the embeddings stay exactly the checkpoint's."""
    from fedjax_split.models.weight_files import read_weights

    out = files["base"] / "frozen"
    summary = experiment.run_experiment(
        _config(files, "frozen", critical_layer=None, freeze=r"embeddings\."), progress=False
    )
    weights = {n.removeprefix("bert."): w for n, w in read_weights(files["model"]).items()}
    total = sum(int(np.prod(w.shape)) for w in weights.values())
    embeddings = sum(int(np.prod(w.shape)) for n, w in weights.items() if ".embeddings." in f".{n}")
    assert embeddings == _global_count_by_hand(files["model"], 0)  # the hand count agrees
    assert summary["frozen_params"] == embeddings
    assert summary["global_params"] == total - embeddings
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["bytes_up"] == r["bytes_down"] == 3 * 4 * (total - embeddings)
    state, _ = RunCheckpointer(checkpoint_dir(out)).restore_untyped()
    frozen = state["frozen"]["embeddings"]
    assert set(state["server_state"]["master"]) == {"encoder", "pooler", "classifier"}
    for ours, theirs in (
        ("word_embeddings", "word_embeddings"),
        ("position_embeddings", "position_embeddings"),
    ):
        np.testing.assert_array_equal(
            np.asarray(frozen[ours]["embedding"]), weights[f"embeddings.{theirs}.weight"]
        )
    np.testing.assert_array_equal(
        np.asarray(frozen["LayerNorm"]["scale"]), weights["embeddings.LayerNorm.weight"]
    )
    # the export holds them too (the personalised model is global + local + frozen)
    exported = export.export_client(out, 1, files["base"] / "frozen_export")
    again = read_weights(exported)
    key = [k for k in again if k.endswith("embeddings.word_embeddings.weight")][0]
    np.testing.assert_array_equal(again[key], weights["embeddings.word_embeddings.weight"])


def test_minilm_freeze_embeddings_at_c6_sends_all_but_the_embeddings() -> None:
    """The issue's case on MiniLM's shapes (no weights needed): --critical-layer 6 --freeze
    'embeddings\\.' sends 4 bytes x (every parameter but the embeddings) per client each way."""
    import jax.numpy as jnp

    from fedjax_split.fed import server_optimizers
    from fedjax_split.fed.client import ClientSpec
    from fedjax_split.fed.roles import critical_layer_rule, freeze_rule, partition
    from fedjax_split.models.bert import BertConfig, init_params
    from fedjax_split.models.hf_checkpoint import hf_names
    from fedjax_split.sim.round_spec import RoundSpec, client_bytes
    from fedjax_split.tasks.objectives import CLASSIFICATION

    config = BertConfig(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=2,
    )  # all-MiniLM-L6-v2's shape
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    names = {p: n for p, (n, _) in hf_names(config).items()}
    rule = freeze_rule(critical_layer_rule(6, 6), r"embeddings\.", names)
    g, local, frozen = partition(shapes, rule)
    h, i, v = 384, 1536, 30522
    emb = (v + 512 + 2) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    everything_else = 6 * layer + (h * h + h) + (h * 2 + 2)  # layers, pooler, classifier
    count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))  # noqa: E731
    assert count(frozen) == emb and local == {}
    spec = RoundSpec(ClientSpec(None, CLASSIFICATION, None), server_optimizers.fedavg(), "float32")
    assert client_bytes(spec, g) == (4 * everything_else, 4 * everything_else)
    half = RoundSpec(ClientSpec(None, CLASSIFICATION, None), server_optimizers.fedavg(), "bfloat16")
    assert client_bytes(half, g) == (2 * everything_else, 2 * everything_else)
    assert jnp.dtype(jax.tree.leaves(g)[0].dtype) == jnp.float32


@pytest.fixture(scope="module")
def ner_run(files: dict[str, Path]) -> Path:
    from run_fixtures import write_tiny_conll

    data = write_tiny_conll(files["base"] / "conll")
    cfg = _config(
        files, "ner", task="ner", data_dir=str(data), partition="dirichlet", alpha=1.0,
        critical_layer=1, rounds=3, local_epochs=2, batch_size=8, lr=3e-3,
    )  # fmt: skip
    experiment.run_experiment(cfg, progress=False)
    return files["base"] / "ner"


def test_ner_run_reports_entity_f1_per_client_and_learns(ner_run: Path) -> None:
    records = [json.loads(x) for x in (ner_run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert {"precision", "recall", "f1"} <= set(last)
    assert len(last["clients"]) == 3 and all("f1" in c for c in last["clients"])
    assert last["f1"] == pytest.approx(np.mean([c["f1"] for c in last["clients"]]))
    # two entity types learnable by word: a run that trains finds them, an untrained head not
    assert records[0]["train_loss"] > 2 * last["train_loss"]
    assert last["f1"] > records[0]["f1"] + 0.3
    summary = json.loads((ner_run / "summary.json").read_text())
    assert summary["primary_metric"] == "f1"


def _records(run_dir: Path, private: bool = False) -> list[dict]:
    """metrics.jsonl's records, or with `private` the server-private file's (a DP run's
    per-client figures)."""
    path = run_dir / "private" / "clients.jsonl" if private else run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_dp_budget_ends_the_run_after_the_last_round_within_it(
    files: dict[str, Path], capsys
) -> None:
    """--dp-max-epsilon 2.8 with z = 2, 2 of 3 clients a round (Poisson, q = 2/3), delta 1e-5:
    dp_accounting gives epsilon 2.49 after two rounds and 3.05 after three, so the run does two
    of its four rounds, says so before the first, and reports the epsilon it spent. (A DP run
    SIGKILLed and resumed: tests/test_train.py.)"""
    def spent(rounds: int) -> float:  # the accountant's figure, the event built in the tests
        return dp_reference_epsilon(2.0, 2 / 3, rounds, 1e-5)

    assert spent(2) <= 2.8 < spent(3)
    cfg = _config(files, "dp_budget", rounds=4, critical_layer=1, clients_per_round=2,
                  dp_noise_multiplier=2.0, dp_clip=0.5, dp_max_epsilon=2.8)  # fmt: skip
    capsys.readouterr()
    summary = experiment.run_experiment(cfg, progress=True)
    err = capsys.readouterr().err
    assert "--dp-max-epsilon 2.8 allows 2 of the 4 rounds (epsilon 2.49 after them)" in err
    assert "Gaussian noise z = 2" in err and "Poisson-sampled at rate 0.666667" in err
    run = files["base"] / "dp_budget"
    records = _records(run, private=True)
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert r["epsilon"] == pytest.approx(spent(r["round"]), rel=1e-9)
        assert r["dp_clip"] == 0.5 and r["clients_rejected"] == []
        assert len(r["update_norms"]) == len(r["clients_sampled"])
    assert summary["rounds"] == 2 and "accuracy" in summary["final"]  # evaluated at its end
    # every round's line and the done line say the epsilon spent and what is left of the budget
    said = {r: f"epsilon {spent(r):.3g} of 2.8 ({2.8 - spent(r):.3g} left)" for r in (1, 2)}
    for r in (1, 2):
        assert any(x.startswith(f"round {r} |") and f"| {said[r]} |" in x
                   for x in err.splitlines()), (r, err)  # fmt: skip
    assert f"; {said[2]} at delta 1e-05; " in train.done_line(summary).splitlines()[0]
    assert summary["label"] == "FedSplitBERT c=1 + DP z=2"
    on_disk = json.loads((run / "summary.json").read_text())
    privacy = on_disk["privacy"]
    assert privacy["epsilon"] <= privacy["max_epsilon"] == 2.8
    assert privacy["epsilon"] == pytest.approx(records[-1]["epsilon"], abs=5e-5)  # rounded
    assert privacy["rounds"] == 2 and privacy["noise_multiplier"] == 2.0
    assert privacy["sampling"] == "poisson" and privacy["sampling_rate"] == round(2 / 3, 4)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2"]


def _lora_count_by_hand(model_dir: Path, layers: int, rank: int) -> int:
    """Parameters of the query and value adapters of `layers` encoder layers, from config.json:
    A [h, r] and B [r, h] each."""
    h = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    return layers * 2 * (h * rank + rank * h)


@pytest.mark.parametrize(
    ("critical_layer", "algorithm", "quantize", "wire_bytes"),
    [(1, "fedavg", "fp16", 2), (None, "fedadam", "none", 4)],
)
def test_lora_trains_adapters_and_head_sends_only_the_shared_and_keeps_the_base_bit_identical(
    files: dict[str, Path], critical_layer: int | None, algorithm: str, quantize: str,
    wire_bytes: int,
) -> None:  # fmt: skip
    """c = 1 of 2: the first layer's adapters are global, in fp16; c = L with FedAdam: every
    adapter and the head, in fp32. Bytes by hand from config.json; every base weight equals the
    checkpoint's after the rounds; the local parts hold only adapters and the head."""
    from fedjax_split.fed.roles import flatten_paths
    from fedjax_split.models.hf_checkpoint import load_pretrained
    from fedjax_split.sim.client_store import ClientStore

    name = f"lora_{critical_layer}_{algorithm}"
    out = files["base"] / name
    cfg = _config(files, name, critical_layer=critical_layer, algorithm=algorithm,
                  quantize=quantize, lora_rank=2, rounds=2, lr=1e-2)  # fmt: skip
    summary = experiment.run_experiment(cfg, progress=False)
    head = 32 * 2 + 2  # the classifier: hidden 32 -> 2 labels, and its bias
    shared = _lora_count_by_hand(files["model"], 1 if critical_layer == 1 else 2, 2)
    shared += head if critical_layer is None else 0
    assert summary["global_params"] == shared
    records = _records(out)
    for r in records:
        assert r["bytes_up"] == r["bytes_down"] == 3 * wire_bytes * shared
    state, _ = RunCheckpointer(checkpoint_dir(out)).restore_untyped()
    pretrained = flatten_paths(load_pretrained(files["model"], num_labels=2, seed=0).params)
    frozen = flatten_paths(state["frozen"])
    assert set(frozen) == set(pretrained) - {"classifier/kernel", "classifier/bias"}
    for path, value in frozen.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(pretrained[path]), path)
    sent = flatten_paths(state["server_state"]["global_params"])
    assert all("_lora/" in p or p.startswith("classifier/") for p in sent)
    assert any(np.any(np.asarray(v)) for p, v in sent.items() if p.endswith("_lora/b"))  # trained
    local = flatten_paths(ClientStore(out / experiment.CLIENTS_DIR).load(0, at_most=2))
    want_local = set() if critical_layer is None else {
        f"encoder/layer_1/attention/{m}_lora/{x}" for m in ("query", "value") for x in "ab"
    } | {"classifier/kernel", "classifier/bias"}  # fmt: skip
    assert set(local) == want_local


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_lora_runs_checkpoints_hold_the_frozen_base_once_and_resume_and_export_from_it(
    files: dict[str, Path],
) -> None:
    """LoRA r = 16 on every dense layer of a 3-layer hidden-128 model, c = 1: the two kept
    checkpoints together take less than one copy of the frozen base plus twice the trained
    parameters' bytes (counted by hand from the config; the base alone is more than that, so a
    base in each checkpoint cannot pass). A copy taken back to round 2 resumes to the
    uninterrupted run's records and export, bit for bit; a per-run file that changed is a
    one-line error for --resume and for the export."""
    import shutil

    from fedjax_split.errors import UserError
    from fedjax_split.sim.client_store import load_tree, save_tree

    h, layers, r = 128, 3, 16
    model = write_tiny_model(files["base"] / "wide_model", num_layers=layers, hidden_size=h)
    cfg = json.loads((model / "config.json").read_text())
    i = cfg["intermediate_size"]
    emb = (cfg["vocab_size"] + cfg["max_position_embeddings"] + cfg["type_vocab_size"]) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    base = emb + layers * layer + (h * h + h)  # the pooler too: every base weight is frozen
    adapters = 4 * r * (h + h) + r * (h + i) + r * (i + h)  # q, k, v, attention out; in, out
    trained = layers * adapters + (2 * h + 2)  # layer 1's adapters global, the rest local + head
    assert 4 * base > 2 * 4 * trained  # a base copy per checkpoint would break the bound below
    name = "lora_once"
    run = files["base"] / name
    config = _config(files, name, model=str(model), critical_layer=1, lora_rank=r,
                     lora_targets="query|key|value|dense", rounds=3, lr=1e-2)  # fmt: skip
    summary = experiment.run_experiment(config, progress=False)
    assert summary["frozen_params"] == base and summary["global_params"] == adapters
    assert summary["local_params_per_client"] == trained - adapters
    ck = checkpoint_dir(run)
    assert sorted(p.name for p in ck.iterdir()) == ["2", "3", "per_run"]
    [per_run] = list((ck / "per_run").iterdir())
    assert _bytes_under(ck) < 4 * base + 2 * 4 * trained, _bytes_under(ck)

    copy = files["base"] / f"{name}_copy"
    shutil.copytree(run, copy)
    shutil.rmtree(checkpoint_dir(copy) / "3")
    experiment.run_experiment({**config, "output_dir": str(copy), "resume": True},
                              progress=False)  # fmt: skip
    timeless = [{k: v for k, v in x.items() if "seconds" not in k} for x in _records(run)]
    assert [{k: v for k, v in x.items() if "seconds" not in k}
            for x in _records(copy)] == timeless  # fmt: skip
    want = export.personalised_params(run, 1)[0]
    got = export.personalised_params(copy, 1)[0]
    chex.assert_trees_all_equal(want, got, strict=True)  # values, dtypes and shapes

    changed = load_tree(per_run)
    changed["embeddings"]["LayerNorm"]["scale"] = changed["embeddings"]["LayerNorm"]["scale"] + 1
    save_tree(checkpoint_dir(copy) / "per_run" / per_run.name, changed)
    for attempt in (
        lambda: experiment.run_experiment(
            {**config, "output_dir": str(copy), "resume": True}, progress=False
        ),
        lambda: export.personalised_params(copy, 1),
    ):
        with pytest.raises(UserError, match="sha256 differs") as err:
            attempt()
        assert "\n" not in str(err.value) and per_run.name in str(err.value)


def test_lora_with_client_level_dp_clips_and_noises_the_adapters(files: dict[str, Path]) -> None:
    """DP on a LoRA run: the accountant runs, the shared adapters are what is clipped (their
    update norms are recorded) and the base stays frozen."""
    name = "lora_dp"
    cfg = _config(files, name, critical_layer=1, lora_rank=2, dp_noise_multiplier=0.5,
                  dp_clip=0.01, dp_delta=1e-3)  # fmt: skip
    summary = experiment.run_experiment(cfg, progress=False)
    records = _records(files["base"] / name, private=True)
    assert 0 < records[0]["epsilon"] < records[1]["epsilon"]
    assert all(len(r["update_norms"]) == 3 for r in records)
    assert summary["frozen_params"] > 0 and summary["global_params"] == _lora_count_by_hand(
        files["model"], 1, 2
    )
    assert summary["label"] == "FedSplitBERT c=1 + LoRA r=2 + DP z=0.5"  # the legend's name


def test_fedbt_trains_from_layer_l_up_sends_only_that_and_keeps_the_rest_bit_identical(
    files: dict[str, Path],
) -> None:
    """--layer-schedule fedbt --cycle-factor 2 on the 2-layer model with FedAdam and an fp16 wire,
    3 rounds: rounds 1 and 3 train layer 2 + head, round 2 both layers + head (l = 1, 0, 1).
    Bytes by hand from config.json: down, both layers + head; up, only the round's trained part.
    A parameter a round does not train leaves it bit-identical (FedAdam's moments would move it
    otherwise), and the embeddings are the checkpoint's after every round."""
    from fedjax_split.fed.roles import flatten_paths
    from fedjax_split.models.hf_checkpoint import load_pretrained

    out = files["base"] / "fedbt"
    cfg = _config(files, "fedbt", layer_schedule="fedbt", cycle_factor=2, algorithm="fedadam",
                  quantize="fp16", rounds=3, keep_checkpoints=3, server_lr=1e-2)  # fmt: skip
    summary = experiment.run_experiment(cfg, progress=False)
    h = json.loads((files["model"] / "config.json").read_text())["hidden_size"]
    embeddings = _global_count_by_hand(files["model"], 0)
    layer = _global_count_by_hand(files["model"], 1) - embeddings
    head = (h * h + h) + (h * 2 + 2)  # pooler, classifier (2 labels)
    assert summary["global_params"] == 2 * layer + head
    assert summary["frozen_params"] == embeddings and summary["local_params_per_client"] == 0
    assert summary["label"] == "FedBT cycle 2 (FedAdam) + fp16 wire"  # the legend's name
    whole = embeddings + 2 * layer + head
    uploads = (layer + head, 2 * layer + head, layer + head)
    for r, trained in zip(_records(out), uploads, strict=True):
        assert r["bytes_down"] == 3 * 2 * (2 * layer + head)
        assert r["bytes_up"] == 3 * 2 * trained, r["round"]
        assert r["bert_fl_bytes_up"] == r["bert_fl_bytes_down"] == 3 * 2 * whole
        assert 0 < r["flops"] < r["bert_fl_flops"]
    assert summary["bytes_up_share_of_bert_fl"] == pytest.approx(
        (4 * layer + 3 * head) / (3 * whole))  # fmt: skip
    ckpt = RunCheckpointer(checkpoint_dir(out), max_to_keep=3)
    pretrained = flatten_paths(load_pretrained(files["model"], num_labels=2, seed=0).params)
    masters = {r: flatten_paths(ckpt.restore_untyped(r)[0]["server_state"]["master"])
               for r in (1, 2, 3)}  # fmt: skip
    masters[0] = {p: pretrained[p] for p in masters[1]}

    def same(a: int, b: int, prefix: str) -> bool:
        paths = [p for p in masters[a] if p.startswith(prefix)]
        return bool(paths) and all(
            np.array_equal(np.asarray(masters[a][p]), np.asarray(masters[b][p])) for p in paths)

    assert same(0, 1, "encoder/layer_0/") and same(2, 3, "encoder/layer_0/")  # not trained
    assert not same(1, 2, "encoder/layer_0/")  # round 2 trains it
    for r in (1, 2, 3):
        assert not same(r - 1, r, "encoder/layer_1/") and not same(r - 1, r, "classifier/")
    frozen = flatten_paths(ckpt.restore_untyped(3)[0]["frozen"])
    assert set(frozen) == {p for p in pretrained if p.startswith("embeddings/")}
    for path, value in frozen.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(pretrained[path]), path)


def test_a_fedavg_rounds_flops_are_three_forward_passes_of_its_real_steps(
    files: dict[str, Path], straight: Path
) -> None:
    """With every parameter trained (c = 1 here: the global and the local part both train), the
    backward pass costs two forward passes: the record's FLOPs are 3x the forward matmuls of the
    clients' real steps (`segment_train_flops`, the benchmarks' count), rebuilt from the config."""
    from fedjax_split.models.flops import segment_train_flops
    from fedjax_split.run import client_data
    from fedjax_split.sim.round_progress import real_counts

    setup = experiment.build(experiment.resolve_config(overrides=_config(
        files, "straight", rounds=4, local_epochs=2, critical_layer=1, seed=0)))  # fmt: skip
    for r in _records(straight):
        want = 0
        for c in r["clients_sampled"]:
            for seg in client_data.client_steps(setup.config, setup.model.task, setup.pool,
                                           setup.partition.clients[c].train, c, r["round"]):
                steps = real_counts(seg)[0]
                want += segment_train_flops(setup.model.config, seg) // seg.step_mask.size * steps
        assert r["flops"] == want and "bert_fl_flops" not in r


def test_a_truncated_model_trains_and_exports_its_first_layers(files: dict[str, Path]) -> None:
    """--model-layers 1 of the 2-layer model (FedAvg, c = L): one layer everywhere, counted by
    hand, and the export is a 1-layer model."""
    out = files["base"] / "truncated"
    summary = experiment.run_experiment(
        _config(files, "truncated", model_layers=1, critical_layer=None, rounds=1), progress=False
    )
    h = json.loads((files["model"] / "config.json").read_text())["hidden_size"]
    assert summary["num_layers"] == 1
    head = (h * h + h) + (2 * h + 2)  # pooler, classifier
    assert summary["global_params"] == _global_count_by_hand(files["model"], 1) + head
    exported = export.export_client(out, 0, files["base"] / "truncated_export")
    assert json.loads((exported / "config.json").read_text())["num_hidden_layers"] == 1


def test_fedbt_freezes_the_layers_below_its_cycle(files: dict[str, Path]) -> None:
    """--cycle-factor 1 of 2 layers: layer 1 is below the cycle, frozen with the embeddings (one
    copy, the checkpoint's, never sent); every round trains and uploads layer 2 and the head."""
    from fedjax_split.fed.roles import flatten_paths
    from fedjax_split.models.hf_checkpoint import load_pretrained

    out = files["base"] / "fedbt_c1"
    summary = experiment.run_experiment(
        _config(files, "fedbt_c1", layer_schedule="fedbt", cycle_factor=1, critical_layer=None),
        progress=False,
    )
    h = json.loads((files["model"] / "config.json").read_text())["hidden_size"]
    layer = _global_count_by_hand(files["model"], 1) - _global_count_by_hand(files["model"], 0)
    head = (h * h + h) + (h * 2 + 2)
    assert summary["global_params"] == layer + head
    assert summary["frozen_params"] == _global_count_by_hand(files["model"], 1)
    assert all(r["bytes_up"] == r["bytes_down"] == 3 * 4 * (layer + head) for r in _records(out))
    state, _ = RunCheckpointer(checkpoint_dir(out)).restore_untyped()
    pretrained = flatten_paths(load_pretrained(files["model"], num_labels=2, seed=0).params)
    frozen = flatten_paths(state["frozen"])
    layers = {p.split("/")[1] for p in frozen if p.startswith("encoder/")}
    assert layers == {"layer_0"}
    for path, value in frozen.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(pretrained[path]), path)


# Client-level DP's secret noise (fed/secret.py): what a run releases, resumes and publishes.
DP_FLAGS = {"critical_layer": 1, "dp_clip": 0.01, "dp_delta": 1e-3, "seed": 4,
            "checkpoint_every": 1, "keep_checkpoints": 2}  # fmt: skip


def _released(run_dir: Path, round_: int) -> dict[str, np.ndarray]:
    """The global part the server released after `round_` (its checkpoint's server state)."""
    from fedjax_split.fed.roles import flatten_paths

    arrays, _ = RunCheckpointer(checkpoint_dir(run_dir)).restore_untyped(round_)
    return {p: np.asarray(v, np.float64)
            for p, v in flatten_paths(arrays["server_state"]["global_params"]).items()}


def _seed_noise(seed: int, round_: int, like: dict[str, np.ndarray], z: float, clip: float,
                denominator: float) -> dict[str, np.ndarray]:
    """The attack on the noise as it was drawn before fed/secret.py: everything from config.json
    (the seed, z, C, M) and the round. The server's key was fold_in(fold_in(key(seed), round),
    2^32 - 1), split into the updates' and the count's keys, then one fold_in per leaf in the
    tree's order (fed.privacy.noise_like); the result on the mean is noise * z * C / M."""
    from fedjax_split.fed.roles import flatten_paths, unflatten_paths

    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), round_), np.uint32(2**32 - 1))
    noise_key = jax.random.split(key)[0]
    tree = unflatten_paths({p: np.zeros(v.shape, np.float32) for p, v in like.items()})
    leaves, treedef = jax.tree.flatten(tree)
    drawn = [np.asarray(jax.random.normal(jax.random.fold_in(noise_key, i), np.shape(x),
                                          np.float32), np.float64) * z * clip / denominator
             for i, x in enumerate(leaves)]  # fmt: skip
    return flatten_paths(jax.tree.unflatten(treedef, drawn))


def test_dp_noise_is_secret_each_run_draws_its_own_and_the_seed_does_not_regenerate_it(
    files: dict[str, Path],
) -> None:
    """Two runs of one config and seed: with z > 0 they release different global parts (each
    run's own secret noise); with z = 0 the same ones. The attack that worked before (regenerate
    the noise from config.json's seed and subtract it from the released part, against the same
    run without noise) recovers nothing now; under --dp-insecure-reproducible-noise the noise
    does follow the seed, as the flag says."""
    runs = {}
    for name, z, extra in (("dp_a", 1.0, {}), ("dp_b", 1.0, {}), ("dp_z0_a", 0.0, {}),
                           ("dp_z0_b", 0.0, {}),
                           ("dp_insecure_a", 1.0, {"dp_insecure_reproducible_noise": True}),
                           ("dp_insecure_b", 1.0, {"dp_insecure_reproducible_noise": True})):
        cfg = _config(files, name, rounds=1, dp_noise_multiplier=z, **DP_FLAGS, **extra)
        experiment.run_experiment(cfg, progress=False)
        runs[name] = _released(files["base"] / name, 1)
    paths = sorted(runs["dp_a"])

    def differ(a: str, b: str) -> float:
        return max(float(np.abs(runs[a][p] - runs[b][p]).max()) for p in paths)

    assert differ("dp_z0_a", "dp_z0_b") == 0.0  # no noise: the clients' training is the seed's
    assert differ("dp_insecure_a", "dp_insecure_b") == 0.0  # the opt-out: the seed's noise
    assert differ("dp_a", "dp_b") > 1e-3  # each run's own secret noise (z C / M = 0.0033)
    # the noise each run added: its release minus the noiseless run's
    noise = {n: {p: runs[n][p] - runs["dp_z0_a"][p] for p in paths} for n in ("dp_a", "dp_b")}
    for n in ("dp_a", "dp_b"):
        flat = np.concatenate([noise[n][p].ravel() for p in paths])
        assert flat.std() == pytest.approx(1.0 * 0.01 / 3, rel=0.05)
    # the regeneration attack, from config.json alone
    saved = json.loads((files["base"] / "dp_a" / "config.json").read_text())
    guess = _seed_noise(saved["seed"], 1, runs["dp_a"], saved["dp_noise_multiplier"],
                        saved["dp_clip"], saved["clients"])  # fmt: skip
    for n in ("dp_a", "dp_b"):
        resid = np.concatenate([(noise[n][p] - guess[p]).ravel() for p in paths])
        flat = np.concatenate([noise[n][p].ravel() for p in paths])
        # subtracting the guess does not remove the noise: it adds as much again
        assert resid.std() == pytest.approx(np.sqrt(2) * flat.std(), rel=0.05)
    # nothing published or configured holds the secret: it is in the checkpoint alone
    secret = RunCheckpointer(checkpoint_dir(files["base"] / "dp_a")).restore_untyped(1)[0][
        "dp_secret"]  # fmt: skip
    hexed = np.asarray(secret, np.uint8)[:-1].tobytes().hex()
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        text = (files["base"] / "dp_a" / name).read_text()
        assert hexed not in text and "dp_secret" not in text


def test_a_dp_run_resumes_with_its_own_secret_to_the_uninterrupted_result(
    files: dict[str, Path],
) -> None:
    """A DP run's secret is in its checkpoints: a copy of the run taken back to round 1's
    checkpoint and resumed draws the noise and Poisson sample the uninterrupted run drew, bit for
    bit (a fresh secret would draw others: the test above)."""
    import shutil

    name = "dp_resume"
    cfg = _config(files, name, rounds=3, dp_noise_multiplier=0.15, clients_per_round=2,
                  dp_clip_quantile=0.5, **{**DP_FLAGS, "keep_checkpoints": 3})  # fmt: skip
    experiment.run_experiment(cfg, progress=False)
    run = files["base"] / name
    copy = files["base"] / f"{name}_copy"
    shutil.copytree(run, copy)
    for r in (2, 3):
        shutil.rmtree(checkpoint_dir(copy) / str(r))
    experiment.run_experiment({**cfg, "output_dir": str(copy), "resume": True}, progress=False)

    def timeless(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in records]

    assert timeless(_records(copy, private=True)) == timeless(_records(run, private=True))
    assert timeless(_records(copy)) == timeless(_records(run))
    for p, v in _released(run, 3).items():
        np.testing.assert_array_equal(_released(copy, 3)[p], v)


def test_a_dp_run_publishes_no_per_client_figure_unless_asked(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With DP, metrics.jsonl and summary.json hold what the guarantee covers and the means over
    clients (named as outside it); the sample, each client's norm, loss and metrics are in the
    server-private private/clients.jsonl, a folder only its owner can read.
    --dp-publish-clients writes them as without DP, and the summary says the guarantee excludes
    them."""
    import stat

    from fedjax_split.run import plots, safeguards

    drawn: list = []  # the records each plot.png is drawn from: the published ones
    figure = plots.run_figure
    monkeypatch.setattr(plots, "run_figure", lambda records, *a: drawn.append(records) or
                        figure(records, *a))  # fmt: skip
    cfg = _config(files, "dp_private", dp_noise_multiplier=0.5, **DP_FLAGS)
    summary = experiment.run_experiment(cfg, progress=False)
    assert drawn and not any("clients" in r for records in drawn for r in records)
    run = files["base"] / "dp_private"
    public, private = _records(run), _records(run, private=True)
    assert len(public) == len(private) == 2
    for pub, full in zip(public, private, strict=True):
        assert not set(safeguards.PER_CLIENT) & set(pub)
        assert {"clients_sampled", "update_norms", "train_loss_clients"} <= set(full)
        assert pub["num_rejected"] == len(full["clients_rejected"]) == 0
        assert pub == {k: v for k, v in full.items()
                       if k not in safeguards.PER_CLIENT} | {"num_rejected": 0}  # fmt: skip
    assert "clients" in private[-1] and "accuracy" in public[-1]  # evaluated: means published
    assert stat.S_IMODE((run / "private").stat().st_mode) == 0o700
    # each client's examples and label shares are the server's too; the export still finds them
    assert (run / "private" / "partition.json").is_file() and not (run / "partition.json").exists()
    note = export.skew_note(run, 0)
    assert note is not None and note.startswith("client 0's data are")
    on_disk = json.loads((run / "summary.json").read_text())
    assert "clients" not in on_disk["final"] and "clients" not in summary["final"]
    # one client's figure stays private too; the gain is a mean over clients, published
    for final in (on_disk["final"], summary["final"]):
        assert not {"worst_client", "p10_client", "global_clients"} & set(final)
        assert "accuracy" in final["personalization_gain"]
    assert "worst_client" in private[-1] and "global_clients" in private[-1]
    privacy = on_disk["privacy"]
    assert privacy["per_client_figures"] == "private/clients.jsonl"
    assert privacy["noise"].startswith("secret") and "global parts" in privacy["covers"]
    assert any("evaluation" in x for x in privacy["not_covered"])

    cfg = _config(files, "dp_public", dp_noise_multiplier=0.5, dp_publish_clients=True, **DP_FLAGS)
    experiment.run_experiment(cfg, progress=False)
    run = files["base"] / "dp_public"
    assert all("update_norms" in r and "clients_sampled" in r for r in _records(run))
    assert not (run / "private").exists() and (run / "partition.json").is_file()
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["per_client_figures"] == "metrics.jsonl"
    assert any("--dp-publish-clients" in x for x in privacy["not_covered"])
