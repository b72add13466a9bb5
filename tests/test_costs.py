"""run.costs: which parts a client trains as the FLOP count needs them (none where a layer is
trained in part), a round's figures and running totals, the summary's shares of BERT-FL's, and
the whole model's bytes, against hand counts on a tiny model."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import pytest
from fedcore_helpers import tiny_config

from fedjax_split.fed import layerwise, roles
from fedjax_split.models.bert import init_params
from fedjax_split.run import costs


def _model(rule: roles.Rule, layers: int = 2) -> SimpleNamespace:
    config = dataclasses.replace(tiny_config(), num_hidden_layers=layers)
    params = init_params(config, jax.random.key(0))
    global0, local0, frozen = roles.partition(params, rule)
    return SimpleNamespace(config=config, global0=global0, local0=local0, frozen=frozen)


def test_fedsplitbert_trains_everything_its_global_and_local_parts_hold() -> None:
    model = _model(roles.critical_layer_rule(1, 2))
    parts = costs.trained_parts(costs.paths_of(model), None)
    assert parts == costs.Trained(frozenset({0, 1}), True, True, True)


def test_fedbt_trains_the_rounds_layers_and_the_head_never_the_embeddings() -> None:
    rule = roles.train_only(roles.critical_layer_rule(4, 4), layerwise.fedbt_cycled(4, 2))
    model = _model(rule, layers=4)
    paths = costs.paths_of(model)
    assert not any(p.startswith(("embeddings/", "encoder/layer_1/")) for p in paths.global_paths)
    for r, layers in ((1, {3}), (2, {2, 3})):
        trained = layerwise.fedbt_trained(model.global0, r, 4, 2)
        assert costs.trained_parts(paths, trained) == costs.Trained(frozenset(layers), False,
                                                                    True, True)  # fmt: skip


@pytest.mark.parametrize("frozen", [r"encoder/layer_0/attention/query/", r"pooler/dense/kernel",
                                    r"classifier/bias"])  # fmt: skip
def test_a_layer_or_head_trained_in_part_has_no_exact_count(frozen: str) -> None:
    """--freeze of one matrix of a layer or a head (or LoRA's adapters beside frozen base
    weights): None, never a figure that counts it as trained or as frozen."""
    model = _model(roles.freeze_rule(roles.critical_layer_rule(2, 2), frozen))
    assert costs.trained_parts(costs.paths_of(model), None) is None
    assert not costs.counted(costs.paths_of(model), None)
    assert costs.client_costs(costs.paths_of(model), None, [], schedule=True) == {}


def test_round_record_sums_the_clients_and_keeps_running_totals() -> None:
    clients = [{"flops": 10, "bert_fl_flops": 30}, {"flops": 5, "bert_fl_flops": 20}]
    first = costs.round_record([], clients, True, bert_fl_bytes=100, sampled=3)
    assert first == {"flops": 15, "bert_fl_flops": 50, "bert_fl_bytes_up": 200,
                     "bert_fl_bytes_down": 300, "cum_flops": 15, "cum_bert_fl_flops": 50,
                     "cum_bert_fl_bytes_up": 200, "cum_bert_fl_bytes_down": 300}  # fmt: skip
    # a round with nobody (DP's Poisson draw) adds nothing and the totals go on from before it
    nobody = costs.round_record([first], [], True, bert_fl_bytes=100, sampled=0)
    assert nobody["flops"] == 0 and nobody["cum_flops"] == 15
    third = costs.round_record([first, {"round": 2}], clients[:1], True, 100, 1)
    assert third["cum_flops"] == 25 and third["cum_bert_fl_bytes_up"] == 300
    plain = costs.round_record([], [{"flops": 7}], True, bert_fl_bytes=None, sampled=1)
    assert plain == {"flops": 7, "cum_flops": 7}
    assert costs.round_record([], [{}], False, None, 1) == {}


def test_summary_shares_are_the_run_totals_over_bert_fls() -> None:
    history = [
        {"cum_flops": 15, "cum_bert_fl_flops": 50, "cum_bytes_up": 40, "cum_bytes_down": 90,
         "cum_bert_fl_bytes_up": 200, "cum_bert_fl_bytes_down": 200},
        {"round": 2},  # a round without clients (DP's Poisson draw): the totals so far stand
    ]  # fmt: skip
    summary = costs.summary(history)
    assert summary["flops_share_of_bert_fl"] == pytest.approx(0.3)
    assert summary["bytes_up_share_of_bert_fl"] == pytest.approx(0.2)
    assert summary["bytes_down_share_of_bert_fl"] == pytest.approx(0.45)
    assert costs.summary([{"cum_flops": 3}]) == {"cum_flops": 3}
    assert costs.summary([]) == {}


@pytest.mark.parametrize(("wire", "width"), [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_the_whole_models_bytes_in_the_wire_dtype(wire: str, width: int) -> None:
    model = _model(roles.critical_layer_rule(1, 2))
    count = sum(int(x.size) for x in jax.tree.leaves(
        init_params(model.config, jax.random.key(1))))  # fmt: skip
    assert costs.model_bytes(model, wire) == width * count
