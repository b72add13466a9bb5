"""deploy.server (the Flower server; tests/test_server.py is fed/server.py's): what it takes from
the nodes' replies. A reply whose upload is malformed or holds a NaN or an infinity is left out
of the round and recorded as a failed client; the others are taken, example-weighted, in client
order. The whole server over real Flower processes is tests/test_flower.py's."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from fedjax_split.deploy import codec, protocol, server
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.server_optimizers import fedavg

GLOBAL = {"layer": {"kernel": jnp.ones((2, 3), jnp.float32), "bias": jnp.zeros(3, jnp.float32)}}


def _run(wire: str) -> SimpleNamespace:
    spec = SimpleNamespace(wire_dtype=wire, trained=None, server_optimizer=fedavg())
    state = init_server_state(GLOBAL, spec.server_optimizer, wire)
    return SimpleNamespace(model=SimpleNamespace(round_spec=spec), server_state=state)


def _reply(upload: dict, wire: str, examples: float, loss_sum: float) -> SimpleNamespace:
    """A TRAIN reply's content as a node's ClientApp writes it."""
    metrics = {protocol.NUM_TRAIN: examples, protocol.LOSS_SUM: loss_sum,
               protocol.LOSS_UNITS: examples}  # fmt: skip
    content = RecordDict({
        protocol.UPLOAD: codec.to_record(codec.encode(upload, wire)),
        protocol.METRICS: MetricRecord(metrics),
    })  # fmt: skip
    return SimpleNamespace(content=content)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_bad_uploads_are_failed_clients_and_the_rest_is_taken_in_order(wire: str) -> None:
    good = {"layer": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full(3, 0.5)}}
    nan = {"layer": {"kernel": jnp.full((2, 3), jnp.nan), "bias": jnp.zeros(3)}}
    inf = {"layer": {"kernel": jnp.ones((2, 3)), "bias": jnp.full(3, jnp.inf)}}
    wrong_shape = {"layer": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(3)}}
    other = {"layer": {"kernel": jnp.full((2, 3), 4.0), "bias": jnp.zeros(3)}}
    replies = {
        4: _reply(other, wire, 30.0, 3.0),
        0: _reply(good, wire, 10.0, 5.0),
        1: _reply(nan, wire, 10.0, 1.0),
        2: _reply(inf, wire, 10.0, 1.0),
        3: _reply(wrong_shape, wire, 10.0, 1.0),
    }
    failed: dict[int, str] = {7: "no reply within 5 s"}
    uploads, weights, losses, nbytes = server._take_uploads(_run(wire), replies, failed)
    assert sorted(failed) == [1, 2, 3, 7]
    assert "non-finite" in failed[1] and "non-finite" in failed[2] and "shape" in failed[3]
    assert weights == [10.0, 30.0]  # clients 0 and 4, in client order
    assert losses == [0.5, float(np.float32(3.0) / np.float32(30.0))]  # fp32, as simulated
    np.testing.assert_array_equal(np.asarray(uploads[0]["layer"]["kernel"]), np.full((2, 3), 2.0))
    assert uploads[1]["layer"]["kernel"].dtype == jnp.float32  # decoded to fp32 for the mean
    per_client = (6 + 3) * (4 if wire == "float32" else 2)
    assert nbytes == 2 * per_client  # the two taken uploads' bytes as sent
