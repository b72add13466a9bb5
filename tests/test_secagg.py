"""Secure aggregation's stages (deploy/secagg_node.py, secagg_server.py), run in one process:
the sum and only the sum, dropped nodes, the threshold, refused messages, fresh keys. Expected
sums are plain Python integer arithmetic modulo 2^64 on the inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedjax_split.deploy import secagg, secagg_crypto, secagg_node, secagg_server
from fedjax_split.deploy.secagg import Params, Refused, RoundLost, UnsafeRequest
from fedjax_split.fed.fixed_point import FixedPoint, quantise

MOD = 2**64


def _inputs(nodes: list[int], length: int, seed: int = 0) -> dict[int, np.ndarray]:
    """Each node's quantised update (fed.fixed_point) as secure aggregation carries it."""
    spec = FixedPoint(1.0, 20, len(nodes))
    rng = np.random.default_rng(seed)
    return {
        v: quantise(
            rng.uniform(-1.5, 1.5, length - 2).astype(np.float32),
            int(rng.integers(0, 21)),
            bool(v % 2),
            spec,
        )
        for v in nodes
    }


def _expected(inputs: dict[int, np.ndarray], nodes: list[int]) -> list[int]:
    length = len(next(iter(inputs.values())))
    return [sum(int(inputs[v][j]) for v in nodes) % MOD for j in range(length)]


def _setup_and_share(params: Params) -> tuple[dict, secagg_server.ServerRound, dict]:
    states, adverts = {}, []
    for v in params.nodes:
        states[v], advert = secagg_node.node_setup(params, v)
        adverts.append(advert)
    rnd, broadcast = secagg_server.server_keys(params, adverts)
    messages = []
    for v in params.nodes:
        states[v], msg = secagg_node.node_share_keys(states[v], broadcast)
        messages.append(msg)
    rnd, inboxes = secagg_server.server_route(rnd, messages)
    return states, rnd, inboxes


def _mask(
    states: dict, rnd: secagg_server.ServerRound, inboxes: dict, inputs: dict, send: list[int]
):
    uploads = {}
    for v in send:
        states[v], uploads[v] = secagg_node.node_masked_input(states[v], inboxes[v], inputs[v])
        rnd = secagg_server.server_add_masked(rnd, uploads[v])
    return rnd, uploads


def _unmask(states: dict, rnd: secagg_server.ServerRound) -> tuple[dict, list]:
    request = secagg_server.unmask_request(rnd)
    responses = []
    for v in request["survivors"]:
        states[v], response = secagg_node.node_unmask(states[v], request)
        responses.append(response)
    return request, responses


def _round(nodes: list[int], t: int, inputs: dict, send: list[int]) -> secagg_server.Aggregate:
    states, rnd, inboxes = _setup_and_share(Params(1, tuple(nodes), t, len(inputs[nodes[0]])))
    rnd, _ = _mask(states, rnd, inboxes, inputs, send)
    _, responses = _unmask(states, rnd)
    return secagg_server.server_unmask(rnd, responses)


@pytest.mark.parametrize("n", [3, 5])
def test_the_server_gets_exactly_the_sum(n: int) -> None:
    nodes = [7 * i + 3 for i in range(n)]
    inputs = _inputs(nodes, 34)
    agg = _round(nodes, n // 2 + 1, inputs, nodes)
    assert [int(v) for v in agg.total] == _expected(inputs, nodes)
    assert (agg.survivors, agg.dropped, dict(agg.refused)) == (tuple(nodes), (), {})


def test_nodes_dropped_after_sharing_keys_are_recovered() -> None:
    nodes = [5, 9, 12, 40, 41]
    inputs = _inputs(nodes, 18, seed=2)
    agg = _round(nodes, 3, inputs, [5, 12, 41])  # 9 and 40 shared keys, then died
    assert [int(v) for v in agg.total] == _expected(inputs, [5, 12, 41])
    assert agg.dropped == (9, 40)


def test_below_the_threshold_the_round_fails_with_one_line() -> None:
    nodes = [1, 2, 3, 4, 5]
    inputs = _inputs(nodes, 10)
    states, rnd, inboxes = _setup_and_share(Params(4, tuple(nodes), 3, 10))
    rnd, _ = _mask(states, rnd, inboxes, inputs, [1, 4])
    with pytest.raises(RoundLost, match="round 4 cannot be recovered: 2 of 5") as info:
        secagg_server.unmask_request(rnd)
    assert "\n" not in str(info.value)
    # also at the first stage: two advertisements for a threshold of 3
    params = Params(5, tuple(nodes), 3, 10)
    adverts = [secagg_node.node_setup(params, v)[1] for v in (1, 2)]
    with pytest.raises(RoundLost, match="advertised keys"):
        secagg_server.server_keys(params, adverts)


def test_the_server_holds_only_the_sum() -> None:
    """No field of the server's round holds a node's input; a node's masked vector looks uniform;
    the server never holds what would unmask one node: a survivor's pairwise key with another
    survivor, or a dropped node's seed."""
    nodes = [10, 20, 30, 40]
    length = 4096
    inputs = {v: np.zeros(length, np.uint64) for v in nodes}  # the worst case for hiding
    inputs[20] = np.arange(length, dtype=np.uint64)
    states, rnd, inboxes = _setup_and_share(Params(2, tuple(nodes), 3, length))
    rnd, uploads = _mask(states, rnd, inboxes, inputs, [10, 20, 40])  # 30 dropped
    arrays = [
        f.name for f in dataclasses.fields(rnd) if isinstance(getattr(rnd, f.name), np.ndarray)
    ]
    assert arrays == ["masked_sum"]
    for v in nodes:
        assert np.mean(rnd.masked_sum == inputs[v]) < 0.01
    bits = np.unpackbits(uploads[10]["masked"].view(np.uint8)).reshape(length, 64)
    assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 6 * 0.5 / np.sqrt(length))  # each bit fair
    assert abs(bits.mean() - 0.5) < 6 * 0.5 / np.sqrt(bits.size)
    streams: list[bytes] = []
    real = secagg_crypto.stream

    def spy(key: bytes, label: bytes, rnd_: int, n: int) -> np.ndarray:
        streams.append(key)
        return real(key, label, rnd_, n)

    request, responses = _unmask(states, rnd)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secagg_crypto, "stream", spy)
        agg = secagg_server.server_unmask(rnd, responses)
    assert [int(v) for v in agg.total] == _expected(inputs, [10, 20, 40])
    survivors = request["survivors"]
    pair = {
        (u, v): secagg_crypto.pair_key(states[u].mask_key, states[v].table[v].mask_key)
        for u in nodes
        for v in nodes
        if u < v
    }
    assert sorted(streams) == sorted(
        [states[u].seed for u in survivors] + [pair[min(u, 30), max(u, 30)] for u in survivors]
    )
    assert states[30].seed not in streams


def test_a_malformed_masked_vector_is_refused_and_the_round_goes_on() -> None:
    nodes = [1, 2, 3, 4, 5]
    inputs = _inputs(nodes, 12)
    states, rnd, inboxes = _setup_and_share(Params(1, tuple(nodes), 3, 12))
    rnd, _ = _mask(states, rnd, inboxes, inputs, [1, 2, 4])
    _, good = secagg_node.node_masked_input(states[3], inboxes[3], inputs[3])
    for bad in (good["masked"].astype(np.int64), good["masked"][:-1], good["masked"].tobytes()):
        rnd = secagg_server.server_add_masked(rnd, {"node": 3, "masked": bad})
    rnd = secagg_server.server_add_masked(rnd, {"node": 99, "masked": good["masked"]})
    # a second try after a refusal: refused as well
    rnd = secagg_server.server_add_masked(rnd, good)
    assert set(rnd.refused) == {3, 99} and "node 3 refused: a masked vector" in rnd.refused[3]
    _, responses = _unmask(states, rnd)
    agg = secagg_server.server_unmask(rnd, responses)
    assert [int(v) for v in agg.total] == _expected(inputs, [1, 2, 4])
    assert agg.dropped == (3, 5)


def test_bad_shares_are_refused_and_recorded() -> None:
    nodes = [1, 2, 3, 4, 5]
    inputs = _inputs(nodes, 12)
    states, rnd, inboxes = _setup_and_share(Params(1, tuple(nodes), 3, 12))
    # a peer's tampered ciphertext: the node refuses it, naming the sender
    token = bytearray(inboxes[2]["ciphertexts"][0])
    token[40] ^= 1
    tampered = {
        "from": inboxes[2]["from"],
        "ciphertexts": [bytes(token), *inboxes[2]["ciphertexts"][1:]],
    }
    with pytest.raises(Refused, match="node 1 refused: a share that does not decrypt"):
        secagg_node.node_masked_input(states[2], tampered, inputs[2])
    rnd, _ = _mask(states, rnd, inboxes, inputs, nodes)
    _, responses = _unmask(states, rnd)
    # node 1's share of node 2's seed well formed but wrong (and first in line to be used),
    # node 2's share of node 1's seed a byte short: three good shares of each seed are left
    wrong = bytearray(responses[0]["seed_shares"][1])
    wrong[10] ^= 0xFF
    responses[0]["seed_shares"][1] = bytes(wrong)
    responses[1]["seed_shares"][0] = responses[1]["seed_shares"][0][:-1]
    agg = secagg_server.server_unmask(rnd, responses)
    assert [int(v) for v in agg.total] == _expected(inputs, nodes)
    assert sorted(agg.refused) == [1, 2]
    assert "does not rebuild it" in agg.refused[1] and "not 52 bytes" in agg.refused[2]
    # one more bad share of node 2's seed leaves two good ones: the round is lost, one line
    wrong = bytearray(responses[2]["seed_shares"][1])
    wrong[30] ^= 0xFF
    responses[2]["seed_shares"][1] = bytes(wrong)
    with pytest.raises(RoundLost, match="no 3 of the 4 shares of node 2's secret rebuild it"):
        secagg_server.server_unmask(rnd, responses)


def test_a_node_never_reveals_both_shares_of_one_peer_nor_answers_twice() -> None:
    nodes = [1, 2, 3]
    inputs = _inputs(nodes, 6)
    states, rnd, inboxes = _setup_and_share(Params(1, tuple(nodes), 2, 6))
    rnd, _ = _mask(states, rnd, inboxes, inputs, [1, 2])
    with pytest.raises(UnsafeRequest, match="both shares of node 3"):
        secagg_node.node_unmask(states[1], {"survivors": [1, 2, 3], "dropped": [3]})
    with pytest.raises(UnsafeRequest, match="not the nodes that shared keys"):
        secagg_node.node_unmask(states[1], {"survivors": [1, 2], "dropped": []})
    request = secagg_server.unmask_request(rnd)
    states[1], _ = secagg_node.node_unmask(states[1], request)
    with pytest.raises(UnsafeRequest, match="revealed already"):
        secagg_node.node_unmask(states[1], {"survivors": [1, 2, 3], "dropped": []})


def test_every_round_draws_fresh_keys_and_seeds() -> None:
    params = Params(1, (1, 2, 3), 2, 8)
    first, advert1 = secagg_node.node_setup(params, 1)
    second, advert2 = secagg_node.node_setup(params, 1)
    for name in ("enc_key", "mask_key", "seed_digest"):
        assert advert1[name] != advert2[name]
    assert first.seed != second.seed
    assert "seed" not in repr(first).replace("seed_shares", "") and first.seed.hex() not in repr(
        first
    )


def test_the_threshold_must_be_a_majority() -> None:
    with pytest.raises(secagg.UserError, match="above half the 4 nodes"):
        Params(1, (1, 2, 3, 4), 2, 8)
    with pytest.raises(secagg.UserError, match="distinct"):
        Params(1, (1, 1, 3), 2, 8)


def test_a_node_refused_at_a_stage_is_out_of_the_round() -> None:
    """A bad advertisement, or a second one, takes its node out; the others' round goes on."""
    params = Params(1, (1, 2, 3, 4, 5), 3, 8)
    inputs = _inputs(list(params.nodes), 8)
    states, adverts = {}, []
    for v in params.nodes:
        states[v], advert = secagg_node.node_setup(params, v)
        adverts.append(advert)
    bad = {**adverts[1], "mask_key": b"-----BEGIN PUBLIC KEY-----\nno\n-----END PUBLIC KEY-----\n"}
    again = {**adverts[0], "seed_digest": bytes(32)}  # node 1 advertises twice
    sent = [bad, adverts[1], adverts[0], again, *adverts[2:]]
    rnd, broadcast = secagg_server.server_keys(params, sent)
    assert "not a P-384 public key" in rnd.refused[2] and "second message" in rnd.refused[1]
    assert broadcast["nodes"] == [3, 4, 5]
    shares = []
    for v in (3, 4, 5):
        states[v], msg = secagg_node.node_share_keys(states[v], broadcast)
        shares.append(msg)
    with pytest.raises(UnsafeRequest, match="keys wrongly"):  # node 1 is not in the table
        secagg_node.node_share_keys(states[1], broadcast)
    rnd, inboxes = secagg_server.server_route(rnd, shares)
    rnd, _ = _mask(states, rnd, inboxes, inputs, [3, 4, 5])
    _, responses = _unmask(states, rnd)
    agg = secagg_server.server_unmask(rnd, responses)
    assert [int(v) for v in agg.total] == _expected(inputs, [3, 4, 5])
