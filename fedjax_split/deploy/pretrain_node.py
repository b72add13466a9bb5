"""A client of further pre-training (FedBFPT, BERT-FL, the truncated baseline) on a real
federation: its own text, its MLM batches, and the simulation's client program.

Nothing here imports Flower: the ClientApp's pretrain handlers (`handlers.py`) turn messages
into these calls. A node loads and tokenises text itself; the server never sees any. A node
derives its text as the simulation derives its client's (`node_text`): either the corpus under
its --data-dir split by `run.pretrain_text.load_split`, its own documents kept, or with
--site-data its site's own *.txt alone (its node config's data-dir, `run.pretrain_text.site_text`),
so that it computes bit for bit what the simulation computes for its client: the same masked
batches (seeded by the seed, the round and its id), the same dropout key,
`sim.pretrain_rounds.client_update` on the model the round's plan gives it.

The held-out evaluation is the nodes' too (docs/deployment.md, "Further pre-training (FedBFPT)
on Flower"): each node derives the held-out documents as the simulation does and scores its
share of the held-out batches (`evaluate`), and the server sums the batches' figures in order;
a site scores all of its own held-out batches, and the server adds the sites' up in site order.
Clients keep nothing between rounds, so a node has no state on disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split.data import tokenization
from fedjax_split.data.text.masking import MaskedBatch, MaskingSpec
from fedjax_split.data.text.text_corpora import Sequences
from fedjax_split.errors import UserError
from fedjax_split.fed.roles import flatten_paths, layer_index
from fedjax_split.run import pretrain_setup, pretrain_text, pretraining
from fedjax_split.run.pretrain_config import PretrainConfig
from fedjax_split.sim.pretrain_rounds import Trainer, client_key, client_update, eval_sums

# The methods a federation runs: centralised training has no federation, `none` no rounds.
FLOWER_METHODS = ("fedbfpt", "bert-fl", "truncated")


def check_deployable(config: PretrainConfig) -> None:
    """UserError for a method that does not run on Flower."""
    if config.federation.method not in FLOWER_METHODS:
        raise UserError(
            f"--method {config.federation.method} does not run on Flower (use one of "
            f"{', '.join(FLOWER_METHODS)}); run it with `python -m fedjax_split.pretrain`"
        )


@dataclasses.dataclass
class PretrainNode:
    """What one client needs in memory (built anew by every ClientApp process)."""

    config: PretrainConfig
    client_id: int
    sequences: Sequences  # its training sequences
    heldout: list[MaskedBatch]  # the masked held-out batches (a site's: its own)
    split: dict[str, Any]  # the corpus split as this node derives it, or its site's counts
    masking: MaskingSpec
    pad_id: int
    trainer: Trainer
    shapes: dict[str, tuple[int, ...]]  # the global model's flat paths -> shapes

    @property
    def num_layers(self) -> int:
        return int(self.trainer.config.num_hidden_layers)


def node_text(
    config: PretrainConfig,
    client_id: int,
    tokenizer: Any,
    spec: MaskingSpec,
    site_dir: str | Path | None = None,
) -> tuple:
    """(what split.json records as this node knows it, this client's sequences, its held-out
    batches). One corpus (the node config's data-dir, else --data-dir): split as the simulation
    splits it, this client's documents kept, all the held-out batches. --site-data: `site_dir`'s
    text alone, this site's counts and its own held-out batches. The one place a node's text
    comes from."""
    if config.data.site_data is not None:
        if site_dir is None:
            raise UserError(
                f"this run's sites read their own text: give SuperNode {client_id} its directory "
                f"in its node config (--node-config 'partition-id={client_id} data-dir=DIR')"
            )
        return pretrain_text.site_text(config, tokenizer, spec, client_id, site_dir)
    units, split = pretrain_text.load_split(config, tokenizer)
    seqs = pretrain_text.text_sequences(config, tokenizer, units, split.clients[client_id])
    pretrain_text.check_has_text(client_id, seqs)
    held = pretrain_text.text_sequences(config, tokenizer, units, split.heldout)
    heldout = pretrain_text.heldout_batches(config, held, spec, int(tokenizer.pad_token_id))
    return split.to_dict(), seqs, heldout


def prepare(
    config: PretrainConfig, client_id: int, site_dir: str | Path | None = None
) -> PretrainNode:
    """This client's text and model, as the simulation builds them for it (`site_dir`: its own
    directory in a --site-data run)."""
    check_deployable(config)
    if not 0 <= client_id < config.federation.clients:
        raise UserError(
            f"partition-id {client_id} is outside 0..{config.federation.clients - 1} (--clients "
            f"{config.federation.clients}); give each SuperNode one of those"
        )
    pretrain_setup.check(config)
    pre = pretrain_setup.load_model(config)
    tokenizer = tokenization.load_tokenizer(pre.model_dir)
    spec = pretrain_setup.masking_spec(config, tokenizer, pre.config)
    split, seqs, heldout = node_text(config, client_id, tokenizer, spec, site_dir)
    return PretrainNode(
        config=config, client_id=client_id, sequences=seqs, heldout=heldout, split=split,
        masking=spec, pad_id=int(tokenizer.pad_token_id),
        trainer=pretrain_setup.make_trainer(config, pre.config),
        shapes={p: tuple(np.shape(x)) for p, x in flatten_paths(pre.params).items()},
    )  # fmt: skip


def num_sequences(node: PretrainNode) -> int:
    return int(node.sequences.input_ids.shape[0])


def check_layers(node: PretrainNode, layers: Sequence[int], depth_only: bool = False) -> None:
    """ValueError unless `layers` are global layers of this model in increasing order, a deeper
    layer possibly repeated (FedBFPT's draw with replacement), or, for a model evaluated whole
    (`depth_only`), a depth 1..L."""
    if depth_only:
        if len(layers) != 1 or not 1 <= int(layers[0]) <= node.num_layers:
            raise ValueError(f"asked to evaluate a model of {list(layers)} layers")
        return
    if (
        not layers
        or any(int(a) > int(b) for a, b in zip(layers, layers[1:], strict=False))
        or not all(0 <= int(g) < node.num_layers for g in layers)
    ):
        raise ValueError(f"asked to run layers {list(layers)} of a {node.num_layers}-layer model")


def expected_shapes(node: PretrainNode, layers: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """{path: shape} of what a node receives for a model of global layers `layers`: those
    layers, the embeddings and the head, under their global paths."""
    keep = {int(g) for g in layers}
    return {p: s for p, s in node.shapes.items() if layer_index(p) in keep or
            (layer_index(p) is None and not p.startswith("encoder/"))}  # fmt: skip


def train(
    node: PretrainNode, received: Mapping[str, Any], r: int, layers: Sequence[int],
    trained: frozenset[str],
) -> tuple[dict[str, Any], Any, int]:  # fmt: skip
    """Round r for this client: (its upload under global paths, its
    `sim.pretrain_rounds.ClientReport`, BERT-FL's FLOPs on the same batches). `received`: the
    global parameters of its model (`expected_shapes`), fp32."""
    unknown = sorted(set(trained) - set(node.shapes))[:3]
    if unknown:
        raise ValueError(f"asked to train paths the model does not have: {unknown}")
    config = node.config
    segments = pretraining.client_segments(
        config, node.masking, node.pad_id, node.sequences, r, node.client_id
    )
    key = client_key(config.seed, r, node.client_id)
    upload, report = client_update(
        node.trainer, received, layers, trained, segments, key, node.client_id
    )
    return upload, report, pretraining.bert_fl_flops(node.trainer.config, segments)


def evaluate(
    node: PretrainNode, params: Mapping[str, Any], depth: int, part: int, parts: int
) -> tuple[np.ndarray, np.ndarray]:
    """(indices, `eval_sums` rows) of the held-out batches i with i % parts == part, scored with
    the `depth`-layer model `params` (fp32)."""
    if not 0 <= part < parts:
        raise ValueError(f"asked for part {part} of {parts}")
    index = np.arange(part, len(node.heldout), parts, dtype=np.int64)
    batches = [node.heldout[int(i)] for i in index]
    return index, eval_sums(node.trainer.depth_config(depth), params, batches)
