"""fed.server: the server step from the clients' mean, with and without a schedule's subset.

Expected values are computed by hand in numpy (Reddi et al.'s FedAdam, FedAvgM's momentum), not by
the code under test.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from fedjax_split.fed import server_optimizers
from fedjax_split.fed.server import init_server_state, server_update, upload


def _tree() -> dict:
    return {
        "layer_0": {"w": jnp.asarray([1.0, 2.0, 3.0]), "b": jnp.asarray([0.5])},
        "layer_1": {"w": jnp.asarray([-1.0, 0.25]), "b": jnp.asarray([4.0])},
        "count": jnp.asarray(7, jnp.int32),
    }


def _arrays(tree: dict) -> dict:
    return {k: (np.asarray(v) if not isinstance(v, dict) else _arrays(v)) for k, v in tree.items()}


def test_fedadam_steps_only_the_trained_subset_and_keeps_the_rest_of_its_state() -> None:
    lr, tau, b1, b2 = 0.1, 1e-3, 0.9, 0.99
    opt = server_optimizers.fedadam(lr, tau=tau, b1=b1, b2=b2)
    state = init_server_state(_tree(), opt, "float32")
    # round 1 trains layer 0 only: clients moved it by +0.5 (the mean holds only trained leaves)
    trained0 = frozenset({"layer_0/w", "layer_0/b"})
    mean0 = {"layer_0": {"w": jnp.asarray([1.5, 2.5, 3.5]), "b": jnp.asarray([1.0])}}
    s1 = server_update(state, mean0, opt, "float32", trained0)
    delta = 0.5
    m = (1 - b1) * delta
    v = b2 * tau**2 + (1 - b2) * delta**2
    step = lr * m / (np.sqrt(v) + tau)
    np.testing.assert_allclose(s1.master["layer_0"]["w"], [1 + step, 2 + step, 3 + step], rtol=1e-6)
    np.testing.assert_array_equal(s1.master["layer_1"]["w"], [-1.0, 0.25])  # untouched, exactly
    np.testing.assert_array_equal(s1.opt_state.m["layer_1"]["w"], [0.0, 0.0])
    np.testing.assert_array_equal(s1.opt_state.v["layer_1"]["w"], np.full(2, tau**2, np.float32))
    assert int(s1.master["count"]) == 7 and int(s1.round) == 1
    # round 2 trains layer 1: layer 0 keeps its value AND its moments, although m != 0 there
    before = _arrays(s1.master), np.asarray(s1.opt_state.m["layer_0"]["w"])
    mean1 = {"layer_1": {"w": jnp.asarray([-1.0, 0.25]), "b": jnp.asarray([3.0])}}
    s2 = server_update(s1, mean1, opt, "float32", frozenset({"layer_1/w", "layer_1/b"}))
    np.testing.assert_array_equal(s2.master["layer_0"]["w"], before[0]["layer_0"]["w"])
    np.testing.assert_array_equal(s2.opt_state.m["layer_0"]["w"], before[1])
    np.testing.assert_array_equal(s2.master["layer_1"]["w"], [-1.0, 0.25])  # Delta 0, m 0
    m_b = (1 - b1) * -1.0
    v_b = b2 * tau**2 + (1 - b2) * 1.0
    np.testing.assert_allclose(
        s2.master["layer_1"]["b"], [4.0 + lr * m_b / (np.sqrt(v_b) + tau)], rtol=1e-6
    )


def test_fedavgm_momentum_does_not_move_parameters_left_out_of_the_round() -> None:
    opt = server_optimizers.fedavgm(1.0, momentum=0.9)
    state = init_server_state(_tree(), opt, "float32")
    everything = {
        "layer_0": {"w": jnp.asarray([2.0, 3.0, 4.0]), "b": jnp.asarray([1.5])},
        "layer_1": {"w": jnp.asarray([0.0, 1.25]), "b": jnp.asarray([5.0])},
        "count": jnp.asarray(7, jnp.int32),
    }
    s1 = server_update(state, everything, opt, "float32")  # all trained: +1 everywhere
    np.testing.assert_allclose(s1.master["layer_1"]["w"], [0.0, 1.25])
    s2 = server_update(
        s1,
        {"layer_0": everything["layer_0"]},
        opt,
        "float32",
        frozenset({"layer_0/w", "layer_0/b"}),
    )
    # layer 1 had momentum 1.0 (trace of the pseudo-gradient -1); without the subset it would move
    np.testing.assert_array_equal(s2.master["layer_1"]["w"], [0.0, 1.25])
    np.testing.assert_array_equal(
        s2.opt_state[0].trace["layer_1"]["w"], s1.opt_state[0].trace["layer_1"]["w"]
    )
    # layer 0: pseudo-gradient 0 - (2-2)=0 this round, momentum 0.9 * -1 carries it on by 0.9
    np.testing.assert_allclose(s2.master["layer_0"]["w"], [2.9, 3.9, 4.9], rtol=1e-6)
    free = server_update(s1, everything, opt, "float32")
    assert not np.array_equal(free.master["layer_1"]["w"], [0.0, 1.25])  # the contrast


def test_wire_image_and_upload() -> None:
    opt = optax.sgd(1.0)
    state = init_server_state(_tree(), opt, "bfloat16")
    assert state.global_params["layer_0"]["w"].dtype == jnp.bfloat16
    assert state.global_params["count"].dtype == jnp.int32  # integers never cast
    x = {"a": jnp.asarray([1.0 + 2.0**-10], jnp.float32)}
    got = upload(x, "bfloat16")["a"]
    assert got.dtype == jnp.float32 and float(got[0]) == 1.0  # rounded to bf16's 8 bits


def test_clients_that_do_not_move_leave_the_master_where_it_was() -> None:
    """16-bit wire: the clients start from the bf16 copy; if they upload it unchanged, Delta is 0
    and the fp32 master (not bf16-representable) stays exactly put, momentum or not."""
    master = {"w": jnp.asarray([1.0 + 2.0**-10, -3.0 - 2.0**-12, 0.1], jnp.float32)}
    for opt in (server_optimizers.fedavgm(1.0, momentum=0.9), server_optimizers.fedadam(1e-3)):
        state = init_server_state(master, opt, "bfloat16")
        received = {"w": state.global_params["w"].astype(jnp.float32)}
        assert not np.array_equal(received["w"], master["w"])  # the wire rounds
        for _ in range(3):
            state = server_update(state, received, opt, "bfloat16")
            np.testing.assert_array_equal(state.master["w"], master["w"])
        # the rule it replaces: Delta against the master moved it by the rounding error
        moved = optax.apply_updates(
            master, opt.update({"w": master["w"] - received["w"]}, opt.init(master), master)[0]
        )
        assert not np.array_equal(moved["w"], master["w"])
