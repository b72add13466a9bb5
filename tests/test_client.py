"""Client update: loss vs an independent reference, masks, padding, FedProx, keys, metrics."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fedcore_helpers import client_slice, make_segments, reference_loss, tiny_model

from fedjax_split.errors import UserError
from fedjax_split.fed.client import (
    ClientSpec,
    client_optimizer,
    default_client_optimizer,
    linear_warmup_decay,
    make_client_fns,
    make_client_update,
    prox_term,
    real_steps,
    step_rng,
    with_total_steps,
)
from fedjax_split.fed.roles import merge_params, split_params
from fedjax_split.tasks.objectives import CLASSIFICATION, REGRESSION


@pytest.mark.parametrize("num_labels", [3, 1])
def test_two_sgd_steps_match_reference_gradient(num_labels: int) -> None:
    apply, params = tiny_model(num_labels)
    segs = make_segments(np.random.default_rng(0), [2], 2, num_labels=num_labels)
    seg = client_slice(segs, 0)
    lr = 0.5
    spec = ClientSpec(apply, REGRESSION if num_labels == 1 else CLASSIFICATION, optax.sgd(lr))
    g, loc = split_params(params, critical_layer=1)
    rng = jax.random.key(7)
    new_g, new_l, metrics = jax.jit(make_client_update(spec))(g, loc, seg, rng)

    p = params
    losses = []
    for s in range(2):
        batch = jax.tree.map(lambda v, s=s: v[s], seg[0])
        loss, grads = jax.value_and_grad(reference_loss, argnums=1)(
            apply, p, batch, jax.random.fold_in(rng, s), num_labels == 1
        )
        losses.append(float(loss) * batch.example_mask.sum())
        p = jax.tree.map(lambda w, d: w - lr * d, p, grads)
    chex.assert_trees_all_close(merge_params(new_g, new_l), p, rtol=1e-5, atol=1e-6)
    assert int(metrics.num_steps) == 2
    assert float(metrics.num_examples) == 4 + 3  # the last batch has one padding row
    np.testing.assert_allclose(float(metrics.loss_sum), sum(losses), rtol=1e-5)


def _train_both(apply, params, alone, padded, key):
    """(update, global, local, its result on `alone`, on `padded`): one client update (AdamW,
    FedProx, jitted) on the same real steps without and with masked ones."""
    spec = ClientSpec(apply, CLASSIFICATION, default_client_optimizer(1e-3), prox_mu=0.01)
    update = jax.jit(make_client_update(spec))
    g, loc = split_params(params, critical_layer=1)
    return update, g, loc, update(g, loc, alone, key), update(g, loc, padded, key)


def test_padded_steps_leave_client_bitwise_unchanged() -> None:
    apply, params = tiny_model(dropout=0.1)
    rng = np.random.default_rng(1)
    alone = make_segments(rng, [3], 3, num_segments=2)
    alone = client_slice(alone, 0)
    # The same real steps with padded steps interleaved, a trailing one, and an all-padded segment.
    padded = []
    for seg in alone:
        order = [0, 0, 1, 2, 2]  # duplicates of real batches, to be masked out
        p = jax.tree.map(lambda v, o=order: v[o], seg)
        padded.append(p.replace(step_mask=np.array([True, False, True, True, False])))
    empty = jax.tree.map(lambda v: v[:2].copy(), alone[0])
    padded.insert(1, empty.replace(step_mask=np.array([False, False])))
    # A step marked real but with no real example counts as padding too.
    no_rows = jax.tree.map(lambda v: v[:1].copy(), alone[0])
    padded.append(no_rows.replace(example_mask=np.zeros_like(no_rows.example_mask)))

    key = jax.random.key(3)
    update, g, loc, a, b = _train_both(apply, params, alone, padded, key)
    chex.assert_trees_all_equal(a, b, strict=True)  # bitwise: values, dtypes and shapes
    assert int(b[2].num_steps) == 6
    # and the padding really was there to be ignored: without masks the result differs
    unmasked = [s.replace(step_mask=np.ones_like(s.step_mask)) for s in padded[:1]]
    c = update(g, loc, unmasked + padded[1:], key)
    assert not np.array_equal(
        np.asarray(c[1]["classifier"]["kernel"]), np.asarray(b[1]["classifier"]["kernel"])
    )


def test_fedprox_term_matches_closed_form() -> None:
    w = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([1.5, -2.0])}
    w0 = {"a": jnp.ones((2, 3)), "b": jnp.array([0.5, 0.0])}
    mu = 0.3
    val, grad = jax.value_and_grad(prox_term)(w, w0, mu)
    sq = sum(float(np.sum((np.asarray(w[k]) - np.asarray(w0[k])) ** 2)) for k in w)
    np.testing.assert_allclose(float(val), mu / 2 * sq, rtol=1e-6)
    for k in w:
        np.testing.assert_allclose(np.asarray(grad[k]), mu * (np.asarray(w[k]) - np.asarray(w0[k])))


def test_fedprox_in_client_update_acts_on_global_part_only() -> None:
    """With SGD(lr), step 1 has w = w0 (no prox force); step 2 differs from plain training by
    exactly -lr * mu * (w1 - w0) on global leaves and by nothing on local leaves."""
    apply, params = tiny_model(dropout=0.0)
    seg = client_slice(make_segments(np.random.default_rng(2), [2], 2), 0)
    g, loc = split_params(params, critical_layer=1)
    lr, mu = 0.5, 0.7
    key = jax.random.key(0)
    plain = jax.jit(make_client_update(ClientSpec(apply, CLASSIFICATION, optax.sgd(lr))))
    prox = jax.jit(make_client_update(ClientSpec(apply, CLASSIFICATION, optax.sgd(lr), prox_mu=mu)))
    one_step = [seg[0].replace(step_mask=np.array([True, False]))]  # same shapes: no recompile
    g1, _, _ = plain(g, loc, one_step, key)
    g2p, l2p, _ = plain(g, loc, seg, key)
    g2x, l2x, _ = prox(g, loc, seg, key)
    for x, y, a, b in zip(
        jax.tree.leaves(g2x),
        jax.tree.leaves(g2p),
        jax.tree.leaves(g1),
        jax.tree.leaves(g),
        strict=True,
    ):
        want = -lr * mu * (np.asarray(a) - np.asarray(b))
        np.testing.assert_allclose(np.asarray(x) - np.asarray(y), want, rtol=1e-3, atol=1e-7)
    leaves = zip(jax.tree.leaves(g1), jax.tree.leaves(g), strict=True)
    assert max(float(jnp.abs(a - b).max()) for a, b in leaves) > 0  # w1 != w0: prox acts
    chex.assert_trees_all_equal(l2x, l2p)


def test_dropout_keys_differ_per_step_and_follow_fold_in() -> None:
    key = jax.random.key(11)
    data = [np.asarray(jax.random.key_data(step_rng(key, s))) for s in range(4)]
    assert len({d.tobytes() for d in data}) == 4
    np.testing.assert_array_equal(
        data[2], np.asarray(jax.random.key_data(jax.random.fold_in(key, 2)))
    )
    # Two real steps on the same batch with the same params: dropout makes their grads differ,
    # so training the identical batch twice differs from SGD with one key reused (checked below).
    apply, params = tiny_model(dropout=0.3)
    seg = client_slice(make_segments(np.random.default_rng(3), [1], 1), 0)
    x = jax.tree.map(lambda v: v[0], seg[0])
    l0 = reference_loss(apply, params, x, step_rng(key, 0), False)
    l1 = reference_loss(apply, params, x, step_rng(key, 1), False)
    assert float(l0) != float(l1)


def test_client_optimizer_by_name() -> None:
    assert isinstance(client_optimizer("sgd", 0.1), optax.GradientTransformation)
    assert isinstance(client_optimizer("adamw", 1e-4), optax.GradientTransformation)
    with pytest.raises(UserError, match="adamw or sgd"):
        client_optimizer("lamb", 0.1)


def test_adamw_decays_matrices_only() -> None:
    opt = default_client_optimizer(0.1, weight_decay=0.5)
    p = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    zero = jax.tree.map(jnp.zeros_like, p)
    updates, _ = opt.update(zero, opt.init(p), p)
    np.testing.assert_allclose(np.asarray(updates["kernel"]), -0.1 * 0.5 * np.ones((2, 2)))
    np.testing.assert_array_equal(np.asarray(updates["bias"]), np.zeros(2))


def _pool(rng: np.random.Generator, lengths: np.ndarray):
    """A Tokenized pool of random ids (within the tiny model's vocabulary) of these lengths."""
    from fedjax_split.data.tokenization import Tokenized

    return Tokenized(
        [rng.integers(1, 50, n).astype(np.int32) for n in lengths],
        [(np.arange(n) > n // 2).astype(np.int32) for n in lengths],
        np.asarray(lengths, np.int32),
    )


def _steps_of(parts: list) -> list[list]:
    """A client's parts cut into its steps at each last_part."""
    steps, current = [], []
    for p in parts:
        current.append(p)
        if bool(p.last_part[0]):
            steps.append(current)
            current = []
    assert not current
    return steps


def _one_segment(parts: list):
    """A client's parts [1, ...] as one segment [S, ...] (one scan: one compilation)."""
    return jax.tree.map(lambda *x: np.concatenate(x), *parts)


def test_packed_segments_train_like_padded_ones() -> None:
    """The same batches, packed or padded, give the same update (no dropout to differ), packing
    computing fewer positions; a step whose tokens exceed a part spans two, as one update."""
    from fedjax_split.data.batching import Batching, client_batches

    apply, params = tiny_model(dropout=0.0)
    rng = np.random.default_rng(4)
    # mostly short examples, a quarter long: packed parts of the mean batch plus 2.5 sigma
    # (40 tokens here) beat B rows of the longest (4 x 16 = 64), and one step needs two parts
    lengths = np.where(rng.random(22) < 0.25, rng.integers(12, 16, 22), rng.integers(2, 8, 22))
    tok = _pool(rng, lengths)
    labels = rng.integers(0, 3, 22)
    kw = dict(epochs=2, seed=1)
    padded = client_batches(tok, np.arange(22), labels, Batching(4, packing=False), **kw)
    # rows of 16 slots: the default W (at least 64) would make N at least 64 tokens a part
    packing = Batching(4, packing=True, row_width=16)
    packed = client_batches(tok, np.arange(22), labels, packing, **kw)
    steps = _steps_of(packed)
    assert len(packed) > len(steps) == len(padded)  # some step spans two parts
    for x, step in zip(padded, steps, strict=True):  # the same examples in the same slots
        np.testing.assert_array_equal(
            x.example_index, np.max([p.example_index for p in step], axis=0)
        )
    assert sum(s.input_ids.size for s in packed) < sum(s.input_ids.size for s in padded)

    spec = ClientSpec(apply, CLASSIFICATION, default_client_optimizer(1e-2))
    update = jax.jit(make_client_update(spec))
    g, loc = split_params(params, critical_layer=1)
    a = update(g, loc, [_one_segment(padded)], jax.random.key(0))
    b = update(g, loc, [_one_segment(packed)], jax.random.key(0))
    assert float(a[2].loss_sum) == pytest.approx(float(b[2].loss_sum), rel=1e-5)
    assert int(a[2].num_steps) == int(b[2].num_steps) == len(padded)
    assert float(a[2].num_examples) == float(b[2].num_examples) == 44
    chex.assert_trees_all_close(a[:2], b[:2], rtol=1e-7, atol=2e-5)  # numpy's default rtol
    # the updates really moved the weights (so agreeing is not trivial)
    assert np.abs(a[0]["embeddings"]["word_embeddings"]["embedding"] - g["embeddings"][
        "word_embeddings"]["embedding"]).max() > 1e-3  # fmt: skip


def _cut_and_whole(batch: int = 8, n: int = 24, seed: int = 6):
    """One client's steps twice: in parts of a B W token budget (one part a step) and in parts of
    one row (N = W = 16, R = 2: several parts a step); the same examples, the same slots."""
    from fedjax_split.data.batching import Batching, client_batches

    rng = np.random.default_rng(seed)
    tok = _pool(rng, rng.integers(2, 16, n))
    labels = rng.integers(0, 3, n)
    kw = dict(epochs=2, seed=[3, 0], client_id=1)
    whole = client_batches(tok, np.arange(n), labels, Batching(batch, row_width=16,
                           part_tokens=batch * 16), **kw)  # fmt: skip
    cut = client_batches(tok, np.arange(n), labels, Batching(batch, row_width=16,
                         part_tokens=16), **kw)  # fmt: skip
    assert all(bool(p.last_part[0]) for p in whole)  # one part a step
    steps = _steps_of(cut)
    assert len(steps) == len(whole) and sum(len(s) >= 2 for s in steps) > len(steps) // 2
    for x, step in zip(whole, steps, strict=True):
        np.testing.assert_array_equal(
            x.example_index, np.max([p.example_index for p in step], axis=0)
        )
    return whole, cut


def test_a_step_cut_into_parts_trains_like_the_step_in_one_part() -> None:
    """SGD, no dropout: a step spread over several parts (gradients summed, one update at the
    step's last part, divided by the step's examples) ends where the step in one part does, up to
    the order of float sums; updating at every part instead moves elsewhere."""
    apply, params = tiny_model(dropout=0.0)
    whole, cut = _cut_and_whole()
    spec = ClientSpec(apply, CLASSIFICATION, optax.sgd(0.5))
    update = jax.jit(make_client_update(spec))
    g, loc = split_params(params, critical_layer=1)
    key = jax.random.key(2)
    a = update(g, loc, [_one_segment(whole)], key)
    b = update(g, loc, [_one_segment(cut)], key)
    chex.assert_trees_all_close(b[:2], a[:2], rtol=1e-5, atol=1e-6)
    assert int(a[2].num_steps) == int(b[2].num_steps) == len(whole) == 6
    assert float(a[2].num_examples) == float(b[2].num_examples) == 48
    assert float(b[2].loss_sum) == pytest.approx(float(a[2].loss_sum), rel=1e-6)
    moved = max(float(np.abs(x - y).max()) for x, y in
                zip(jax.tree.leaves(a[:2]), jax.tree.leaves((g, loc)), strict=True))  # fmt: skip
    assert moved > 1e-2
    # an update at every part (each on a part's mean) is another training altogether
    every = [p.replace(last_part=np.ones_like(p.last_part)) for p in cut]
    c = update(g, loc, [_one_segment(every)], key)
    assert int(c[2].num_steps) == len(cut) > 6
    far = max(float(np.abs(x - y).max()) for x, y in
              zip(jax.tree.leaves(a[:2]), jax.tree.leaves(c[:2]), strict=True))  # fmt: skip
    assert far > 1e-3, far


def test_a_steps_parts_take_their_dropout_keys_by_fold_in() -> None:
    """With dropout, a step's part 0 draws fold_in(rng, step) and its part p > 0 fold_in of that
    with p: the client update against a hand loop over the parts (SGD on the sum of the parts'
    summed losses over the step's examples)."""
    from fedjax_split.data.batch import apply_batch

    apply, params = tiny_model(dropout=0.2)
    _, cut = _cut_and_whole(batch=4, n=10, seed=8)
    lr, key = 0.5, jax.random.key(5)
    spec = ClientSpec(apply, CLASSIFICATION, optax.sgd(lr))
    g, loc = split_params(params, critical_layer=1)
    new_g, new_l, metrics = jax.jit(make_client_update(spec))(g, loc, [_one_segment(cut)], key)

    def summed_loss(w, part, k):
        logits = apply_batch(apply, w, part, train=True, rng=k)
        logp = jax.nn.log_softmax(logits, axis=-1)
        per = -jnp.take_along_axis(logp, jnp.asarray(part.labels)[:, None], axis=1)[:, 0]
        return jnp.sum(per * part.example_mask)

    grad = jax.jit(jax.grad(summed_loss))
    p, k = params, 0
    for step in _steps_of(cut):
        total, units = None, 0.0
        for q, part in enumerate(step):
            part = jax.tree.map(lambda v: v[0], part.for_training())
            part_key = step_rng(key, k) if q == 0 else jax.random.fold_in(step_rng(key, k), q)
            d = grad(p, part, part_key)
            total = d if total is None else jax.tree.map(jnp.add, total, d)
            units += float(part.example_mask.sum())
        p = jax.tree.map(lambda w, d, u=units: w - lr * d / u, p, total)
        k += 1
    chex.assert_trees_all_close(merge_params(new_g, new_l), p, rtol=1e-5, atol=1e-6)
    assert int(metrics.num_steps) == k


def test_masked_parts_leave_a_multi_part_step_bitwise_unchanged() -> None:
    """Masked parts (step_mask False) inside a step of several parts, after it, and those that
    stacking with a client of more parts appends, change no bit (dropout on, AdamW, FedProx): they
    neither add gradients, count a part (which would move the dropout keys) nor end a step,
    even when a masked copy carries last_part."""
    from fedjax_split.data.stacking import stack_clients

    apply, params = tiny_model(dropout=0.1)
    whole, cut = _cut_and_whole(batch=4, n=10, seed=9)
    alone = [_one_segment(cut)]
    # stacking with a client of more parts appends masked parts of the same shape
    mine = [jax.tree.map(lambda v: v[0], s) for s in stack_clients([cut, cut + cut[:3]])]
    assert len(mine) == len(cut) + 3 and not any(m.step_mask[0] for m in mine[len(cut) :])
    # masked copies of real parts: a step's first part inside the step, a step's last part
    # (last_part True) before its step ends, and every part once more after all
    first = _steps_of(cut)[0]
    assert len(first) >= 2
    masked = [p.replace(step_mask=np.zeros_like(p.step_mask)) for p in cut]
    order = [first[0], masked[len(first) - 1], masked[0], *first[1:], *mine[len(first):],
             *masked]  # fmt: skip
    padded = [_one_segment(order[:5]), _one_segment(order[5:])]

    key = jax.random.key(4)
    update, g, loc, a, b = _train_both(apply, params, alone, padded, key)
    chex.assert_trees_all_equal(a, b, strict=True)  # bitwise: values, dtypes and shapes
    assert int(b[2].num_steps) == len(whole) == int(real_steps(padded, np))
    # and the masked parts really were there to be ignored: without their masks it differs
    c = update(g, loc, [s.replace(step_mask=np.ones_like(s.step_mask)) for s in padded], key)
    assert not np.array_equal(
        np.asarray(c[1]["classifier"]["kernel"]), np.asarray(b[1]["classifier"]["kernel"])
    )


@pytest.mark.parametrize(("total", "ratio"), [(10, 0.25), (19, 0.06), (7, 0.0), (50, 0.3)])
def test_the_linear_schedule_is_transformers_over_the_clients_own_steps(total, ratio) -> None:
    """Factors against transformers' get_linear_schedule_with_warmup on a torch optimiser (the
    rate each torch step uses, the scheduler stepping after the optimiser, as FedNLP's trainer)."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = get_linear_schedule_with_warmup(opt, math.ceil(total * ratio), total)
    want = []
    for _ in range(total):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    schedule = linear_warmup_decay(ratio)
    state = with_total_steps(schedule.init({"w": jnp.zeros(1)}), total)
    got = []
    for _ in range(total):
        scaled, state = schedule.update({"w": jnp.ones(1)}, state)
        got.append(float(scaled["w"][0]))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert (got[0] == 0.0) == (ratio > 0)  # with warm-up the first step moves nothing


def test_sgd_with_clipping_and_the_linear_schedule_matches_a_hand_loop() -> None:
    """FedNLP's client (SGD, gradient clipped to a global norm, linear warm-up and decay over the
    client's real steps) against a loop written here: padded steps neither step the schedule nor
    count towards its total."""
    apply, params = tiny_model(dropout=0.0)
    lr, clip, ratio = 0.5, 0.05, 0.25
    seg = client_slice(make_segments(np.random.default_rng(5), [3], 5, num_segments=2), 0)
    total = 6  # 3 real steps in each of the 2 segments; 2 padded steps each
    assert int(real_steps(seg)) == total
    opt = client_optimizer("sgd", lr, schedule="linear", warmup_ratio=ratio, clip_norm=clip)
    g, loc = split_params(params, critical_layer=1)
    new_g, new_l, metrics = jax.jit(make_client_update(ClientSpec(apply, CLASSIFICATION, opt)))(
        g, loc, seg, jax.random.key(0))  # fmt: skip

    warmup = math.ceil(total * ratio)
    p, k, clipped = params, 0, 0
    for s in seg:
        for j in np.flatnonzero(np.asarray(s.step_mask)):
            batch = jax.tree.map(lambda v, j=j: v[j], s)
            key = step_rng(jax.random.key(0), k)
            grads = jax.grad(reference_loss, argnums=1)(apply, p, batch, key, False)
            norm = float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(grads))))
            scale = min(1.0, clip / norm)
            clipped += scale < 1.0
            factor = k / warmup if k < warmup else (total - k) / (total - warmup)
            p = jax.tree.map(lambda w, d, f=factor, c=scale: w - lr * f * c * d, p, grads)
            k += 1
    assert clipped == total  # the clip is active on every step, so the test sees it
    chex.assert_trees_all_close(merge_params(new_g, new_l), p, rtol=1e-5, atol=1e-6)
    assert int(metrics.num_steps) == total


def test_a_round_schedule_without_the_clients_steps_is_refused() -> None:
    apply, params = tiny_model()
    opt = client_optimizer("adamw", 1e-3, schedule="linear", warmup_ratio=0.1)
    fns = make_client_fns(ClientSpec(apply, CLASSIFICATION, opt))
    g, loc = split_params(params, critical_layer=1)
    with pytest.raises(UserError, match="number of steps"):
        fns.init(g, loc)
    assert fns.init(g, loc, 4).opt_state[-1].total_steps == 4
    plain = client_optimizer("adamw", 1e-3)  # the defaults are the bare optimiser, as before
    assert jax.tree.structure(plain.init(g)) == jax.tree.structure(
        default_client_optimizer(1e-3).init(g))  # fmt: skip
    for bad, match in [(dict(warmup_ratio=0.1), "needs --lr-schedule linear"),
                       (dict(schedule="cosine"), "constant or linear"),
                       (dict(clip_norm=0.0), "positive")]:  # fmt: skip
        with pytest.raises(UserError, match=match):
            client_optimizer("sgd", 0.1, **bad)


@pytest.mark.parametrize("ratio", [0.06, 0.3, 0.07])
def test_the_warm_up_length_is_pythons_float64_ceil_for_every_total(ratio: float) -> None:
    """ceil(total * ratio) as transformers computes it (float64); float32 alone is off by one at
    0.3 (50 steps: 16 for 15)."""
    from fedjax_split.fed.client import _warmup_steps

    totals = np.arange(0, 6000, dtype=np.int32)
    got = np.asarray(jax.jit(jax.vmap(_warmup_steps(ratio)))(jnp.asarray(totals)))
    np.testing.assert_array_equal(got, [math.ceil(int(t) * ratio) for t in totals])


def test_real_steps_counts_what_the_client_steps_on_host_and_traced() -> None:
    """Padded steps and steps whose rows are all padding are not steps; packed masks are [S, B]."""
    from fedjax_split.data.batch import Batch

    def seg(step_mask, example_mask) -> Batch:
        s, b = np.asarray(example_mask).shape
        ids = np.ones((s, b, 4), np.int32)
        return Batch(input_ids=ids, attention_mask=ids, token_type_ids=0 * ids,
                     labels=np.zeros((s, b), np.int32),
                     example_mask=np.asarray(example_mask, np.float32),
                     step_mask=np.asarray(step_mask))  # fmt: skip

    segs = [seg([True, True, False], [[1, 1], [0, 0], [1, 1]]),  # a step of padding rows only
            seg([True, True], [[1, 0], [0, 1]])]  # fmt: skip
    assert int(real_steps(segs, np)) == 3
    assert int(jax.jit(real_steps)(segs)) == 3
    assert int(real_steps([], np)) == 0


def test_sgd_takes_no_weight_decay() -> None:
    with pytest.raises(UserError, match="no weight decay"):
        client_optimizer("sgd", 0.1, weight_decay=0.01)
    assert jax.tree.structure(client_optimizer("adamw", 1e-3).init({"w": jnp.ones((2, 2))})) == (
        jax.tree.structure(default_client_optimizer(1e-3).init({"w": jnp.ones((2, 2))})))
