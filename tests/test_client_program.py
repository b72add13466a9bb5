"""The program one client runs in a round: its keys, the download cast, masked steps, and that the
simulation's one-at-a-time round is exactly client_round for each client plus the aggregation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from fedcore_helpers import LAYERS, make_segments, per_client, tiny_model

import fedjax_split
from fedjax_split.fed import server_optimizers
from fedjax_split.fed.client import ClientSpec, client_optimizer
from fedjax_split.fed.client_program import (
    client_functions,
    client_key,
    client_rngs,
    client_round,
    download,
    round_rng,
)
from fedjax_split.fed.roles import critical_layer_rule, flatten_paths, freeze_rule, partition
from fedjax_split.fed.wire import cast_to_wire
from fedjax_split.sim.rounds import (
    RoundSpec,
    init_server_state,
    one_at_a_time_functions,
    run_round,
)
from fedjax_split.tasks.objectives import CLASSIFICATION

K = 3
WEIGHTS = np.array([5, 20, 75])
IDS = np.array([0, 2, 5], np.int32)  # global ids, not positions: they pick the keys
SEED_KEY = jax.random.key(42)
APPLY, PARAMS = tiny_model(dropout=0.1)
CLIENT = ClientSpec(APPLY, CLASSIFICATION, optax.sgd(0.3))  # AdamW would magnify rounding
FEDAVGM = server_optimizers.fedavgm(1.0, momentum=0.9)
STEPS = per_client(make_segments(np.random.default_rng(0), [3, 1, 2], 3, num_segments=2))


def _key_bytes(keys: jax.Array) -> list[bytes]:
    return [np.asarray(k).tobytes() for k in jax.random.key_data(keys)]


def test_keys_fold_in_round_then_client_id_and_differ_per_client_and_round() -> None:
    for r in (0, 3):
        want = jax.random.fold_in(jax.random.fold_in(SEED_KEY, r), 7)
        assert _key_bytes(client_key(SEED_KEY, r, 7)[None]) == _key_bytes(want[None])
    # the vector form the simulation uses gives each client its own key, by global id
    ids = jnp.array([0, 1, 2, 5])
    rows = [client_rngs(round_rng(SEED_KEY, r), ids) for r in (0, 1)]
    for r, keys in enumerate(rows):
        alone = [client_key(SEED_KEY, r, int(i))[None] for i in ids]
        assert _key_bytes(keys) == [_key_bytes(k)[0] for k in alone]
    assert len(set(_key_bytes(rows[0]) + _key_bytes(rows[1]))) == 8


def test_download_casts_to_fp32_and_splits_off_the_untrained_part() -> None:
    wire = cast_to_wire({"a": {"w": jnp.full(3, 1.1)}, "b": {"w": jnp.full(2, 2.2)}}, "bfloat16")
    frozen = {"c": {"w": jnp.ones(4)}}
    part, constants = download(wire, frozenset({"a/w"}), frozen)
    assert set(flatten_paths(part)) == {"a/w"} and set(flatten_paths(constants)) == {"b/w", "c/w"}
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((part, constants)))
    want = np.asarray(wire["b"]["w"]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(constants["b"]["w"]), want)
    part, constants = download(wire, None)  # everything trained, nothing frozen
    assert set(flatten_paths(part)) == {"a/w", "b/w"} and constants == {}


def _setup(trained_layer: bool, wire: str) -> tuple[RoundSpec, object, dict, dict]:
    """A round spec, its server state, the clients' stacked local parts and the frozen part:
    embeddings frozen, layer 0 global (with `trained_layer`: only its attention trained)."""
    g0, local, frozen = partition(PARAMS, freeze_rule(critical_layer_rule(1, LAYERS), "^emb"))
    trained = frozenset(p for p in flatten_paths(g0) if "/attention/" in p)
    spec = RoundSpec(CLIENT, FEDAVGM, wire, chunk_size=1, donate=False,
                     devices=tuple(jax.devices()[:1]),
                     trained=trained if trained_layer else None)  # fmt: skip
    offsets = jnp.arange(1, K + 1, dtype=jnp.float32) * 0.01
    stacked = jax.tree.map(lambda x: x[None] + offsets.reshape((K,) + (1,) * x.ndim), local)
    return spec, init_server_state(g0, FEDAVGM, wire), stacked, frozen


@pytest.mark.parametrize(
    ("trained_layer", "wire", "scheduled"),
    [(False, "float32", False), (True, "bfloat16", False), (False, "float32", True)],
)
def test_one_at_a_time_round_is_client_round_per_client_bit_for_bit(
    trained_layer: bool, wire: str, scheduled: bool
) -> None:
    spec, state, stacked, frozen = _setup(trained_layer, wire)
    if scheduled:  # FedNLP's client: client_round counts each client's own steps for it
        opt = client_optimizer("sgd", 0.3, schedule="linear", warmup_ratio=0.3, clip_norm=1.0)
        spec = dataclasses.replace(spec, client=dataclasses.replace(CLIENT, optimizer=opt))
    got_state, got_local, result = run_round(
        spec, state, stacked, WEIGHTS, STEPS, SEED_KEY, client_ids=IDS, frozen=frozen
    )
    finished = []
    for i in range(K):
        own = jax.tree.map(lambda x, i=i: x[i], stacked)
        key = client_key(SEED_KEY, 0, int(IDS[i]))
        up, new_local, metrics = client_round(
            spec, state.global_params, own, STEPS[i], key, frozen
        )
        row = jax.tree.map(lambda x, i=i: x[i], (got_local, result.metrics))
        chex.assert_trees_all_equal((new_local, metrics), row, strict=True)  # dtypes too
        finished.append((up, new_local, metrics))
    # ... and the round's server step is the aggregation of exactly those uploads
    combine = one_at_a_time_functions(spec).combine
    uploads = tuple(up for up, _, _ in finished)
    combined = combine(state, uploads, WEIGHTS, SEED_KEY)[0]
    chex.assert_trees_all_equal(combined, got_state, strict=True)
    chex.assert_trees_all_equal_dtypes(combined, got_state)  # strict compares bfloat16 as fp32
    before, after = flatten_paths(state.master), flatten_paths(got_state.master)
    assert any(not np.array_equal(before[p], after[p]) for p in before)  # the round did train
    if wire != "float32":
        return  # a 16-bit upload may round the vmapped round's slightly different sums apart
    # the vmapped round trains the same clients (up to the order of its vectorised sums)
    vmapped = dataclasses.replace(spec, chunk_size=None)
    other = run_round(vmapped, state, stacked, WEIGHTS, STEPS, SEED_KEY, client_ids=IDS,
                      frozen=frozen)  # fmt: skip
    chex.assert_trees_all_close(other[:2], (got_state, got_local), rtol=1e-5, atol=1e-6)


def test_masked_steps_leave_the_client_state_bitwise_unchanged() -> None:
    spec, state, stacked, frozen = _setup(False, "float32")
    program = client_functions(spec)
    own = jax.tree.map(lambda x: x[0], stacked)
    key = client_key(SEED_KEY, 0, 0)
    client_state = program.start_one(state.global_params, own, key)
    client_state = program.segment_one(client_state, state.global_params,
                                       STEPS[0][0].for_training(), key, frozen)  # fmt: skip
    before = jax.tree.map(lambda x: np.asarray(x).copy(), client_state)
    steps_before = int(client_state.steps)
    seg = STEPS[0][1].for_training()
    masked = seg.replace(step_mask=np.zeros_like(seg.step_mask))  # padded steps
    empty = seg.replace(example_mask=np.zeros_like(seg.example_mask))  # steps without a real row
    for padding in (masked, empty):
        client_state = program.segment_one(client_state, state.global_params, padding, key,
                                           frozen)  # fmt: skip
        chex.assert_trees_all_equal(client_state, before, strict=True)  # bitwise, dtypes too
    # the same segment unmasked does train
    client_state = program.segment_one(client_state, state.global_params, seg, key, frozen)
    assert int(client_state.steps) > steps_before


def test_one_program_whatever_executes_the_client() -> None:
    spec, *_ = _setup(False, "float32")
    program = client_functions(spec)
    assert tuple(one_at_a_time_functions(spec))[:4] == tuple(program)
    vmapped = dataclasses.replace(spec, chunk_size=None, devices=None, donate=True)
    assert client_functions(vmapped) is program  # the program does not depend on the executor
    assert client_functions(dataclasses.replace(spec, wire_dtype="bfloat16")) is not program
    assert fedjax_split.client_round is client_round and fedjax_split.client_key is client_key


def test_the_client_program_imports_no_simulation() -> None:
    code = (
        "import sys, fedjax_split.fed.client_program; "
        "print(sorted(m for m in sys.modules if m.startswith(('fedjax_split.sim', "
        "'fedjax_split.run.experiment', 'fedjax_split.deploy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
