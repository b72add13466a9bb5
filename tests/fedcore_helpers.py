"""Shared fixtures for the federated-core tests: a tiny real BERT and hand-built segments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.models.bert import BertConfig, init_params, make_apply

VOCAB, HIDDEN, LAYERS, INTER, POS, TYPES = 50, 16, 2, 32, 16, 2


def tiny_config(num_labels: int = 3, dropout: float = 0.1) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        intermediate_size=INTER,
        max_position_embeddings=POS,
        type_vocab_size=TYPES,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
        problem_type="regression" if num_labels == 1 else "single_label_classification",
    )


def tiny_model(num_labels: int = 3, dropout: float = 0.1, seed: int = 0):
    config = tiny_config(num_labels, dropout)
    return make_apply(config), init_params(config, jax.random.key(seed))


def make_segments(
    rng: np.random.Generator,
    real_steps: list[int],
    steps: int,
    batch: int = 4,
    length: int = 6,
    num_labels: int = 3,
    num_segments: int = 1,
) -> list[Batch]:
    """Segments [K, S, B, T] with distinct random data per client; client k has real_steps[k]
    real steps per segment (the rest padded), and its last batch has one padding row."""
    k = len(real_steps)
    segs = []
    for _ in range(num_segments):
        ids = rng.integers(1, VOCAB, size=(k, steps, batch, length), dtype=np.int32)
        lengths = rng.integers(2, length + 1, size=(k, steps, batch))
        attn = (np.arange(length) < lengths[..., None]).astype(np.int32)
        ids = ids * attn
        types = ((np.arange(length) >= 3) & (attn > 0)).astype(np.int32)
        if num_labels == 1:
            labels = rng.uniform(0.0, 5.0, size=(k, steps, batch)).astype(np.float32)
        else:
            labels = rng.integers(0, num_labels, size=(k, steps, batch), dtype=np.int32)
        example_mask = np.ones((k, steps, batch), np.float32)
        step_mask = np.zeros((k, steps), bool)
        for c, r in enumerate(real_steps):
            step_mask[c, :r] = True
            example_mask[c, r:] = 0.0
            if r:
                example_mask[c, r - 1, -1] = 0.0
        segs.append(
            Batch(
                input_ids=ids,
                attention_mask=attn,
                token_type_ids=types,
                labels=labels,
                example_mask=example_mask,
                step_mask=step_mask,
            )
        )
    return segs


def client_slice(segments: list[Batch], k: int) -> list[Batch]:
    """Client k's segments without the client axis."""
    return [jax.tree.map(lambda v: v[k], seg) for seg in segments]


def per_client(segments: list[Batch]) -> list[list[Batch]]:
    """Stacked segments [K, S, ...] as each client's own list (what run_round takes)."""
    return [client_slice(segments, k) for k in range(len(segments[0].step_mask))]


def reference_loss(apply, params, batch, key, is_regression):
    """Masked mean loss written independently of client.py (log-softmax / squared error)."""
    logits = apply(
        params,
        batch.input_ids,
        batch.attention_mask,
        batch.token_type_ids,
        train=True,
        rng=key,
    )
    mask = jnp.asarray(batch.example_mask)
    if is_regression:
        per = (logits[:, 0] - batch.labels) ** 2
    else:
        logp = jax.nn.log_softmax(logits, axis=-1)
        per = -jnp.take_along_axis(logp, jnp.asarray(batch.labels)[:, None], axis=1)[:, 0]
    return jnp.sum(per * mask) / jnp.sum(mask)


def dp_reference_epsilon(z: float, q: float, rounds: int, delta: float, name: str = "rdp") -> float:
    """dp_accounting's epsilon of `rounds` rounds of the Gaussian mechanism (noise multiplier z),
    Poisson-sampled at rate q (q = 1: every client), adding or removing one client; the events
    built here, independently of fed/accounting.py."""
    import dp_accounting

    if rounds == 0:
        return 0.0
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if name == "rdp":
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    else:
        acc = dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)
