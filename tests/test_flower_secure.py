"""Secure aggregation on a real Flower federation on 127.0.0.1 (SuperLink and SuperNodes as
processes) against the simulation of the same flags: with --secure-aggregation, three and five
SuperNodes give the simulation's metrics, DP and the 16-bit wire included (the same noise under
--dp-insecure-reproducible-noise); no node ever sends its upload or its update norm, only its
keys, its encrypted shares and a masked uint64 vector; a site killed after sharing its keys is
recovered, two stop the run (below the threshold) and --resume goes on; a robust rule is refused
at start."""

from __future__ import annotations

import json

import pytest
import test_flower
from run_fixtures import private_cache  # noqa: F401 (an autouse fixture)
from test_flower import _args, _metrics, _no_processes_left, _run, _simulate

from fedjax_split.deploy import protocol

env = test_flower.env  # the federation's model and data, one per module

pytestmark = pytest.mark.xdist_group("federation")  # one at a time: see pyproject.toml

FLOWER_ONLY = {"clients_failed", "eval_failed", "eval_bytes_down", "secagg_bytes_up"}


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("seconds") and k not in FLOWER_ONLY}


def _secure_equals_simulation(env: dict, name: str, flags: dict) -> tuple[list[dict], list[dict]]:
    """The federation and the simulation of `flags` with --secure-aggregation: the same figures
    every round (the private ones too), no client failed or refused; (records, what was sent)."""
    flags = {**flags, "secure_aggregation": True}
    out, record_dir = env["base"] / name, env["base"] / f"{name}_sent"
    res = _run(env, "fedjax_split.flower", _args(env, out, **flags),
               **{protocol.RECORD_ENV: str(record_dir)})  # fmt: skip
    assert res.returncode == 0, res.stderr
    _no_processes_left(str(out))
    sim = _simulate(env, f"{name}_sim", **flags)
    for private in (False, True):
        got, want = _metrics(out, private), _metrics(sim, private)
        assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    got = _metrics(out, private=True)
    assert all(r["clients_failed"] == [] == r["clients_rejected"] for r in got)
    assert all(r["secagg_bytes_up"] > 0 for r in got if r["clients_sampled"])
    sent = [json.loads(x) for f in record_dir.glob("*.jsonl") for x in f.read_text().splitlines()]
    return got, sent


def _only_masked_vectors_leave_the_nodes(sent: list[dict]) -> None:
    replies = [e for e in sent if e["sender"] == "client"]
    assert not any(a["record"] == protocol.UPLOAD for e in replies for a in e["arrays"])
    masked = [a for e in replies for a in e["arrays"] if a["record"] == protocol.MASKED]
    assert masked and all(a["dtype"] == "uint64" for a in masked)
    trains = [e for e in replies if e["type"] == protocol.TRAIN]
    assert trains and not any(protocol.UPDATE_NORM in e["metrics"].get(protocol.METRICS, [])
                              for e in trains)  # fmt: skip
    stages = {e["type"] for e in sent if e["sender"] == "server"}
    assert {f"query.{s}" for s in (protocol.SECAGG_SHARE, protocol.SECAGG_MASK,
                                   protocol.SECAGG_UNMASK)} <= stages  # fmt: skip


def test_five_supernodes_with_dp_and_the_16_bit_wire_equal_the_simulation(
    env: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five SuperNodes, the global part down as fp16 bits and the updates up as masked 64-bit
    integers; client-level DP with adaptive clipping from the masked unclipped count and noise
    z = 0.1 at the server (the same noise both ways under --dp-insecure-reproducible-noise)."""
    monkeypatch.setattr(test_flower, "TIMEOUT", 2 * test_flower.TIMEOUT)  # five nodes start
    flags = {"clients": 5, "critical_layer": 1, "quantize": "fp16", "eval_every": 2,
             "dp_noise_multiplier": 0.1, "dp_clip": 0.05, "dp_clip_quantile": 0.5,
             "dp_delta": 1e-3, "dp_insecure_reproducible_noise": True}  # fmt: skip
    got, sent = _secure_equals_simulation(env, "secure5", flags)
    _only_masked_vectors_leave_the_nodes(sent)
    down = [a for e in sent if e["sender"] == "server" for a in e["arrays"]]
    assert down and all(a["dtype"] == "uint16" for a in down)
    assert all("update_norms" not in r for r in got)  # the server never sees a norm
    assert got[1]["dp_clip"] != got[0]["dp_clip"]  # adaptive, from the masked unclipped count


def test_a_robust_rule_with_secure_aggregation_is_refused_before_anything_starts(
    env: dict,
) -> None:
    out = env["base"] / "secure_median"
    res = _run(env, "fedjax_split.flower", _args(env, out, secure_aggregation=True,
                                                 aggregator="median"))  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "--aggregator mean" in res.stderr and not out.exists()


def test_three_supernodes_recover_a_killed_site_and_stop_below_the_threshold(
    env: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three SuperNodes, threshold 2. Round 1 equals the simulation's. Round 2: client 2's node
    dies when asked for its masked vector, after it shared its keys; the others' shares remove
    its masks and the round goes on without it. Round 3: two nodes die there; one survivor is
    below the threshold: one line, exit 2, the earlier checkpoints and records kept; --resume
    runs round 3 again with new keys."""
    monkeypatch.setattr(test_flower, "TIMEOUT", 2 * test_flower.TIMEOUT)  # workers restart
    out = env["base"] / "secure_drop"
    flags = {"critical_layer": 1, "secure_aggregation": True, "rounds": 3, "eval_every": 3}
    mask = protocol.SECAGG_MASK
    drop = f"2:{mask}:2,3:{mask}:0,3:{mask}:1"
    res = _run(env, "fedjax_split.flower", _args(env, out, **flags),
               **{protocol.SECAGG_DROP_ENV: drop})  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "threshold is 2" in lines[0] and "--resume" in lines[0]
    _no_processes_left(str(out))
    first = _metrics(out)
    sim = _metrics(_simulate(env, "secure_drop_sim", **flags))
    assert _comparable(first[0]) == _comparable(sim[0]) and first[0]["clients_failed"] == []
    assert [r["round"] for r in first] == [1, 2]
    assert first[1]["clients_failed"] == [2] and len(first[1]["train_loss_clients"]) == 2
    res = _run(env, "fedjax_split.flower", [*_args(env, out, **flags), "--resume"])
    assert res.returncode == 0, res.stderr
    got = _metrics(out)
    assert got[:2] == first and got[2]["round"] == 3 and got[2]["clients_failed"] == []
