"""One federated round vs clients trained one at a time and a numpy aggregation; client-level DP's
and an attack's rounds."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from fedcore_helpers import (
    HIDDEN,
    INTER,
    LAYERS,
    POS,
    TYPES,
    VOCAB,
    make_segments,
    per_client,
    reference_loss,
    tiny_model,
)

from fedjax_split.errors import UserError
from fedjax_split.fed import aggregation, privacy, server_optimizers
from fedjax_split.fed.aggregation import Aggregator
from fedjax_split.fed.client import (
    ClientSpec,
    client_optimizer,
    linear_warmup_decay,
    make_client_fns,
    make_client_update,
)
from fedjax_split.fed.roles import flatten_paths, merge_params, split_params
from fedjax_split.fed.secret import ServerSecret
from fedjax_split.fed.wire import cast_to_wire
from fedjax_split.sim.rounds import (
    RoundSpec,
    init_server_state,
    one_at_a_time,
    put_clients,
    replicate,
    round_devices,
    run_round,
    sample_clients,
    stacked_functions,
    take_clients,
)
from fedjax_split.tasks.objectives import CLASSIFICATION

K = 3
WEIGHTS = np.array([5, 20, 75])  # distinct, so unweighted averaging would be caught
SEED_KEY = jax.random.key(42)
APPLY, PARAMS = tiny_model(dropout=0.1)
CLIENT = ClientSpec(APPLY, CLASSIFICATION, optax.sgd(0.3))
FEDAVG = server_optimizers.fedavg(1.0)
SEGMENTS = make_segments(np.random.default_rng(0), [3, 1, 2], 3, num_segments=2)
STEPS = per_client(SEGMENTS)  # each client's segments, as run_round takes them


def _clients_local_init() -> dict:
    """Distinct per-client starting points: the model's params plus a per-client offset."""
    flat = flatten_paths(PARAMS)
    return {
        path: np.stack([np.asarray(v) + 0.01 * (k + 1) for k in range(K)])
        for path, v in flat.items()
    }


CLIENT_PARAMS = _clients_local_init()  # flat path -> [K, ...]: each client's own starting model

_FNS = make_client_fns(CLIENT)
_INIT, _TRAIN, _FINISH = jax.jit(_FNS.init), jax.jit(_FNS.train_segment), jax.jit(_FNS.finish)


def _reference_update(global_params, local_params, segments, key):
    """make_client_update's loop over a client's segments, with each piece jitted on its own (one
    compile per segment shape instead of one per list of segments)."""
    state = _INIT(global_params, local_params)
    for seg in segments:
        state = _TRAIN(state, seg.for_training(), global_params, key, {})
    return _FINISH(state)


def _reference(global_start: dict, client_ids=(0, 1, 2), segments=STEPS, round_index=0):
    """Clients trained ONE AT A TIME by the client update (everything in one tree), with the
    keys derived here by hand: fold_in(fold_in(run key, round), client id)."""
    out = []
    for pos, cid in enumerate(client_ids):
        own = {p: v[pos] for p, v in CLIENT_PARAMS.items()}
        own.update(flatten_paths(global_start))  # the received global part replaces its copy
        key = jax.random.fold_in(jax.random.fold_in(SEED_KEY, round_index), cid)
        tree = merge_params(_unflatten(own), {})
        new, _, _ = _reference_update(tree, {}, segments[pos], key)
        out.append({p: np.asarray(v) for p, v in flatten_paths(new).items()})
    return out


def _unflatten(flat: dict) -> dict:
    from fedjax_split.fed.roles import unflatten_paths

    return unflatten_paths(flat)


def _setup(c: int, wire: str = "float32", opt=FEDAVG):
    g, _ = split_params(PARAMS, critical_layer=c)
    local = {p: v for p, v in CLIENT_PARAMS.items() if p not in flatten_paths(g)}
    state = init_server_state(g, opt, wire)
    return state, _unflatten(local)


def _run(spec: RoundSpec, c: int, **kw):
    state, local = _setup(c, spec.wire_dtype, spec.server_optimizer)
    return run_round(spec, state, local, WEIGHTS, STEPS, SEED_KEY, **kw)


def _numpy_weighted_mean(per_client: list[dict], path: str) -> np.ndarray:
    stack = np.stack([pc[path].astype(np.float64) for pc in per_client])
    return np.tensordot(WEIGHTS / WEIGHTS.sum(), stack, axes=1)


_LAYER = (  # parameters of one encoder layer, counted by hand from the architecture
    4 * (HIDDEN * HIDDEN + HIDDEN)
    + 2 * HIDDEN
    + (HIDDEN * INTER + INTER)
    + (INTER * HIDDEN + HIDDEN)
    + 2 * HIDDEN
)


def _global_param_count(c: int) -> int:
    """Hand count from the architecture: embeddings + c encoder layers (+ pooler/head at c = L)."""
    h = HIDDEN
    emb = (VOCAB + POS + TYPES) * h + 2 * h
    if c == 0:
        return 0
    total = emb + c * _LAYER
    return total + (h * h + h) + (h * 3 + 3) if c == LAYERS else total


SPEC_FEDAVG = RoundSpec(CLIENT, FEDAVG, "float32", donate=False)


@pytest.mark.parametrize("c", [LAYERS, 1])
def test_round_equals_clients_one_at_a_time_and_numpy_fedavg(c: int) -> None:
    state, new_local, result = _run(SPEC_FEDAVG, c)
    g0, _ = split_params(PARAMS, critical_layer=c)
    ref = _reference(g0)
    got_global = flatten_paths(state.global_params)
    assert set(got_global) == set(flatten_paths(g0))
    for path, value in got_global.items():
        want = _numpy_weighted_mean(ref, path)
        np.testing.assert_allclose(np.asarray(value), want, rtol=2e-5, atol=2e-6, err_msg=path)
        unweighted = np.mean([r[path] for r in ref], axis=0)
        if path == "embeddings/LayerNorm/scale":
            assert np.abs(want - unweighted).max() > 1e-4  # 50x the tolerance: weights matter
    for path, value in flatten_paths(new_local).items():
        for k in range(K):
            np.testing.assert_allclose(np.asarray(value[k]), ref[k][path], rtol=2e-5, atol=2e-6)
    assert int(state.round) == 1
    n = _global_param_count(c)
    assert result.bytes_down == result.bytes_up == 4 * n * K
    assert [int(s) for s in result.metrics.num_steps] == [6, 2, 4]
    assert result.train_loss.shape == (K,)


def test_c0_is_isolated_training_with_zero_bytes() -> None:
    state, new_local, result = _run(SPEC_FEDAVG, 0)
    assert state.global_params == {}
    assert result.bytes_down == result.bytes_up == 0
    ref = _reference({})
    for path, value in flatten_paths(new_local).items():
        for k in range(K):
            np.testing.assert_allclose(np.asarray(value[k]), ref[k][path], rtol=2e-5, atol=2e-6)


def test_sharded_and_chunked_round_equals_plain_round() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("clients",))
    assert len(jax.devices()) == 2, "conftest forces 2 CPU devices"
    spec = RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=1, mesh=mesh, donate=False)
    a = _run(SPEC_FEDAVG, 1)
    b = _run(spec, 1)  # K = 3 is padded to 4 over 2 devices, 1 client at a time on each
    chex.assert_trees_all_close(a[:2], b[:2], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(a[2].train_loss), np.asarray(b[2].train_loss), rtol=1e-6)
    assert b[2].bytes_up == a[2].bytes_up
    # and the client axis really is split over the devices (a manual computation over 'clients')
    state, local = _setup(1)
    fns = stacked_functions(spec)
    client_states, keys = fns.start(state, local, np.arange(K, dtype=np.int32), SEED_KEY)
    assert len(keys.sharding.device_set) == 2
    lowered = fns.segment.lower(client_states, state.global_params, SEGMENTS[0], keys).as_text()
    assert 'manual_axes={"clients"}' in lowered


def test_chunk_size_does_not_change_the_round() -> None:
    spec = RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=2, donate=False)  # 3 = 2 + remainder 1
    a = _run(SPEC_FEDAVG, 1)
    b = _run(spec, 1)
    chex.assert_trees_all_close(a[:2], b[:2], rtol=1e-6, atol=1e-7)


def test_determinism_same_seed_bitwise_and_donation_safe() -> None:
    a = _run(SPEC_FEDAVG, 1)
    b = _run(SPEC_FEDAVG, 1)
    chex.assert_trees_all_equal(a, b, strict=True)  # bitwise: values, dtypes and shapes
    # Donating the server state and local parts changes nothing but memory, and never deletes
    # the caller's parameters (the server state owns copies).
    b = _run(RoundSpec(CLIENT, FEDAVG, "float32", donate=True), 1)
    assert not any(x.is_deleted() for x in jax.tree.leaves(PARAMS))
    chex.assert_trees_all_equal(a, b, strict=True)


def test_keys_differ_across_clients() -> None:
    # Clients 0 and 1: identical data and starting params; only their dropout keys differ.
    segs = [STEPS[0], STEPS[0], STEPS[2]]
    state, local = _setup(1)
    local = jax.tree.map(lambda x: jnp.stack([x[0], x[0], x[2]]), local)
    _, new_local, res = run_round(SPEC_FEDAVG, state, local, WEIGHTS, segs, SEED_KEY)
    kernel = np.asarray(new_local["classifier"]["kernel"])
    assert not np.array_equal(kernel[0], kernel[1])
    # (the keys themselves: tests/test_client_program.py)


def test_16_bit_wire_fedadam_round_vs_hand_formula() -> None:
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    opt = server_optimizers.fedadam(lr, b1=b1, b2=b2, tau=tau)
    spec = RoundSpec(CLIENT, opt, "bfloat16", donate=False)
    state, _ = _setup(1, "bfloat16", opt)
    held = {p: np.asarray(v) for p, v in flatten_paths(state.global_params).items()}
    master = {p: np.asarray(v) for p, v in flatten_paths(state.master).items()}
    assert all(v.dtype == ml_dtypes.bfloat16 for v in held.values())
    assert all(v.dtype == np.float32 for v in master.values())
    new_state, _, result = _run(spec, 1)
    # Reference: clients start from the bf16 weights cast to fp32 and upload bf16; Delta is the
    # mean against that bf16 start; the server steps its fp32 master and sends its bf16 cast.
    start = {p: v.astype(np.float32) for p, v in held.items()}
    ref = _reference(_unflatten(start))
    for r in ref:
        for p in start:
            r[p] = r[p].astype(ml_dtypes.bfloat16).astype(np.float32)
    new_master = flatten_paths(new_state.master)
    for path, value in flatten_paths(new_state.global_params).items():
        assert value.dtype == jnp.bfloat16
        x = master[path].astype(np.float64)
        delta = _numpy_weighted_mean(ref, path) - start[path].astype(np.float64)
        m = (1 - b1) * delta
        v = b2 * tau**2 + (1 - b2) * delta**2
        want = x + lr * m / (np.sqrt(v) + tau)
        # The master keeps steps far below a bf16 ulp (a 16-bit-only server would lose them).
        np.testing.assert_allclose(np.asarray(new_master[path]), want, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(new_master[path]).astype(ml_dtypes.bfloat16)
        )
    assert result.bytes_down == result.bytes_up == 2 * _global_param_count(1) * K


def test_sample_clients() -> None:
    assert sample_clients(5, None, 0, 3).tolist() == [0, 1, 2, 3, 4]
    assert sample_clients(5, 9, 0, 3).tolist() == [0, 1, 2, 3, 4]
    a = sample_clients(100, 10, seed=7, round_index=2)
    assert len(set(a.tolist())) == 10 and a.tolist() == sorted(a.tolist())
    np.testing.assert_array_equal(a, sample_clients(100, 10, seed=7, round_index=2))
    want = np.sort(np.random.default_rng([7, 2, 1]).choice(100, 10, replace=False))
    np.testing.assert_array_equal(a, want)
    assert not np.array_equal(a, sample_clients(100, 10, seed=7, round_index=3))
    with pytest.raises(UserError):
        sample_clients(5, 0, 0, 0)


def test_take_put_replicate() -> None:
    tree = {"a": jnp.arange(12.0).reshape(4, 3)}
    got = take_clients(tree, [3, 1])
    np.testing.assert_array_equal(np.asarray(got["a"]), [[9, 10, 11], [3, 4, 5]])
    back = put_clients(tree, [3, 1], jax.tree.map(lambda x: -x, got))
    np.testing.assert_array_equal(np.asarray(back["a"])[[0, 2]], [[0, 1, 2], [6, 7, 8]])
    np.testing.assert_array_equal(np.asarray(back["a"])[3], [-9, -10, -11])
    rep = replicate({"b": jnp.array([1.0, 2.0])}, 3)
    assert rep["b"].shape == (3, 2)


def test_bad_weights_are_user_errors() -> None:
    state, local = _setup(1)
    with pytest.raises(UserError, match="num_examples"):
        run_round(SPEC_FEDAVG, state, local, np.zeros(K), STEPS, SEED_KEY)
    with pytest.raises(ValueError, match="2 clients' steps for 3 sampled clients"):
        run_round(SPEC_FEDAVG, state, local, WEIGHTS, STEPS[:2], SEED_KEY)
    assert cast_to_wire({}, "bfloat16") == {}


def _packed_segments() -> list[list]:
    """Each client's packed parts (different numbers: stacked, some parts are masked); with
    parts of 32 tokens (R = 3 rows of 16) most steps of 4 examples span two parts."""
    from fedjax_split.data.batching import Batching, client_batches
    from fedjax_split.data.tokenization import Tokenized

    rng = np.random.default_rng(9)
    lengths = rng.integers(2, POS + 1, 40)
    tok = Tokenized(
        [rng.integers(1, VOCAB, n).astype(np.int32) for n in lengths],
        [(np.arange(n) >= n // 2).astype(np.int32) for n in lengths],
        lengths.astype(np.int32),
    )
    clients = [np.arange(0, 6), np.arange(6, 30), np.arange(30, 40)]
    labels = rng.integers(0, 3, 40)
    how = Batching(4, row_width=16, part_tokens=32)
    parts = [
        client_batches(tok, ix, labels, how, epochs=2, seed=3, client_id=c)
        for c, ix in enumerate(clients)
    ]
    for c, ix in zip(parts, clients, strict=True):  # some steps of several parts
        assert len(c) > sum(bool(p.last_part[0]) for p in c) == 2 * -(-ix.size // 4)
    return parts


def test_packed_round_vmapped_chunked_and_one_at_a_time_agree() -> None:
    """Packed segments, dropout on: the vmapped round, the sharded one-client-at-a-time round
    and clients trained alone by the client update give the same models."""
    segs = _packed_segments()
    assert all(s.packed for c in segs for s in c) and len({len(c) for c in segs}) == 3
    state, local = _setup(1)
    a = run_round(SPEC_FEDAVG, state, local, WEIGHTS, segs, SEED_KEY)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("clients",))
    spec = RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=1, mesh=mesh, donate=False)
    state, local = _setup(1)
    b = run_round(spec, state, local, WEIGHTS, segs, SEED_KEY)
    chex.assert_trees_all_close(a[:2], b[:2], rtol=1e-6, atol=1e-7)
    g0, _ = split_params(PARAMS, critical_layer=1)
    ref = _reference(g0, segments=segs)
    for path, value in flatten_paths(a[0].global_params).items():
        want = _numpy_weighted_mean(ref, path)
        np.testing.assert_allclose(np.asarray(value), want, rtol=2e-5, atol=2e-6, err_msg=path)
    for path, value in flatten_paths(a[1]).items():
        for k in range(K):
            np.testing.assert_allclose(np.asarray(value[k]), ref[k][path], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("packed", "c"), [(False, 0), (False, 1), (True, 1)])
def test_host_loop_round_equals_vmapped_round(packed: bool, c: int) -> None:
    """chunk_size=1 without a mesh: clients run one at a time from the host, each state in its own
    buffers; same models, losses and metrics as the vmapped round (masked steps included)."""
    segs = _packed_segments() if packed else STEPS
    # clients with fewer steps or masked steps, and (packed) steps that stacking grows
    assert not all(s.step_mask.all() for c in segs for s in c) or len({len(c) for c in segs}) > 1
    spec = RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=1, donate=True)
    assert one_at_a_time(spec)
    ids = np.array([0, 2, 5], np.int32)  # sampled clients' global ids pick their keys
    state, local = _setup(c)
    a = run_round(SPEC_FEDAVG, state, local, WEIGHTS, segs, SEED_KEY, client_ids=ids)
    state, local = _setup(c)
    b = run_round(spec, state, local, WEIGHTS, segs, SEED_KEY, client_ids=ids)
    chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)
    assert [int(s) for s in b[2].metrics.num_steps] == [int(s) for s in a[2].metrics.num_steps]


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_clients_dealt_to_devices_train_what_one_device_trains(monkeypatch, wire: str) -> None:
    """Clients one at a time, dealt round-robin to 2 devices: client i's segment programs run on
    device i % 2, and the round's outputs are bit-identical to the same round on one device
    (same programs and inputs; uploads summed on the first device in client order)."""
    import dataclasses

    from fedjax_split.sim import rounds
    from fedjax_split.sim.one_at_a_time_round import OneAtATimeFns

    devices = tuple(jax.devices()[:2])
    assert len(devices) == 2  # conftest forces 2 CPU devices
    segs = _packed_segments()
    one = RoundSpec(CLIENT, FEDAVG, wire, chunk_size=1, donate=False, devices=devices[:1])
    two = dataclasses.replace(one, devices=devices)
    assert round_devices(two) == devices and round_devices(dataclasses.replace(one, devices=None))
    mesh = jax.sharding.Mesh(np.array(devices), ("clients",))
    assert round_devices(dataclasses.replace(one, chunk_size=2, mesh=mesh)) == devices
    assert round_devices(dataclasses.replace(one, chunk_size=None)) == devices[:1]  # vmapped

    seen: list = []  # the device of each segment program's client state, in enqueue order
    real = rounds.one_at_a_time_functions

    def recording(spec: RoundSpec) -> OneAtATimeFns:
        fns = real(spec)

        def segment_one(state, global_wire, part, key, frozen):
            seen.append(list(state.steps.devices())[0])
            return fns.segment_one(state, global_wire, part, key, frozen)

        return fns._replace(segment_one=segment_one)

    monkeypatch.setattr(rounds, "one_at_a_time_functions", recording)
    ids = np.array([0, 2, 5], np.int32)
    state, local = _setup(1, wire)
    a = run_round(one, state, local, WEIGHTS, segs, SEED_KEY, client_ids=ids)
    assert set(seen) == {devices[0]}
    seen.clear()
    state, local = _setup(1, wire)
    b = run_round(two, state, local, WEIGHTS, segs, SEED_KEY, client_ids=ids)
    want = [devices[i % 2] for first in range(0, K, 2)
            for j in range(max(len(segs[i]) for i in range(first, min(first + 2, K))))
            for i in range(first, min(first + 2, K)) if j < len(segs[i])]  # fmt: skip
    assert seen == want and set(want) == set(devices)
    assert all(not isinstance(y, jax.Array) or list(y.devices()) == [devices[0]]
               for y in jax.tree.leaves(b))  # fmt: skip
    chex.assert_trees_all_equal(a, b, strict=True)  # bit-identical, dtypes too (16-bit wire)
    chex.assert_trees_all_equal_dtypes(a[:2], b[:2])  # strict compares bfloat16 as fp32


def _frozen_reference(trained_global: dict, frozen: dict, client_ids=(0, 1, 2)) -> list[dict]:
    """Clients trained one at a time by a plain loop over steps, independent of the client update:
    the whole model in one tree, frozen leaves held by optax.multi_transform's set_to_zero."""
    frozen_paths = set(flatten_paths(frozen))

    grad = jax.jit(jax.grad(lambda p, b, k: reference_loss(APPLY, p, b, k, False)))
    out = []
    for pos, cid in enumerate(client_ids):
        own = {p: jnp.asarray(v[pos]) for p, v in CLIENT_PARAMS.items()}
        own.update(flatten_paths(trained_global))
        own.update(flatten_paths(frozen))
        params = _unflatten(own)
        labels = _unflatten({p: "f" if p in frozen_paths else "t" for p in own})
        opt = optax.multi_transform({"t": optax.sgd(0.3), "f": optax.set_to_zero()}, labels)
        opt_state = opt.init(params)
        key = jax.random.fold_in(jax.random.fold_in(SEED_KEY, 0), cid)
        taken = 0
        for seg in STEPS[pos]:
            for s in range(seg.step_mask.shape[0]):
                batch = jax.tree.map(lambda v, s=s: v[s], seg)
                if not batch.step_mask or batch.example_mask.sum() == 0:
                    continue
                g = grad(params, batch, jax.random.fold_in(key, taken))
                updates, opt_state = opt.update(g, opt_state, params)
                params = optax.apply_updates(params, updates)
                taken += 1
        out.append({p: np.asarray(v) for p, v in flatten_paths(params).items()})
    return out


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_frozen_parts_are_constants_passed_once_and_never_sent(chunk_size: int | None) -> None:
    from fedjax_split.fed.roles import critical_layer_rule, freeze_rule, partition

    rule = freeze_rule(critical_layer_rule(1, LAYERS), "^embeddings/")  # paths match as they are
    g0, _, frozen = partition(PARAMS, rule)
    assert set(frozen) == {"embeddings"} and set(g0) == {"encoder"}
    local = {
        p: v
        for p, v in CLIENT_PARAMS.items()
        if p.startswith(("encoder/layer_1", "pooler", "classifier"))
    }
    spec = RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=chunk_size, donate=False)
    state = init_server_state(g0, FEDAVG, "float32")
    frozen_before = {p: np.asarray(v).copy() for p, v in flatten_paths(frozen).items()}
    state, new_local, result = run_round(
        spec, state, _unflatten(local), WEIGHTS, STEPS, SEED_KEY, frozen=frozen
    )
    ref = _frozen_reference(g0, frozen)
    for path, value in flatten_paths(state.master).items():
        np.testing.assert_allclose(
            np.asarray(value), _numpy_weighted_mean(ref, path), rtol=2e-5, atol=2e-6, err_msg=path
        )
    for path, value in flatten_paths(new_local).items():
        for k in range(K):
            np.testing.assert_allclose(np.asarray(value[k]), ref[k][path], rtol=2e-5, atol=2e-6)
    for path, value in frozen_before.items():
        for k in range(K):  # the reference's frozen leaves never moved ...
            np.testing.assert_array_equal(ref[k][path], value)
        np.testing.assert_array_equal(np.asarray(flatten_paths(frozen)[path]), value)  # nor ours
    # ... and they are not the server's: neither in its state nor in a message
    assert not any(p.startswith("embeddings/") for p in flatten_paths(state.master))
    assert result.bytes_down == result.bytes_up == 4 * _LAYER * K


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_a_scheduled_round_trains_only_its_layer_and_leaves_the_rest_exact(chunk_size) -> None:
    g0, _ = split_params(PARAMS, critical_layer=LAYERS)
    trained = frozenset(
        p for p in flatten_paths(g0) if p.startswith(("encoder/layer_1/", "classifier/"))
    )
    opt = server_optimizers.fedavgm(1.0, momentum=0.9)
    # fp32 wire: a 16-bit one would round some of the clients' small steps away entirely
    spec = RoundSpec(CLIENT, opt, "float32", chunk_size=chunk_size, donate=False, trained=trained)
    start = init_server_state(g0, opt, "float32")
    state, new_local, result = run_round(spec, start, {}, WEIGHTS, STEPS, SEED_KEY)
    before, after = flatten_paths(start.master), flatten_paths(state.master)
    for path in before:
        if path in trained:
            assert not np.array_equal(after[path], before[path]), path
        else:
            np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    # the same round with everything trained moves the other layers: the schedule did the work
    free = run_round(
        dataclasses.replace(spec, trained=None), start, {}, WEIGHTS, STEPS, SEED_KEY
    )[0]
    assert not np.array_equal(
        flatten_paths(free.master)["encoder/layer_0/output/bias"],
        before["encoder/layer_0/output/bias"],
    )
    assert result.bytes_up == 4 * (_LAYER + HIDDEN * 3 + 3) * K  # the trained part only
    assert result.bytes_down == 4 * _global_param_count(LAYERS) * K  # the whole global part


@pytest.mark.parametrize(
    "spec",
    [
        SPEC_FEDAVG,  # stacked: one program per stacked step, all clients
        RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=1, donate=True,
                  devices=tuple(jax.devices()[:1])),  # one at a time, one device
        RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=1, donate=True,
                  devices=tuple(jax.devices()[:2])),  # one at a time, two devices at once
    ],
    ids=["stacked", "one-at-a-time", "two-devices"],
)  # fmt: skip
def test_progress_counts_grow_and_leave_the_round_bit_identical(spec: RoundSpec) -> None:
    """With a progress hook the round waits for each program a device's worth behind the latest
    and reports what finished: counts only grow, never pass the round's real steps and examples,
    and the round's outputs are bit-identical to the round without a hook."""
    from fedjax_split.sim.round_progress import RoundProgress, real_counts

    # STEPS' shapes (the module's other rounds compiled them), more of them
    segs = per_client(make_segments(np.random.default_rng(1), [3, 1, 2], 3, num_segments=4))
    ids = np.array([0, 2, 5], np.int32)
    state, local = _setup(1)
    a = run_round(spec, state, local, WEIGHTS, segs, SEED_KEY, client_ids=ids)
    seen: list[RoundProgress] = []
    state, local = _setup(1)
    b = run_round(spec, state, local, WEIGHTS, segs, SEED_KEY, client_ids=ids,
                  on_progress=seen.append)  # fmt: skip
    chex.assert_trees_all_equal(a, b, strict=True)  # bit-identical, dtypes too

    steps = sum(real_counts(s)[0] for c in segs for s in c)
    examples = sum(real_counts(s)[1] for c in segs for s in c)
    assert steps == int(np.sum(b[2].metrics.num_steps))  # the counts are the client update's
    # every program but the last `lag` is reported (the last ones the round's results tell)
    programs = (max(len(c) for c in segs) if spec.chunk_size is None
                else sum(len(c) for c in segs))  # fmt: skip
    lag = 1 if spec.chunk_size is None else len(spec.devices)
    assert len(seen) == programs - lag >= 2
    assert all(p.clients == K and p.steps == steps for p in seen)
    for field in ("clients_done", "steps_done", "examples_done"):
        got = [getattr(p, field) for p in seen]
        assert got == sorted(got) and got[-1] <= {"clients_done": K, "steps_done": steps,
                                                  "examples_done": examples}[field]  # fmt: skip
    assert seen[0].steps_done > 0 and seen[-1].steps_done > seen[0].steps_done
    assert seen[-1].steps_done < steps  # the last program was not waited for


# Client-level DP and a study's attack in a round. Clients one at a time share the module's
# compiled client programs (only the aggregation compiles anew); the update norms of the three
# clients here are 0.133, 0.069 and 0.075 (`_reference`), so a clip norm of 0.1 clips client 0.
def _dp_spec(chunk_size: int | None, clip: float = 0.1, z: float = 0.5,
             quantile: float | None = None) -> RoundSpec:  # fmt: skip
    dp = privacy.DPSpec(clip=clip, noise_multiplier=z, denominator=3.0, target_quantile=quantile)
    return RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=chunk_size, donate=False,
                     aggregator=Aggregator(dp=dp))  # fmt: skip


SECRET = ServerSecret.from_seed(5)  # the tests' noise: reproducible on purpose


def _dp_run(spec: RoundSpec, rng: jax.Array = SEED_KEY, noise_key: Any = None, **kw):
    g, _ = split_params(PARAMS, critical_layer=1)
    _, local = _setup(1)
    state = init_server_state(g, FEDAVG, "float32", aggregation.init_state(spec.aggregator))
    noise_key = SECRET.noise_key(0) if noise_key is None else noise_key
    return run_round(spec, state, local, WEIGHTS, STEPS, rng, noise_key=noise_key, **kw)


def _count_deviate(round_index: int = 0) -> float:
    """The standard normal deviate of adaptive clipping's count noise in a round, derived here:
    the second half of the split of the round's noise key."""
    key = SECRET.noise_key(round_index)
    return float(jax.random.normal(jax.random.split(key)[1], (), jnp.float32))


def _update(state, start) -> dict:
    """Path -> the server's step of the global part in float64."""
    before = flatten_paths(start)
    return {p: np.asarray(v, np.float64) - np.asarray(before[p], np.float64)
            for p, v in flatten_paths(state.master).items()}  # fmt: skip


@pytest.mark.parametrize("quantile", [None, 0.5], ids=["fixed-clip", "adaptive-clip"])
def test_a_dp_round_stacked_equals_clients_one_at_a_time(quantile: float | None) -> None:
    z = 0.5 if quantile is None else 0.2  # adaptive: z < 2 sigma_b = 0.3
    a = _dp_run(_dp_spec(None, z=z, quantile=quantile))
    b = _dp_run(_dp_spec(1, z=z, quantile=quantile))
    chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)
    state, _, result = a
    assert int(state.round) == 1 and bool(np.all(result.accepted))
    np.testing.assert_allclose(np.asarray(result.update_norms), [0.1327, 0.0689, 0.0753],
                               atol=1e-4)  # fmt: skip
    clip = float(state.aggregator["clip"])
    if quantile is None:
        assert clip == pytest.approx(0.1)
    else:  # two of three within 0.1, count noise sigma_b = 3 / 20
        b = (2 + 0.15 * _count_deviate()) / 3
        assert clip == pytest.approx(0.1 * math.exp(-0.2 * (b - 0.5)), rel=1e-6)


def test_a_dp_round_without_noise_is_the_uniform_mean_of_the_clipped_updates() -> None:
    g0, _ = split_params(PARAMS, critical_layer=1)
    start = {p: np.asarray(v, np.float64) for p, v in flatten_paths(g0).items()}
    ref = _reference(g0)
    deltas = [{p: r[p].astype(np.float64) - start[p] for p in start} for r in ref]
    norms = [math.sqrt(sum(float(np.sum(d[p] ** 2)) for p in d)) for d in deltas]
    steps = {}
    for clip in (1e6, 0.1):
        state, _, _ = _dp_run(_dp_spec(1, clip=clip, z=0.0))
        steps[clip] = _update(state, g0)
        for path, got in steps[clip].items():
            # each update scaled to norm <= clip, summed, over M = 3: WEIGHTS play no part
            want = sum(d[path] * min(1.0, clip / n) for d, n in zip(deltas, norms, strict=True))
            np.testing.assert_allclose(got, want / 3, rtol=2e-5, atol=2e-6, err_msg=path)
    path = "encoder/layer_0/output/bias"  # 50x the tolerance from FedAvg's weighted mean
    assert np.abs(steps[1e6][path] - (_numpy_weighted_mean(ref, path) - start[path])).max() > 1e-4
    assert np.abs(steps[1e6][path] - steps[0.1][path]).max() > 1e-4  # and clipping mattered


def test_a_dp_rounds_noise_is_z_clip_over_m_and_its_seeds() -> None:
    g0, _ = split_params(PARAMS, critical_layer=1)
    quiet, _, _ = _dp_run(_dp_spec(1, z=0.0))
    noisy, new_local, _ = _dp_run(_dp_spec(1, z=0.5))
    # the same clients and clipping: the difference is the noise on the sum over M
    noise = np.concatenate([v.ravel() for v in _update(noisy, quiet.master).values()])
    assert noise.size == _global_param_count(1)
    assert noise.std() == pytest.approx(0.5 * 0.1 / 3, rel=0.06)
    assert abs(noise.mean()) < 5 * (0.5 * 0.1 / 3) / math.sqrt(noise.size)
    # the same keys: bit for bit the same round; another noise key, the same run key: the
    # clients train alike (their local parts are the same) and only the noise differs
    again = _dp_run(_dp_spec(1, z=0.5))
    chex.assert_trees_all_equal((noisy, new_local), again[:2], strict=True)
    other, other_local, _ = _dp_run(_dp_spec(1, z=0.5), noise_key=ServerSecret.fresh().noise_key(0))
    bias = "embeddings/LayerNorm/bias"
    assert not np.any(flatten_paths(other.master)[bias] == flatten_paths(noisy.master)[bias])
    chex.assert_trees_all_equal(other_local, new_local)


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["stacked", "one-at-a-time"])
def test_a_dp_round_without_the_servers_noise_key_is_refused(chunk_size: int | None) -> None:
    g, _ = split_params(PARAMS, critical_layer=1)
    _, local = _setup(1)
    spec = _dp_spec(chunk_size)
    state = init_server_state(g, FEDAVG, "float32", aggregation.init_state(spec.aggregator))
    with pytest.raises(ValueError, match="secret noise key"):  # never a key made from the seed
        run_round(spec, state, local, WEIGHTS, STEPS, SEED_KEY)


@pytest.mark.parametrize("quantile", [None, 0.5], ids=["fixed-clip", "adaptive-clip"])
def test_a_dp_round_that_sampled_nobody_moves_the_global_part_by_noise_alone(quantile) -> None:
    spec = _dp_spec(None, clip=0.2, z=0.25, quantile=quantile)
    g0, _ = split_params(PARAMS, critical_layer=1)
    start = init_server_state(g0, FEDAVG, "float32", aggregation.init_state(spec.aggregator))
    local = {"anything": jnp.ones(2)}
    state, new_local, result = run_round(spec, start, local, np.zeros(0), [], SEED_KEY,
                                         noise_key=SECRET.noise_key(0))  # fmt: skip
    assert new_local is local and int(state.round) == 1
    assert result.bytes_up == result.bytes_down == 0
    assert result.train_loss.shape == result.accepted.shape == result.update_norms.shape == (0,)
    step = np.concatenate([v.ravel() for v in _update(state, g0).values()])
    z = spec.aggregator.dp.update_noise_multiplier
    assert step.std() == pytest.approx(z * 0.2 / 3, rel=0.06) and np.all(step != 0)
    clip = float(state.aggregator["clip"])
    if quantile is None:
        assert clip == pytest.approx(0.2)
    else:  # nobody counted: the centred count is its noise alone, b = noise / 3 + 1/2
        b = 0.15 * _count_deviate() / 3 + 0.5
        assert clip == pytest.approx(0.2 * math.exp(-0.2 * (b - 0.5)), rel=1e-6) and clip != 0.2
    # without DP an empty round leaves the global part exactly where it was
    plain = init_server_state(g0, FEDAVG, "float32")
    state, _, _ = run_round(SPEC_FEDAVG, plain, local, np.zeros(0), [], SEED_KEY)
    chex.assert_trees_all_equal(state.master, plain.master)


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["stacked", "one-at-a-time"])
def test_update_factors_flip_an_attackers_update(chunk_size: int | None) -> None:
    spec = RoundSpec(CLIENT, FEDAVG, "float32", chunk_size=chunk_size, donate=False)
    g0, _ = split_params(PARAMS, critical_layer=1)
    flips = np.array([1.0, -1.0, 1.0], np.float32)  # client 1 attacks
    state, new_local, result = _run(spec, 1, update_factors=flips)
    ref = _reference(g0)
    start = {p: np.asarray(v, np.float64) for p, v in flatten_paths(g0).items()}
    for p in start:  # client 1 uploads received - its update
        ref[1][p] = 2 * start[p] - ref[1][p]
    for path, value in flatten_paths(state.master).items():
        np.testing.assert_allclose(np.asarray(value), _numpy_weighted_mean(ref, path),
                                   rtol=2e-5, atol=2e-6, err_msg=path)  # fmt: skip
    # only the upload is tampered with: the attacker's own local part trained as usual
    honest = _run(spec, 1)
    chex.assert_trees_all_equal(new_local, honest[1])
    assert bool(np.all(result.accepted))


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["stacked", "one-at-a-time"])
def test_a_linear_client_schedule_runs_over_each_clients_own_steps(chunk_size) -> None:
    """Clients of 6, 2 and 4 real steps each warm up and decay over their own steps, stacked
    (padded to the longest) or one at a time: equal to each client's update run alone."""
    opt = client_optimizer("sgd", 0.3, schedule="linear", warmup_ratio=0.3, clip_norm=1.0)
    client = dataclasses.replace(CLIENT, optimizer=opt)
    spec = RoundSpec(client, FEDAVG, "float32", chunk_size=chunk_size, donate=False)
    state, new_local, result = _run(spec, LAYERS)
    assert [int(s) for s in result.metrics.num_steps] == [6, 2, 4]
    update = jax.jit(make_client_update(client))
    g0, _ = split_params(PARAMS, critical_layer=LAYERS)
    alone = []
    for k in range(K):
        own = {p: v[k] for p, v in CLIENT_PARAMS.items()}
        own.update(flatten_paths(g0))
        key = jax.random.fold_in(jax.random.fold_in(SEED_KEY, 0), k)
        new, _, _ = update(_unflatten(own), {}, STEPS[k], key)
        alone.append({p: np.asarray(v) for p, v in flatten_paths(new).items()})
    for path, value in flatten_paths(state.global_params).items():
        want = _numpy_weighted_mean(alone, path)
        np.testing.assert_allclose(np.asarray(value), want, rtol=2e-5, atol=2e-6, err_msg=path)
    # one schedule for all (the longest client's 6 steps) would end elsewhere: the test can fail
    wrong = dataclasses.replace(client, optimizer=optax.chain(
        optax.clip_by_global_norm(1.0), optax.sgd(0.3), _fixed_total(0.3, 6)))  # fmt: skip
    state_wrong, _, _ = _run(RoundSpec(wrong, FEDAVG, "float32", donate=False), LAYERS)
    pairs = zip(jax.tree.leaves(state.global_params), jax.tree.leaves(state_wrong.global_params),
                strict=True)  # fmt: skip
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs)
    assert diff > 1e-4


def _fixed_total(ratio: float, total: int) -> optax.GradientTransformation:
    """`linear_warmup_decay` whose total is fixed at `total` whatever the client's steps."""
    inner = linear_warmup_decay(ratio)

    def init(params):
        state = inner.init(params)
        return state._replace(total_steps=jnp.int32(total)), None

    def update(updates, state, params=None):
        del params
        scaled, new = inner.update(updates, state[0]._replace(total_steps=jnp.int32(total)))
        return scaled, (new, None)

    return optax.GradientTransformation(init, update)
