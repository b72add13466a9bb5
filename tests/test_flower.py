"""A real Flower federation on 127.0.0.1 (SuperLink + 3 SuperNodes as processes, `flwr run`)
against the in-process simulation of the same config and seed.

Each run goes through `python -m fedjax_split.flower`, which starts the processes, bounds them in
time and kills every one of them when it ends; the simulation goes through `python -m
fedjax_split.train` in the same environment (same XLA flags, same JAX compilation cache), so both
compile the same programs. A node computes exactly the simulation's programs for its client and
the server the simulation's aggregation and server step, so the comparison is bitwise: every
number in metrics.jsonl except the times (JSON floats carry every bit of a float64).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    NER_TYPES,
    SITES,
    cli_env,
    conll_sentences,
    private_cache,
    tiny_args,
    tsv_rows,
    write_tiny_model,
    write_tiny_ner_sites,
    write_tiny_sites,
    write_tiny_sst2,
)

from fedjax_split.deploy import protocol

pytestmark = pytest.mark.xdist_group("federation")  # one at a time: see pyproject.toml

# one batch per client and epoch (clients hold ~32 examples): one shape, few compilations
FAST = {"batch_size": 32, "local_epochs": 2, "rounds": 2}
FLOWER_ONLY = {"clients_failed", "eval_failed", "eval_bytes_down"}
SIMULATION_ONLY = {"pooled"}  # c = L: the global model on every client's test set (no node sends
# its predictions, only its metrics)
TIMEOUT = 240  # seconds for one command; the CLI kills its federation when it ends


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("flower")
    proc_env = cli_env(jax_cache=base / "jax_cache")
    return {
        "base": base,
        "model": write_tiny_model(base / "model"),
        "data": write_tiny_sst2(base / "data"),
        "env": proc_env,
    }


def _run(env: dict, module: str, args: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    """The command to its end; past TIMEOUT, it and every process of its federation are killed
    (they carry its --output-dir in their environment) and the test fails."""
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            env={**env["env"], **extra_env},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=env["base"],
        )
    except BaseException:
        out = next((a.split("=", 1)[1] for a in args if a.startswith("--output-dir=")), None)
        if out is not None:
            _kill_marked(out)
        raise


def _args(env: dict, out: Path, **extra: object) -> list[str]:
    return tiny_args(env["model"], env["data"], out, **{**FAST, **extra})


def _metrics(run: Path, private: bool = False) -> list[dict]:
    """metrics.jsonl's records; with `private`, every figure: a DP run's server-private file
    where it has one."""
    path = run / "private" / "clients.jsonl"
    path = path if private and path.is_file() else run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not k.endswith("seconds") and k not in FLOWER_ONLY | SIMULATION_ONLY}  # fmt: skip


def _simulate(env: dict, name: str, **flags: object) -> Path:
    out = env["base"] / name
    res = _run(env, "fedjax_split.train", _args(env, out, **flags))
    assert res.returncode == 0, res.stderr
    return out


def _marked(marker: str) -> list:
    """Processes other than this one whose command line or environment holds `marker`."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + json.dumps(p.info["environ"] or {})
        except (psutil.Error, TypeError):
            continue
        if marker in text and p.pid != os.getpid():
            found.append(p)
    return found


def _kill_marked(marker: str) -> None:
    """SIGKILL whatever of a federation is still running (a test that failed midway)."""
    import psutil

    for p in _marked(marker):
        try:
            p.kill()
        except psutil.Error:
            pass


def _no_processes_left(marker: str) -> None:
    """No process of the federation survived its command (the launcher puts the run's directory,
    `marker`, in the environment of every process it starts, which their children inherit)."""
    left = [(p.pid, p.info["cmdline"]) for p in _marked(marker)]
    assert not left, left


def _clean_logs(run: Path) -> None:
    """Every log of the federation has one clean line per event: no colour codes, no Flower
    record printed a second time in Python's default format (`INFO:flwr:...`), no raw
    `file.py:N: UserWarning` lines, and (in the run's and the nodes' logs) no line twice in a
    row. (The SuperLink may log two like events alike: two nodes' pushes.)"""
    logs = sorted((run / "flower" / "logs").glob("*.log"))
    assert {p.name for p in logs} >= {"superlink.log", "supernode-0.log", "run-1.log"}
    for path in logs:
        text = path.read_text()
        assert "\x1b" not in text, path
        assert not re.search(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):flwr:", text, re.M), path
        assert not re.search(r"\.py:\d+: \w*Warning:", text), path
        if path.name != "superlink.log":
            lines = text.splitlines()
            twice = [a for a, b in zip(lines, lines[1:], strict=False) if a == b]
            assert not twice, (path, twice)


def _local_paths_and_digests(run: Path) -> tuple[set[str], set[str]]:
    """Every local-part path, and the sha256 of every local array the nodes ever held."""
    paths, digests = set(), set()
    for f in (run / "flower" / "nodes").rglob("round_*.npz"):
        with np.load(f) as z:
            for k in z.files:
                paths.add(k)
                digests.add(hashlib.sha256(np.ascontiguousarray(z[k]).tobytes()).hexdigest())
    return paths, digests


def _same_exports(env: dict, run: Path, sim: Path, client: int, node: int) -> None:
    """Client `client`'s personalised model exported three ways is the same tensor for tensor,
    bit for bit: from the simulation's run, from the launcher's run (the checkpoint and the local
    part on node `node`), and at the site from that node's state dir alone."""
    from safetensors.numpy import load_file

    from fedjax_split.export import export_client

    base = env["base"] / f"export_{run.name}"
    outs = {
        "simulation": export_client(sim, client, base / "simulation"),
        "launcher": export_client(run, client, base / "launcher"),
        "site": export_client(
            None, client, base / "site", state_dir=run / "flower" / "nodes" / f"node_{node}"
        ),
    }
    models = {k: load_file(str(Path(v) / "model.safetensors")) for k, v in outs.items()}
    want = models.pop("simulation")
    assert want and all(m.keys() == want.keys() for m in models.values())
    for name, got in models.items():
        for key, x in want.items():
            assert got[key].dtype == x.dtype and np.array_equal(got[key], x), (name, key)


def test_fp16_split_run_equals_simulation_and_a_restarted_server_resumes(env: dict) -> None:
    """c=1 of 2 with an fp16 wire (FedAvg): stopped after round 1's checkpoint (the server and
    every node go away), then restarted with --resume: every round equals the simulation's.
    (Evaluation in round 2 only: each evaluation is one more message exchange, seconds here.)"""
    flags = {"quantize": "fp16", "critical_layer": 1, "eval_every": 2}
    out = env["base"] / "fp16"
    record_dir = env["base"] / "sent"
    record = {protocol.RECORD_ENV: str(record_dir)}
    res = _run(env, "fedjax_split.flower", _args(env, out, **flags),
               FEDJAX_SPLIT_STOP_AFTER_ROUND="1", **record)  # fmt: skip
    assert res.returncode == 130, res.stderr
    assert "last checkpoint: round 1" in res.stderr
    assert [r["round"] for r in _metrics(out)] == [1]
    assert not (out / "summary.json").exists()
    _no_processes_left(str(out))

    res = _run(env, "fedjax_split.flower", [*_args(env, out, **flags), "--resume"], **record)
    assert res.returncode == 0, res.stderr
    done = (r"^done: \d+ rounds on \d+ SuperNodes, accuracy \d\.\d{4} \(mean over clients; "
            r"worst client \d\.\d{4}, 10th percentile \d\.\d{4}, personalisation gain "
            r"[+-]\d\.\d{4}\); ")  # fmt: skip
    assert re.search(done + r"[\d.]+ MB sent; results in ", res.stdout, re.M), res.stdout
    _no_processes_left(str(out))
    sim = _simulate(env, "fp16_sim", **flags)

    got, want = _metrics(out), _metrics(sim)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    assert all(r["clients_failed"] == [] and r["eval_failed"] == [] for r in got)
    assert got[0]["bytes_up"] > 0 and got[1]["accuracy"] is not None
    # the last evaluation's global model on each client (the nodes' initial local part) and
    # the gain: the simulation's, compared above with the rest of the record
    assert len(got[1]["global_clients"]) == 3 and "accuracy" in got[1]["personalization_gain"]
    assert (out / "partition.json").read_text() == (sim / "partition.json").read_text()
    cfg_got = json.loads((out / "config.json").read_text())
    cfg_want = json.loads((sim / "config.json").read_text())
    for key in ("output_dir", "resume", "model", "data_dir"):
        cfg_got.pop(key), cfg_want.pop(key)
    assert cfg_got == cfg_want
    summary = json.loads((out / "summary.json").read_text())
    assert summary["deploy"] == "flower" and summary["rounds"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1", "2"]
    _clean_logs(out)

    # What crossed the wire: the global part (fp16 as uint16 bits) down and up, never a local one.
    sent = [json.loads(x) for f in record_dir.glob("*.jsonl") for x in f.read_text().splitlines()]
    kinds = {(e["sender"], e["type"]) for e in sent}
    assert kinds >= {("server", "train"), ("client", "train"), ("server", "evaluate")}
    local_paths, local_digests = _local_paths_and_digests(out)
    assert local_paths and any(p.startswith("classifier") for p in local_paths)
    arrays = [a for e in sent for a in e["arrays"]]
    assert arrays and all(a["dtype"] == "uint16" for a in arrays)
    assert not {a["path"] for a in arrays} & local_paths
    global_part = ("embeddings/", "encoder/layer_0/")
    assert all(a["path"].startswith(global_part) for a in arrays)
    assert not {a["sha256"] for a in arrays} & local_digests
    _same_exports(env, out, sim, client=1, node=1)


def _server_sent(record_dir: Path) -> list[list[tuple[str, int, int | None, int]]]:
    """Per server process (in the order they ran): each message it sent as (type, round, the
    round whose evaluation it carries or None, client)."""
    runs = []
    for f in sorted(record_dir.glob("server-*.jsonl"), key=lambda f: f.stat().st_mtime):
        sent = []
        for e in (json.loads(x) for x in f.read_text().splitlines()):
            cfg = e["config_values"].get(protocol.CONFIG, {})
            if e["type"] in ("train", "evaluate"):
                carried = cfg.get(protocol.EVAL_ROUND)
                carried = None if carried is None else int(carried)
                r, client = int(cfg[protocol.ROUND]), int(cfg[protocol.CLIENT])
                sent.append((e["type"], r, carried, client))
        runs.append(sent)
    return runs


def test_evaluation_rides_in_the_next_train_message_and_a_stopped_run_resumes(env: dict) -> None:
    """Evaluation every round, 2 of 3 clients a round: round r's evaluation goes in round r+1's
    train message to each client sampled in r+1, an evaluate message only to the client that is
    not, and the last round's evaluation goes alone; one exchange a round. Stopped after round 1
    (whose evaluation went with round 2's training: the nodes trained round 2, the stopping server
    drops it), then resumed: round 2 is trained again and every round equals the simulation's."""
    flags = {"quantize": "fp16", "critical_layer": 1, "rounds": 3, "eval_every": 1,
             "clients_per_round": 2}  # fmt: skip
    out, record_dir = env["base"] / "carried", env["base"] / "carried_sent"
    record = {protocol.RECORD_ENV: str(record_dir)}
    res = _run(env, "fedjax_split.flower", _args(env, out, **flags),
               FEDJAX_SPLIT_STOP_AFTER_ROUND="1", **record)  # fmt: skip
    assert res.returncode == 130, res.stderr
    assert [r["round"] for r in _metrics(out)] == [1]
    res = _run(env, "fedjax_split.flower", [*_args(env, out, **flags), "--resume"], **record)
    assert res.returncode == 0, res.stderr
    _no_processes_left(str(out))
    sim = _simulate(env, "carried_sim", **flags)
    got, want = _metrics(out), _metrics(sim)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    assert all(r["clients_failed"] == [] == r["eval_failed"] for r in got)
    assert all(len(r["clients"]) == 3 for r in got)  # every client evaluated, every round

    sampled = {r["round"]: set(r["clients_sampled"]) for r in got}
    assert all(len(c) == 2 for c in sampled.values())
    first, second = _server_sent(record_dir)

    def expected(rounds: range) -> list[tuple[str, int, int | None, int]]:
        """What a server sends from round rounds[0]'s training on (one message a client)."""
        msgs = [("train", rounds[0], None, c) for c in sorted(sampled[rounds[0]])]
        for r in rounds:
            nxt = sampled.get(r + 1, set())
            msgs += [("train", r + 1, r, c) for c in sorted(nxt)]
            msgs += [("evaluate", r, None, c) for c in range(3) if c not in nxt]
        return msgs

    assert sorted(first) == sorted(expected(range(1, 2)))  # round 2's training went, then stop
    assert sorted(second) == sorted(expected(range(2, 4)))  # round 2 again, round 3, alone: 3
    # evaluation's own bytes: one global part (of the two a round sends) in rounds 1 and 2
    one = got[0]["bytes_down"] // 2
    assert [r["eval_bytes_down"] for r in got] == [one, one, 3 * one]


def test_fedadam_run_equals_simulation_and_a_killed_node_is_left_out(env: dict) -> None:
    """FedAdam on a bfloat16 wire: rounds 1-2 equal the simulation's; SuperNode 2 is killed
    while round 3 waits for it: the round gives up on it (its timeout, or Flower's missed
    heartbeats), aggregates clients 0 and 1, records 2 as failed, and the run finishes (no hang)."""
    flags = {"algorithm": "fedadam", "quantize": "bf16", "critical_layer": 1, "rounds": 3,
             "eval_every": 3}  # fmt: skip
    out = env["base"] / "adam"
    # the timeout every round has: round 1 compiles on the nodes, which on a loaded 2-core
    # machine took over 30 s (clients 0 and 2 left out of round 1, the comparison failed)
    args = [*_args(env, out, **flags), "--round-timeout", "60"]
    err_path = env["base"] / "adam.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedjax_split.flower", *args],
            env=env["env"],
            cwd=env["base"],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + TIMEOUT
            metrics = out / "metrics.jsonl"
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
                assert proc.poll() is None and time.monotonic() < deadline, "round 2 never ended"
                time.sleep(0.1)
            _kill_supernode(str(out / "flower" / "nodes" / "node_2"))
            assert proc.wait(timeout=TIMEOUT) == 0, err_path.read_text()[-3000:]
        except BaseException:
            _kill_marked(str(out))
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = err_path.read_text()
    _no_processes_left(str(out))
    # the round gives up on it: its timeout, or first Flower's missed heartbeats
    gave_up = r"round 3: client 2 failed \((no reply within 60 s|.*Node Unavailable)"
    assert re.search(gave_up, stderr), stderr[-2000:]

    got = _metrics(out)
    sim = _metrics(_simulate(env, "adam_sim", **{**flags, "rounds": 2, "eval_every": 3}))
    # the simulation's last round (2) evaluates; the federation's round 2 did not (it had a 3rd)
    assert [_comparable(r) for r in got[:1]] == [_comparable(r) for r in sim[:1]]
    no_eval = {"accuracy", "f1", "clients", "trained_mean", "eval_seconds", "worst_client",
               "p10_client", "global_clients", "personalization_gain"}  # fmt: skip
    assert {k: v for k, v in _comparable(got[1]).items() if k not in no_eval} == {
        k: v for k, v in _comparable(sim[1]).items() if k not in no_eval
    }
    last = got[2]
    assert last["clients_sampled"] == [0, 1, 2] and last["clients_failed"] == [2]
    assert last["eval_failed"] == [2] and [c["client"] for c in last["clients"]] == [0, 1]
    assert [c["client"] for c in last["global_clients"]] == [0, 1]  # the gain over those two
    assert len(last["train_loss_clients"]) == 2
    assert last["bytes_up"] == 2 * got[1]["bytes_up"] // 3  # two uploads arrived
    assert last["bytes_down"] == got[1]["bytes_down"]  # three were sent


def _federation_equals_simulation(
    env: dict, name: str, flags: dict
) -> tuple[Path, Path, list[dict]]:
    """Runs `flags` as a Flower federation (every message recorded) and as a simulation, checks
    that every round's figures are the same and that no client failed or was rejected; returns
    both run directories and what was sent."""
    out, record_dir = env["base"] / name, env["base"] / f"{name}_sent"
    res = _run(env, "fedjax_split.flower", _args(env, out, **flags),
               **{protocol.RECORD_ENV: str(record_dir)})  # fmt: skip
    assert res.returncode == 0, res.stderr
    _no_processes_left(str(out))
    sim = _simulate(env, f"{name}_sim", **flags)
    got, want = _metrics(out), _metrics(sim)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    got, want = _metrics(out, private=True), _metrics(sim, private=True)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    assert all(r["clients_failed"] == [] == r["clients_rejected"] for r in got)
    sent = [json.loads(x) for f in record_dir.glob("*.jsonl") for x in f.read_text().splitlines()]
    return out, sim, sent


def test_dp_run_equals_simulation_clipping_at_the_nodes_noise_at_the_server(env: dict) -> None:
    """Client-level DP on Flower (Poisson sampling at 2/3, adaptive clipping, noise z = 0.1)
    under --dp-insecure-reproducible-noise, so that two runs draw one noise: every round equals
    the simulation's, epsilon and the clip norm included. The server sends each round's clip norm
    down, each node clips its own update and reports the update's norm before clipping; the
    noise is the server's."""
    flags = {"critical_layer": 1, "rounds": 2, "eval_every": 2, "clients_per_round": 2,
             "dp_noise_multiplier": 0.1, "dp_clip": 0.05, "dp_clip_quantile": 0.5,
             "dp_delta": 1e-3, "dp_insecure_reproducible_noise": True}  # fmt: skip
    out, sim, sent = _federation_equals_simulation(env, "dp", flags)
    got = _metrics(out, private=True)
    epsilons = [r["epsilon"] for r in got]
    assert 0 < epsilons[0] < epsilons[1]
    assert got[0]["dp_clip"] == float(np.float32(0.05))  # the server state holds it in fp32
    assert got[1]["dp_clip"] != got[0]["dp_clip"]  # adaptive: a new clip norm each round
    summary = json.loads((out / "summary.json").read_text())
    sim_summary = json.loads((sim / "summary.json").read_text())
    assert summary["privacy"] == sim_summary["privacy"]
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilons[-1], abs=1e-4)  # rounded
    trains = [e for e in sent if e["type"] == "train"]
    server_cfg = {k for e in trains if e["sender"] == "server" for k in e["configs"]["config"]}
    assert protocol.DP_CLIP in server_cfg
    replies = [e for e in trains if e["sender"] == "client"]
    assert replies and all(protocol.UPDATE_NORM in e["metrics"]["metrics"] for e in replies)
    assert all(len(r["clients_sampled"]) == len(r["train_loss_clients"]) for r in got)


def test_lora_run_equals_simulation_and_sends_only_the_shared_adapters(env: dict) -> None:
    """LoRA r = 2 at c = 1 of 2 with an fp16 wire: every round equals the simulation's; what
    crosses the wire is the first layer's adapters only, never a base weight, a local adapter or
    the head, and the uploads are exactly the bytes the record reports. The base is stored once
    (the server's per-run file), never on a node."""
    flags = {"critical_layer": 1, "eval_every": 2, "quantize": "fp16", "lora_rank": 2,
             "lr": 1e-2}  # fmt: skip
    out, sim, sent = _federation_equals_simulation(env, "lora", flags)
    _same_exports(env, out, sim, client=2, node=2)  # the frozen base weights merged in
    # the base once, in the server's checkpoints; no node copies it (the site export rebuilds it
    # from the node's model), and the 3 nodes' alike global parts are one file on this disk
    assert len(list((out / "checkpoints" / "per_run").iterdir())) == 1
    nodes = out / "flower" / "nodes"
    assert not list(nodes.rglob("frozen.npz")) and not list(nodes.rglob("initial.npz"))
    kept = list(nodes.rglob("global_after_*.npz"))
    assert len(kept) == 3 and len({p.stat().st_ino for p in kept}) == 1
    got = _metrics(out)
    adapters = {f"encoder/layer_0/attention/{m}_lora/{x}" for m in ("query", "value") for x in "ab"}
    for e in sent:
        if e["type"] == "train":
            assert {a["path"] for a in e["arrays"]} == adapters, e["sender"]
    uploads = [e for e in sent if e["type"] == "train" and e["sender"] == "client"]
    wire = sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
               for e in uploads for a in e["arrays"])  # fmt: skip
    assert wire == sum(r["bytes_up"] for r in got)
    local_paths, _ = _local_paths_and_digests(out)
    assert local_paths and not local_paths & adapters
    assert local_paths - {"__dtypes__"} == {
        f"encoder/layer_1/attention/{m}_lora/{x}" for m in ("query", "value") for x in "ab"
    } | {"classifier/kernel", "classifier/bias"}  # fmt: skip


def test_fedbt_run_equals_simulation_and_uploads_only_the_rounds_layers(env: dict) -> None:
    """FedBT (cycle 2 of 2 layers) with FedAdam and an fp16 wire: every round equals the
    simulation's, its FLOP counts and BERT-FL's included; each round's TRAIN message says the
    paths it trains, a node uploads exactly those (layer 2 + head in rounds 1 and 3, both layers
    + head in round 2), and the frozen embeddings never travel."""
    flags = {"layer_schedule": "fedbt", "cycle_factor": 2, "critical_layer": "L", "rounds": 3,
             "eval_every": 3,
             "algorithm": "fedadam", "quantize": "fp16"}  # fmt: skip
    out, sim, sent = _federation_equals_simulation(env, "fedbt", flags)
    _same_exports(env, out, sim, client=1, node=1)
    got = _metrics(out)
    assert all(r["flops"] < r["bert_fl_flops"] for r in got)
    uploads = [e for e in sent if e["type"] == "train" and e["sender"] == "client"]
    layers = []  # each upload's encoder layers (the record does not say its round)
    for e in uploads:
        paths = {a["path"] for a in e["arrays"]}
        assert all(p.startswith(("encoder/", "pooler/", "classifier/")) for p in paths), e
        assert {"pooler/dense/kernel", "classifier/kernel"} <= paths
        layers.append(tuple(sorted({int(p.split("/")[1][6:]) for p in paths if "/layer_" in p})))
    assert sorted(layers) == [(0, 1)] * 3 + [(1,)] * 6  # rounds 1 and 3: layer 2; round 2: both
    wire = sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
               for e in uploads for a in e["arrays"])  # fmt: skip
    assert wire == sum(r["bytes_up"] for r in got)
    assert not any(a["path"].startswith("embeddings/") for e in sent for a in e["arrays"])


def test_sites_with_their_own_data_federation_equals_simulation(env: dict) -> None:
    """--site-data: three sites of different sizes and label skews. SuperNode k is given site
    k's directory alone (its node config's data-dir) and the server none (its run config says
    `node-config`); every round equals the simulation of the same sites, partition.json too,
    and each client trains on exactly its site's train file."""
    dirs = write_tiny_sites(env["base"] / "sites")
    flags = {"data_dir": None, "clients": None, "site_data": ",".join(map(str, dirs)),
             "critical_layer": 1, "eval_every": 2}  # fmt: skip
    out, sim, sent = _federation_equals_simulation(env, "sites", flags)
    assert (out / "partition.json").read_text() == (sim / "partition.json").read_text()
    assert json.loads((out / "config.json").read_text())["site_data"] == "node-config"
    doc = json.loads((out / "partition.json").read_text())
    assert doc["scheme"] == "sites" and len(doc["clients"]) == 3
    for k, (site, d) in enumerate(zip(SITES, dirs, strict=True)):
        train, test = (len(doc["clients"][k][s]) for s in ("train", "test"))
        if site["n_dev"]:
            assert (train, test) == (tsv_rows(d / "train.tsv"), tsv_rows(d / "dev.tsv")), k
        else:  # no dev file: a fifth of the train file tests
            rows = tsv_rows(d / "train.tsv")
            assert (train, test) == (rows - int(rows / 5 + 0.5), int(rows / 5 + 0.5)), k
        # node k tokenised its own site's rows and nothing else
        cached = list((out / "flower" / "nodes" / f"node_{k}" / "tokenized").glob("*.npz"))
        with np.load(cached[0]) as z:
            assert len(cached) == 1 and z["lengths"].size == train + test, k
    trains = [e for e in sent if e["type"] == "train" and e["sender"] == "client"]
    assert trains and all(protocol.NUM_TRAIN in e["metrics"]["metrics"] for e in trains)
    _same_exports(env, out, sim, client=2, node=2)  # a site's model, exported at the site too


def test_ner_sites_federation_equals_simulation(env: dict) -> None:
    """NER sites (CoNLL files, --entity-types): every round equals the simulation's,
    partition.json too (its share columns named from the config), and the tag names are the
    config's: the server's head is as wide as the nodes'."""
    dirs = write_tiny_ner_sites(env["base"] / "ner_sites")
    flags = {"task": "ner", "entity_types": NER_TYPES, "data_dir": None, "clients": None,
             "site_data": ",".join(map(str, dirs)), "critical_layer": 1, "rounds": 1}  # fmt: skip
    out, sim, _ = _federation_equals_simulation(env, "ner_sites", flags)
    assert (out / "partition.json").read_text() == (sim / "partition.json").read_text()
    doc = json.loads((out / "partition.json").read_text())
    assert doc["label_names"] == ["neg", "pos", "(none)"] and doc["realised_shares"]
    assert [len(c["train"]) for c in doc["clients"][::2]] == [
        conll_sentences(d / "train.txt") for d in dirs[::2]]  # the sites with a test file


def test_two_supernodes_of_two_clients_each_equal_the_simulation(env: dict) -> None:
    """--supernodes 2 for 4 clients: SuperNode j holds a block of clients (partition-ids=0-1,
    2-3), trains each of them when sampled and keeps each one's local part; every round equals
    the simulation's, and a client's model exports as the simulation's does."""
    flags = {"clients": 4, "eval_every": 2, "quantize": "fp16"}
    out = env["base"] / "blocks"
    res = _run(env, "fedjax_split.flower", [*_args(env, out, **flags), "--supernodes=2"])
    assert res.returncode == 0, res.stderr
    assert " on 2 SuperNodes, " in res.stdout
    _no_processes_left(str(out))
    sim = _simulate(env, "blocks_sim", **flags)
    got = _metrics(out)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in _metrics(sim)]
    assert all(r["clients_failed"] == [] and len(r["clients_sampled"]) == 4 for r in got)
    nodes = out / "flower" / "nodes"
    assert sorted(p.name for p in nodes.iterdir()) == ["node_0", "node_1"]
    for j, clients in enumerate(([0, 1], [2, 3])):
        kept = sorted(d.name for d in nodes.glob(f"node_{j}/*/client_*"))
        assert kept == [f"client_{c}" for c in clients]
    _same_exports(env, out, sim, client=3, node=1)


def test_clients_in_blocks_over_fewer_supernodes() -> None:
    from fedjax_split.flower import node_blocks, node_configs

    assert node_blocks(4, 2) == [[0, 1], [2, 3]]
    assert node_blocks(5, 3) == [[0, 1], [2, 3], [4]]
    assert node_blocks(3, 3) == [[0], [1], [2]]
    assert node_blocks(100, 3)[0] == list(range(34)) and node_blocks(100, 3)[2][-1] == 99
    nodes = node_configs(Path("/f"), 5, 3)
    assert [n.get(protocol.PARTITION_IDS, n.get(protocol.PARTITION_ID)) for n in nodes] == [
        "0-1", "2-3", 4]  # fmt: skip
    assert nodes[2][protocol.STATE_DIR] == "/f/nodes/node_2"


def _kill_supernode(state_dir: str) -> None:
    """SIGKILL the SuperNode whose node config names `state_dir`, and all it started."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "flower-supernode" in cmd and state_dir in cmd:
            for child in p.children(recursive=True):
                child.kill()
            p.kill()
            return
    raise AssertionError(f"no SuperNode with {state_dir}")


BAD = [
    (["--supernodes", "4"], "--supernodes 4 but --clients 3"),
    (["--supernodes", "0"], "--supernodes 0 but --clients 3"),
    (["--round-timeout", "0"], "--round-timeout must be positive"),
    (["--critical-layer", "5"], "outside 0..2"),
    (["--attack", "scale"], "--attack simulates attacking clients in the simulation only"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_one_line_before_starting_anything(
    env: dict, extra: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    from fedjax_split import flower

    out = env["base"] / "bad"
    assert flower.main([*_args(env, out), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert not out.exists()  # nothing was written, no process was started


def test_a_bad_site_is_one_line_before_starting_anything(
    env: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The local federation reads each site's files as its SuperNode would before it starts
    one: a label the task does not know names the site, the file and the line."""
    from fedjax_split import flower

    good = write_tiny_sst2(tmp_path / "good", n_train=8, n_dev=0)
    bad = write_tiny_sst2(tmp_path / "bad", n_train=8, n_dev=4)
    lines = (bad / "dev.tsv").read_text().splitlines()
    lines[2] = lines[2].rsplit("\t", 1)[0] + "\t7"
    (bad / "dev.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    site_args = {"data_dir": None, "clients": None}
    for sites, needle in ((f"{good},{bad}", f"site 1 ({bad}): task sst2: 1 invalid rows, e.g. "
                                            "dev.tsv:3 (label '7')"),
                          ("node-config", "--site-data node-config is for `--write-app`")):
        assert flower.main(_args(env, out, site_data=sites, **site_args)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
        assert not out.exists()  # nothing was written, no process was started
    # a real deployment's App: no site's path in it, each SuperNode names its own
    app = tmp_path / "app"
    args = _args(env, out, site_data=f"{good},{bad}", **site_args)
    assert flower.main([*args, "--write-app", str(app)]) == 0
    text = (app / "pyproject.toml").read_text()
    assert str(good) not in text and str(bad) not in text and "node-config" in text


def test_an_existing_run_is_refused_and_left_alone(
    env: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from fedjax_split import flower

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 1}\n')
    assert flower.main(_args(env, out)) == 2
    assert "--resume" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"round": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_write_app_gives_a_flower_app_that_flower_accepts(env: dict, tmp_path: Path) -> None:
    """--write-app: the App for `flwr run` on real machines, valid by Flower's own checks, with
    this run's resolved settings."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from flwr.common.config import validate_config

    from fedjax_split import flower

    app = tmp_path / "app"
    assert flower.main([*_args(env, env["base"] / "w"), "--write-app", str(app)]) == 0
    config = tomllib.loads((app / "pyproject.toml").read_text())
    ok, errors, _ = validate_config(config, check_module=True, project_dir=app)
    assert ok, errors
    settings = json.loads(config["tool"]["flwr"]["app"]["config"][protocol.EXPERIMENT])
    assert settings["clients"] == 3 and settings["critical_layer"] == 1
    assert Path(settings["output_dir"]).is_absolute()


def test_a_dp_federation_with_secret_noise_differs_from_the_simulation_only_by_its_noise(
    env: dict,
) -> None:
    """Client-level DP on Flower with the server's own secret (the default), every client every
    round, a fixed clip norm: the first round's training is the simulation's to the bit (the same
    global part went down, the clients' randomness is the seed's), but the released global parts
    differ (each server draws its own noise). The secret is in the server's checkpoint alone: no
    message to a node carries it or a round's noise key."""
    import jax

    from fedjax_split.fed.roles import flatten_paths
    from fedjax_split.fed.secret import ServerSecret
    from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

    flags = {"critical_layer": 1, "rounds": 1, "eval_every": 1, "dp_noise_multiplier": 0.5,
             "dp_clip": 0.05, "dp_delta": 1e-3}  # fmt: skip
    out, record_dir = env["base"] / "dp_secret", env["base"] / "dp_secret_sent"
    res = _run(env, "fedjax_split.flower", _args(env, out, **flags),
               **{protocol.RECORD_ENV: str(record_dir)})  # fmt: skip
    assert res.returncode == 0, res.stderr
    _no_processes_left(str(out))
    sim = _simulate(env, "dp_secret_sim", **flags)
    got, want = _metrics(out, private=True), _metrics(sim, private=True)
    for key in ("train_loss", "train_loss_clients", "update_norms", "clients_sampled", "dp_clip",
                "epsilon"):
        assert got[0][key] == want[0][key], key
    # the done line says the epsilon spent (no --dp-max-epsilon: no budget)
    assert f"; epsilon {want[0]['epsilon']:.3g} at delta 0.001; " in res.stdout, res.stdout
    fed, simulated = (RunCheckpointer(checkpoint_dir(d)).restore_untyped(1)[0] for d in (out, sim))
    a = flatten_paths(fed["server_state"]["global_params"])
    b = flatten_paths(simulated["server_state"]["global_params"])
    assert all(not np.array_equal(np.asarray(a[p]), np.asarray(b[p])) for p in a)
    secret = ServerSecret.from_array(fed["dp_secret"])
    assert not secret.reproducible
    forbidden = [np.asarray(fed["dp_secret"], np.uint8)[:-1].tobytes().hex()] + [
        str(int(w)) for w in np.asarray(jax.random.key_data(secret.noise_key(1)))
    ]
    sent = [json.loads(x) for f in record_dir.glob("*.jsonl") for x in f.read_text().splitlines()]
    server_sent = [e for e in sent if e["sender"] == "server"]
    assert server_sent and all("config_values" in e for e in server_sent)
    for e in server_sent:
        values = json.dumps(e["config_values"])
        assert not any(f in values for f in forbidden)
        assert not any("secret" in k or "noise" in k for c in e["configs"].values() for k in c)
