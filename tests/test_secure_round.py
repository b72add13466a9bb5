"""Secure aggregation's exchanges as the Flower server runs them (deploy/secure_round.py) against
the nodes' handlers (deploy/handlers.py, deploy/secure_node.py), in one process with a transport
that can drop or tamper with a node: the server ends with the survivors' sum and nothing else,
recovers from a node dropped after it shared its keys, stops below the threshold with one line,
and refuses a malformed masked vector. Expected sums are plain modulo-2^64 sums of the inputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message
from flwr.supercore.task_identity import TaskIdentity

from fedjax_split.deploy import codec, handlers, protocol, secagg, secure_node, secure_round
from fedjax_split.fed.fixed_point import FixedPoint, quantise

RUN = "run-under-test"


@pytest.fixture(autouse=True)
def _flower_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's Message needs the identity of the task it runs in, which a ServerApp has."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def _vectors(clients: list[int], fixed: FixedPoint, length: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(3)
    return {c: quantise(rng.normal(0, 0.1, length).astype(np.float32), 5 + c, c % 2 == 0, fixed)
            for c in clients}  # fmt: skip


def _start(n: int, length: int = 20) -> tuple[secagg.Params, FixedPoint, dict, list]:
    """Round 1's settings, each client's vector, and the adverts of its TRAIN reply."""
    clients = list(range(n))
    fixed = FixedPoint(1.0, 10, n)
    params = secagg.Params(1, tuple(clients), secure_round.threshold(n), fixed.length(length))
    vectors = _vectors(clients, fixed, length)
    secure_node.forget(RUN)
    adverts = [secure_node.begin(RUN, params, c, vectors[c]) for c in clients]
    return params, fixed, vectors, adverts


Tamper = Callable[[str, int, Message], Message]


def _transport(drop: dict[str, set[int]], tamper: Tamper | None = None, seen: list | None = None):
    """`Exchange.send` in one process: each message to its handler; a client in drop[stage]
    does not answer; `tamper` may rewrite a reply; `seen` collects what the server receives."""

    def send(msgs: dict[int, Message], timeout: float) -> tuple[dict, dict]:
        replies, failed = {}, {}
        for cid, msg in msgs.items():
            stage = msg.metadata.message_type.split(".", 1)[1]
            if cid in drop.get(stage, set()):
                failed[cid] = f"no reply within {timeout:g} s"
                continue
            try:
                reply = handlers.HANDLERS[msg.metadata.message_type](msg, None)
            except ValueError as err:  # Flower reports a ClientApp's exception as an error
                failed[cid] = f"error: {err}"
                continue
            replies[cid] = tamper(stage, cid, reply) if tamper else reply
            if seen is not None:
                seen.append(replies[cid])
        return replies, failed

    return send


def _sum(send, params, adverts) -> secure_round.SecureResult:
    cfg = {protocol.RUN: RUN, protocol.ROUND: 1}
    nodes = {c: 1000 + c for c in params.nodes}
    return secure_round.secure_sum(send, nodes, cfg, params, adverts, 5.0)


def _mod_sum(vectors: dict[int, np.ndarray], clients: list[int]) -> list[int]:
    length = len(next(iter(vectors.values())))
    return [sum(int(vectors[c][j]) for c in clients) % 2**64 for j in range(length)]


@pytest.mark.parametrize("n", [3, 5])
def test_the_server_ends_with_the_sum_and_sees_no_clients_vector(n: int) -> None:
    params, fixed, vectors, adverts = _start(n)
    seen: list = []
    result = _sum(_transport({}, seen=seen), params, adverts)
    assert result.total.tolist() == _mod_sum(vectors, list(range(n)))
    assert result.survivors == tuple(range(n)) and not result.failed and not result.refused
    assert result.masked_bytes == 8 * params.length * n and result.key_bytes > 0
    received = [r.content[protocol.MASKED][protocol.MASKED].numpy() for r in seen
                if protocol.MASKED in r.content.array_records]  # fmt: skip
    assert len(received) == n  # every masked vector the server got: none is a client's own
    for masked in received:
        assert all(not np.array_equal(masked, v) for v in vectors.values())
        assert np.mean(masked == vectors[0]) < 0.1


def test_a_client_dropped_after_sharing_its_keys_is_recovered_from_the_others_shares() -> None:
    params, fixed, vectors, adverts = _start(5)
    result = _sum(_transport({protocol.SECAGG_MASK: {1, 3}}), params, adverts)
    assert result.total.tolist() == _mod_sum(vectors, [0, 2, 4])
    assert result.survivors == (0, 2, 4) and sorted(result.failed) == [1, 3]


def test_a_client_whose_worker_restarted_counts_as_dropped() -> None:
    params, fixed, vectors, adverts = _start(3)
    send = _transport({})

    def restarted(msgs: dict, timeout: float):  # client 2 lost its keys before the MASK stage
        if any(m.metadata.message_type.endswith(protocol.SECAGG_MASK) for m in msgs.values()):
            secure_node._ROUNDS.pop((RUN, 1, 2), None)
        return send(msgs, timeout)

    result = _sum(restarted, params, adverts)
    assert result.total.tolist() == _mod_sum(vectors, [0, 1])
    assert "no secure-aggregation keys" in result.failed[2]


def test_below_the_threshold_the_round_is_lost_with_one_line() -> None:
    params, fixed, _, adverts = _start(3)
    with pytest.raises(secagg.RoundLost) as err:
        _sum(_transport({protocol.SECAGG_MASK: {0, 2}}), params, adverts)
    assert "\n" not in str(err.value) and "--resume" in str(err.value)


def test_a_malformed_masked_vector_is_refused_recorded_and_the_rest_recovered() -> None:
    params, fixed, vectors, adverts = _start(5)

    def tamper(stage: str, cid: int, reply: Message) -> Message:
        if stage == protocol.SECAGG_MASK and cid == 4:
            masked = reply.content[protocol.MASKED][protocol.MASKED].numpy()
            reply.content[protocol.MASKED] = codec.to_record(
                {protocol.MASKED: masked.astype(np.float64)})
        return reply

    result = _sum(_transport({}, tamper), params, adverts)
    assert result.total.tolist() == _mod_sum(vectors, [0, 1, 2, 3])
    assert "uint64" in result.refused[4] and result.survivors == (0, 1, 2, 3)


def test_a_reply_in_another_clients_name_is_refused() -> None:
    params, fixed, vectors, adverts = _start(3)

    def tamper(stage: str, cid: int, reply: Message) -> Message:
        if stage == protocol.SECAGG_SHARE and cid == 0:
            payload = dict(reply.content[protocol.SECAGG])
            payload["node"] = 1
            reply.content[protocol.SECAGG] = ConfigRecord(payload)
        return reply

    result = _sum(_transport({}, tamper), params, adverts)
    assert result.total.tolist() == _mod_sum(vectors, [1, 2])
    assert "node 1" in result.refused[0]
