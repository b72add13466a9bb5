"""One client's local training in a round: E epochs of mini-batches as `lax.scan`s over steps.

The client starts from the received global part and its own persistent local part, trains the
merged model with its client optimiser (AdamW by default, SGD as in the paper's Algorithm 1), and
returns the new global part (to upload), the new local part (kept) and training metrics. Frozen
parameters (and global ones a schedule leaves out of the round) enter the model as constants: no
gradient, no optimiser state, no FedProx term.

The optimiser state is initialised afresh at the start of every round: that is FedNLP's practice,
and keeping AdamW moments per client would cost two extra copies of the model per client. A
learning-rate schedule of the client optimiser therefore runs over the local steps of one round.

A step (one mini-batch of B examples, one optimiser update) arrives as one or more parts of the
run's one shape (`data.batching`: a packed step of more tokens than a part holds spans several).
Each part adds the gradient of its summed loss to the step's sum; the step's last part
(`last_part`) divides by the step's loss units (examples, or labelled tokens), adds FedProx's
gradient and updates, so the update is the gradient of the step's mean loss however the step was
cut. Padded parts (step_mask False, from clients with fewer parts) leave parameters AND optimiser
state exactly as they were, by selecting the old values rather than multiplying an update by
zero. Dropout keys are `fold_in(rng, k)` with k the number of real steps taken so far (a step's
part p > 0: `fold_in` of that with p), so padding does not shift a client's key sequence either:
a padded client ends bitwise where it would alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_split.data.batch import Batch, apply_batch
from fedjax_split.errors import UserError
from fedjax_split.fed.roles import merge_params

Apply = Callable[..., jax.Array]
Segment = Batch  # a client's segment: a Batch (or PackedBatch) with a leading step axis S


class ClientMetrics(NamedTuple):
    """Training metrics of one client in one round (scalars; stacked [K] by rounds)."""

    loss_sum: jax.Array  # sum of the data losses (no FedProx term) over the loss's units
    num_examples: jax.Array  # the loss's units processed, all epochs: real examples (labelled
    # tokens for a token task), so that loss_sum / num_examples is the objective's mean loss
    num_steps: jax.Array  # real (unmasked) optimiser steps


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """What a client update needs: the model's `apply`, the task's objective (its loss: see
    `tasks.objectives`), the optimiser, FedProx mu."""

    apply: Apply
    objective: Any
    optimizer: optax.GradientTransformation
    prox_mu: float = 0.0


def _decay_mask(params: Any) -> Any:
    # HF's BERT recipe: no weight decay on biases and LayerNorm parameters (the 1-D leaves).
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def default_client_optimizer(
    learning_rate: optax.ScalarOrSchedule = 5e-5, weight_decay: float = 0.01
) -> optax.GradientTransformation:
    """AdamW as in BERT fine-tuning (decay on matrices only); `learning_rate` may be a schedule."""
    return optax.adamw(learning_rate, weight_decay=weight_decay, mask=_decay_mask)


CLIENT_OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "linear")


class RoundScheduleState(NamedTuple):
    """`linear_warmup_decay`'s state: the steps taken this round and the client's steps in it."""

    count: jax.Array  # int32
    total_steps: jax.Array  # int32: set by `ClientFns.init` from the client's own steps


def linear_warmup_decay(warmup_ratio: float) -> optax.GradientTransformation:
    """Scales the updates by transformers' `get_linear_schedule_with_warmup` over one client's
    round (FedNLP's client schedule): with W = ceil(total * warmup_ratio), step k's factor is
    k / max(1, W) below W, then max(0, (total - k) / max(1, total - W)). So the first step of a
    round with warmup moves nothing, as in torch, where the scheduler steps after the optimiser.
    `total` is each client's own number of steps this round, which `init` cannot know: the
    client update sets it (`with_total_steps`), so clients of different sizes decay to zero each
    at its own last step."""
    if not 0.0 <= warmup_ratio < 1.0:
        raise UserError(f"--warmup-ratio must be in [0, 1), got {warmup_ratio}")
    warmup_of = _warmup_steps(warmup_ratio)

    def init(params: Any) -> RoundScheduleState:
        del params
        return RoundScheduleState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update(updates: Any, state: RoundScheduleState, params: Any = None):
        del params
        total = state.total_steps.astype(jnp.float32)
        warmup = warmup_of(state.total_steps).astype(jnp.float32)
        k = state.count.astype(jnp.float32)
        factor = jnp.where(
            k < warmup,
            k / jnp.maximum(1.0, warmup),
            jnp.maximum(0.0, (total - k) / jnp.maximum(1.0, total - warmup)),
        )
        scaled = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
        return scaled, RoundScheduleState(state.count + 1, state.total_steps)

    return optax.GradientTransformation(init, update)


_EXACT_UP_TO = 1 << 15  # a round's steps up to which the warm-up length is looked up exactly


def _warmup_steps(ratio: float) -> Callable[[jax.Array], jax.Array]:
    """total -> ceil(total * ratio) as transformers computes it, in float64 (`math.ceil`): a
    table for totals up to 32,768 steps, float32 above. float32 alone is off by one for some
    ratios (0.3 at 50 steps: float32 16, float64 15), not for 0.05, 0.06, 0.1 or 0.2."""
    table = np.ceil(np.arange(_EXACT_UP_TO + 1, dtype=np.float64) * ratio).astype(np.int32)

    def warmup(total: jax.Array) -> jax.Array:
        exact = jnp.asarray(table)[jnp.minimum(total, _EXACT_UP_TO)]
        approx = jnp.ceil(total.astype(jnp.float32) * ratio).astype(jnp.int32)
        return jnp.where(total <= _EXACT_UP_TO, exact, approx)

    return warmup


def with_total_steps(opt_state: Any, total_steps: jax.Array | int | None) -> Any:
    """`opt_state` with every `RoundScheduleState`'s total set to the client's steps this round;
    a state without a round schedule is returned as it is."""
    scheduled = optax.tree_utils.tree_get_all_with_path(opt_state, "total_steps")
    if not scheduled:
        return opt_state
    if total_steps is None:
        raise UserError("a linear client schedule needs each client's number of steps this round")
    return optax.tree_utils.tree_set(opt_state, total_steps=jnp.asarray(total_steps, jnp.int32))


def client_optimizer(
    name: str,
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float | None = None,
    *,
    schedule: str = "constant",
    warmup_ratio: float = 0.0,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """Client optimiser by name: "adamw" (default; weight decay 0.01 unless given) or "sgd" (the
    paper's Algorithm 1, no weight decay), with the gradient clipped to a global L2 norm first if
    `clip_norm` is given and, with the "linear" schedule, the learning rate warmed up and decayed
    over each client's round (`linear_warmup_decay`): FedNLP's client is
    `client_optimizer("sgd", 5e-5, schedule="linear", warmup_ratio=0.06, clip_norm=1.0)`. The
    defaults are the bare optimiser (no chain), as every earlier run trained."""
    if name not in CLIENT_OPTIMIZERS:
        raise UserError(f"unknown client optimizer {name!r}; use adamw or sgd")
    if schedule not in LR_SCHEDULES:
        raise UserError(f"unknown learning-rate schedule {schedule!r}; use constant or linear")
    if schedule == "constant" and warmup_ratio:
        raise UserError("--warmup-ratio needs --lr-schedule linear")
    if clip_norm is not None and not clip_norm > 0:
        raise UserError(f"--client-clip-norm must be positive, got {clip_norm}")
    if name == "sgd" and weight_decay is not None:
        raise UserError("SGD here has no weight decay; drop weight_decay or use adamw")
    base = (default_client_optimizer(learning_rate, 0.01 if weight_decay is None else weight_decay)
            if name == "adamw" else optax.sgd(learning_rate))  # fmt: skip
    if schedule == "constant" and clip_norm is None:
        return base
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm is not None else []
    parts.append(base)
    if schedule == "linear":  # after the optimiser: AdamW's decoupled decay is scheduled too
        parts.append(linear_warmup_decay(warmup_ratio))
    return optax.chain(*parts)


def ends_step(seg: Segment, xp: Any = jnp) -> Any:
    """[S] whether each part of a segment ends its step (`last_part`; None: every part does)."""
    if seg.last_part is None:
        return xp.ones(seg.step_mask.shape, bool)
    return xp.reshape(xp.asarray(seg.last_part), seg.step_mask.shape)


def real_steps(segments: Sequence[Segment], xp: Any = jnp) -> Any:
    """A client's optimiser steps in a round: the parts that are not padding, hold at least one
    real example and end their step, the count `ClientState.steps` reaches. `xp=jnp` traces (an
    int32 array); a host that holds the batches counts them with `xp=np` (an integer, no device
    work)."""
    total = xp.zeros([], xp.int32)
    for seg in segments:
        rows = xp.reshape(xp.asarray(seg.example_mask), (seg.step_mask.shape[0], -1))
        real = xp.logical_and(xp.asarray(seg.step_mask), xp.sum(rows, axis=1) > 0)
        total = total + xp.sum(xp.logical_and(real, ends_step(seg, xp)), dtype=xp.int32)
    return total


def step_rng(client_rng: jax.Array, step: jax.Array | int) -> jax.Array:
    """Dropout key of a client's `step`-th real step."""
    return jax.random.fold_in(client_rng, step)


def prox_term(global_params: Any, received_global: Any, mu: float) -> jax.Array:
    """FedProx's (mu/2) ||w_g - w_g_received||^2 over the global part only."""
    sq = [
        jnp.sum(jnp.square(w - w0))
        for w, w0 in zip(
            jax.tree.leaves(global_params), jax.tree.leaves(received_global), strict=True
        )
    ]
    return 0.5 * mu * sum(sq, jnp.zeros([], jnp.float32))


class ClientState(NamedTuple):
    """A client's training state inside a round (stacked [K] when vmapped by rounds)."""

    params: tuple[Any, Any]  # (global part, local part) being trained
    opt_state: Any  # client optimiser state, fresh each round
    steps: jax.Array  # int32 real steps so far: the index of the next dropout key
    loss_sum: jax.Array  # fp32 sum of the data losses
    num_examples: jax.Array  # fp32 loss units seen (see ClientMetrics)
    grad_sum: Any = None  # the current step's parts' summed-loss gradients (like params)
    step_units: jax.Array | None = None  # fp32 the current step's loss units so far
    part: jax.Array | None = None  # int32 the current step's parts so far


class ClientFns(NamedTuple):
    """The client update in three pure pieces, so that a round can compile one scan per segment
    shape (length buckets x epochs repeat shapes) instead of one per segment."""

    init: Callable[..., ClientState]
    train_segment: Callable[[ClientState, Segment, Any, jax.Array, Any], ClientState]
    finish: Callable[[ClientState], tuple[Any, Any, ClientMetrics]]


def _update(spec: ClientSpec, state: ClientState, received: Any) -> ClientState:
    """A step's update from its parts' summed-loss gradients: that of the step's mean loss (plus
    FedProx's pull on the global part towards `received`)."""
    params = state.params
    grads = jax.tree.map(lambda x: x / jnp.maximum(state.step_units, 1.0), state.grad_sum)
    if spec.prox_mu:
        pull = jax.grad(prox_term)(params[0], received, spec.prox_mu)
        grads = (jax.tree.map(jnp.add, grads[0], pull), grads[1])
    updates, new_opt_state = spec.optimizer.update(grads, state.opt_state, params)
    return state._replace(
        params=optax.apply_updates(params, updates),
        opt_state=new_opt_state,
        steps=state.steps + 1,
        grad_sum=jax.tree.map(jnp.zeros_like, state.grad_sum),
        step_units=jnp.zeros([], jnp.float32),
        part=jnp.zeros([], jnp.int32),
    )


def make_client_fns(spec: ClientSpec) -> ClientFns:
    """`init(global, local, total_steps=None)` (the client's steps this round, `real_steps`: a
    linear client schedule needs it), `train_segment(state, segment, received_global, rng,
    constants)` (one segment, arrays [S, B, T] or packed; `received_global` is the downloaded
    global part FedProx pulls towards; `constants` the frozen parameters, fp32, not trained) and
    `finish(state) -> (global, local, metrics)`. All pure and jit/vmap-able."""
    opt = spec.optimizer

    def loss_fn(
        trainable: tuple[Any, Any], batch: Batch, key: jax.Array, constants: Any
    ) -> tuple[jax.Array, jax.Array]:
        g, loc = trainable
        params = merge_params(g, loc, constants)
        logits = apply_batch(spec.apply, params, batch, train=True, rng=key)
        return spec.objective.loss_sums(logits, batch.labels, batch.example_mask)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def init(global_params: Any, local_params: Any, total_steps: Any = None) -> ClientState:
        trainable = (global_params, local_params)
        zero = jnp.zeros([], jnp.float32)
        opt_state = with_total_steps(opt.init(trainable), total_steps)
        start = jnp.zeros([], jnp.int32)
        return ClientState(trainable, opt_state, start, zero, zero,
                           jax.tree.map(jnp.zeros_like, trainable), zero, start)  # fmt: skip

    def train_segment(
        state: ClientState, segment: Segment, received: Any, rng: jax.Array, constants: Any = None
    ) -> ClientState:
        constants = {} if constants is None else constants

        def real_part(state: ClientState, batch: Batch) -> ClientState:
            key = step_rng(rng, state.steps)  # a step's later parts draw keys of their own
            key = jax.lax.cond(state.part == 0, lambda: key,
                               lambda: jax.random.fold_in(key, state.part))  # fmt: skip
            (loss_sum, n), grads = grad_fn(state.params, batch, key, constants)
            state = state._replace(
                grad_sum=jax.tree.map(jnp.add, state.grad_sum, grads),
                step_units=state.step_units + n,
                part=state.part + 1,
                loss_sum=state.loss_sum + loss_sum,
                num_examples=state.num_examples + n,
            )
            return jax.lax.cond(batch.last_part, lambda s: _update(spec, s, received),
                                lambda s: s, state)  # fmt: skip

        def step(state: ClientState, batch: Batch) -> tuple[ClientState, None]:
            # A part with no real example is padding too (AdamW would still decay the weights).
            # lax.cond skips the work of a padded part when clients run one at a time
            # (chunk_size=1); under vmap it becomes a select, which keeps the state exactly.
            real = jnp.logical_and(batch.step_mask, jnp.sum(batch.example_mask) > 0)
            return jax.lax.cond(real, real_part, lambda s, _: s, state, batch), None

        seg = segment.for_training()
        seg = seg.replace(last_part=ends_step(seg))
        return jax.lax.scan(step, state, seg)[0]

    return ClientFns(init, train_segment, _finish)


def _finish(state: ClientState) -> tuple[Any, Any, ClientMetrics]:
    """A client's round's end: its new global and local parts and its figures."""
    new_global, new_local = state.params
    return new_global, new_local, ClientMetrics(state.loss_sum, state.num_examples, state.steps)


def make_client_update(
    spec: ClientSpec,
) -> Callable[..., tuple[Any, Any, ClientMetrics]]:
    """Returns `update(global_params, local_params, segments, rng, constants=None) -> (global,
    local, metrics)`.

    `segments`: one client's segments in order, typed batches [S, B, T] or packed (labels and
    example_mask [S, B], step_mask [S]); `constants`: frozen parameters (not trained). The update
    is pure and jit/vmap-able; it does not jit itself.
    """
    fns = make_client_fns(spec)

    def update(
        global_params: Any,
        local_params: Any,
        segments: Sequence[Segment],
        rng: jax.Array,
        constants: Any = None,
    ):
        state = fns.init(global_params, local_params, real_steps(segments))
        for seg in segments:
            state = fns.train_segment(state, seg, global_params, rng, constants)
        return fns.finish(state)

    return update
