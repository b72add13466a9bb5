"""What a fine-tuning round costs in matmul FLOPs, and what BERT-FL (FedAvg training and sending
the whole model) would have cost on the same batches: the figures FedBT's claim is about (its
journal's Table 3 gives its computation and communication as shares of BERT-FL's).

- flops: the matmul FLOPs of the sampled clients' real training steps, forward and backward as
  reverse-mode autodiff runs them when only some parameters are trained
  (`models.flops.segment_flops`, checked against the gradient's own matmuls in
  tests/test_flops.py): a layer below everything trained only runs forward. Counted where every
  encoder layer and each head is trained whole or not at all (FedAvg, FedSplitBERT, FedBT, a
  --freeze of whole layers); a run that trains part of one (LoRA, a --freeze inside a layer)
  records none rather than a wrong figure.
- With a layer schedule (FedBT) a round's record adds BERT-FL's FLOPs on the same steps and its
  bytes (the whole model in the wire dtype: up from each client whose work the server took, down
  to each sampled client, as the round's own bytes count), and the summary the shares. FLOPs
  count the clients whose work the server took (on Flower, a failed or rejected client's are
  not known). Pure functions of the model, the trained paths and the batches' shapes: the simulation
  and a Flower node compute the same figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from fedjax_split.fed.roles import flatten_paths, layer_index, merge_params
from fedjax_split.fed.wire import cast_to_wire, tree_bytes, wire_dtype
from fedjax_split.models.bert import BertConfig
from fedjax_split.models.flops import segment_flops
from fedjax_split.run.pieces import Model


class Trained(NamedTuple):
    """Which parts of the model a step trains, as the FLOP count needs them."""

    layers: frozenset[int]
    embeddings: bool
    pooler: bool
    classifier: bool


class ModelPaths(NamedTuple):
    """A model's architecture and its parameters' paths by role: all the counts need (a Flower
    node holds no global part between messages, only these)."""

    config: BertConfig
    global_paths: frozenset[str]
    local_paths: frozenset[str]
    frozen_paths: frozenset[str]


def paths_of(model: Model) -> ModelPaths:
    """A `run.pieces.Model`'s `ModelPaths`."""
    return ModelPaths(
        model.config,
        *(frozenset(flatten_paths(part)) for part in (model.global0, model.local0, model.frozen)),
    )


def trained_parts(paths: ModelPaths, trained: frozenset[str] | None) -> Trained | None:
    """What a client trains: the global paths `trained` (None: every global one) and its whole
    local part; None when some encoder layer is trained only in part (no exact count)."""
    chosen = paths.global_paths if trained is None else paths.global_paths & trained
    return _parts(set(chosen | paths.local_paths),
                  set(paths.global_paths | paths.local_paths | paths.frozen_paths))  # fmt: skip


def _parts(paths: set[str], every: set[str]) -> Trained | None:
    layers: dict[int, list[bool]] = {}
    for p in every:
        i = layer_index(p)
        if i is not None:
            layers.setdefault(i, []).append(p in paths)
    heads = {h: [p in paths for p in every if p.startswith(h)] for h in ("pooler/", "classifier/")}
    if any(any(v) and not all(v) for v in [*layers.values(), *heads.values()]):
        return None  # a layer or a head trained in part: its gradients are not the formula's
    return Trained(
        layers=frozenset(i for i, v in layers.items() if all(v)),
        embeddings=any(p.startswith("embeddings/") for p in paths),
        pooler=any(heads["pooler/"]),
        classifier=any(heads["classifier/"]),
    )


def steps_flops(config: BertConfig, parts: Trained | None, segments: Sequence[Any]) -> int | None:
    """Matmul FLOPs of one client's real steps `segments` (None: no exact count)."""
    if parts is None:
        return None
    return sum(
        segment_flops(config, seg, trained_layers=parts.layers, embeddings_trained=parts.embeddings,
                      pooler_trained=parts.pooler, classifier_trained=parts.classifier)
        for seg in segments
    )  # fmt: skip


def bert_fl_parts(config: BertConfig) -> Trained:
    """BERT-FL's client: every parameter trained."""
    return Trained(frozenset(range(config.num_hidden_layers)), True, config.head == "sequence",
                   True)  # fmt: skip


def model_bytes(model: Model, wire: str) -> int:
    """The whole model (global, local and frozen parts) in the wire dtype: what BERT-FL sends
    each way per client and round."""
    import jax

    whole = merge_params(model.global0, model.local0, model.frozen)
    return tree_bytes(jax.eval_shape(lambda: cast_to_wire(whole, wire_dtype(wire))))


def client_costs(paths: ModelPaths, trained: frozenset[str] | None, segments: Sequence[Any],
                 schedule: bool) -> dict[str, int]:  # fmt: skip
    """One client's round: {"flops": ..., "bert_fl_flops": ... (with a schedule)}; {} when the
    run has no exact count."""
    flops = steps_flops(paths.config, trained_parts(paths, trained), segments)
    if flops is None:
        return {}
    out = {"flops": flops}
    if schedule:
        out["bert_fl_flops"] = steps_flops(paths.config, bert_fl_parts(paths.config), segments)
    return out


def counted(paths: ModelPaths, trained: frozenset[str] | None) -> bool:
    """Whether a round training `trained` (None: every global path) has an exact FLOP count."""
    return trained_parts(paths, trained) is not None


def round_record(
    history: Sequence[Mapping[str, Any]],
    clients: Sequence[Mapping[str, int]],
    exact: bool,
    bert_fl_bytes: int | None,
    sampled: int,
) -> dict[str, int]:
    """A round record's costs from the `client_costs` of the clients whose work the server took
    (in client order), with running totals ({} when the run has no exact count, `exact`); with
    a schedule (`bert_fl_bytes`: the whole model's bytes) BERT-FL's too: its upload from those
    clients, its download to all `sampled` clients, as the round's own bytes count them. A
    round without clients adds nothing and keeps the totals."""
    if not exact:
        return {}
    out = {"flops": sum(int(c["flops"]) for c in clients)}
    if bert_fl_bytes is not None:
        out["bert_fl_flops"] = sum(int(c["bert_fl_flops"]) for c in clients)
        out["bert_fl_bytes_up"] = bert_fl_bytes * len(clients)
        out["bert_fl_bytes_down"] = bert_fl_bytes * sampled
    previous = next((h for h in reversed(history) if "cum_flops" in h), {})
    return {**out, **{f"cum_{k}": v + int(previous.get(f"cum_{k}", 0)) for k, v in out.items()}}


def summary(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's FLOPs and, with a schedule, its shares of BERT-FL's computation and bytes."""
    last = next((h for h in reversed(history) if "cum_flops" in h), None)
    if last is None:
        return {}
    out: dict[str, Any] = {"cum_flops": last["cum_flops"]}
    if "cum_bert_fl_flops" in last:
        up, down = last["cum_bert_fl_bytes_up"], last["cum_bert_fl_bytes_down"]
        out.update(
            cum_bert_fl_flops=last["cum_bert_fl_flops"],
            flops_share_of_bert_fl=_share(last["cum_flops"], last["cum_bert_fl_flops"]),
            bytes_up_share_of_bert_fl=_share(last["cum_bytes_up"], up),
            bytes_down_share_of_bert_fl=_share(last["cum_bytes_down"], down),
        )
    return out


def _share(part: float, whole: float) -> float | None:
    return float(part) / float(whole) if whole else None
