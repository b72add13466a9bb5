"""FedBFPT's layer-wise pieces: the schedules against the released code, the sampled deeper
layers (distinct, ordered, different between clients and rounds, reproducible from the seed), the
small model's assembly and its way back, and the plans of a round."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from fedcore_helpers import tiny_config

from fedjax_split.errors import UserError
from fedjax_split.fed import layerwise
from fedjax_split.fed.roles import flatten_paths
from fedjax_split.models.bert import init_params


def released_schedule(fed_epoch: int) -> list[int]:
    """federated_train.py's fed_train() loop of github.com/Hanzhouu/FedBFPT (read 2026-11-22),
    transcribed: the layer it trains, drop_layer - 1, in each round i."""
    remain_epoch = fed_epoch
    drop_layer = 1
    trained = []
    for i in range(fed_epoch):
        if i == (fed_epoch - math.floor(remain_epoch / 2)):
            drop_layer += 1
            remain_epoch = fed_epoch - i
        trained.append(drop_layer - 1)
    return trained


def test_halving_schedule_is_the_released_codes() -> None:
    # MISSION.md: with 5 rounds, rounds 0-2 train layer 0, round 3 layer 1, round 4 layer 2
    assert layerwise.halving_layers(5) == [0, 0, 0, 1, 2]
    assert layerwise.halving_layers(20) == [0] * 10 + [1] * 5 + [2] * 3 + [3, 4]
    for rounds in range(1, 41):
        assert layerwise.halving_layers(rounds) == released_schedule(rounds), rounds
    assert layerwise.schedule_layers("halving", 5) == [0, 0, 0, 1, 2]
    assert layerwise.schedule_layers("every", 7, period=3) == [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(UserError, match="unknown schedule"):
        layerwise.schedule_layers("cosine", 5)
    with pytest.raises(UserError, match="--schedule-period"):
        layerwise.schedule_layers("every", 5, period=0)


def test_sampled_deeper_layers() -> None:
    draws = {
        (r, c): layerwise.sample_deeper(
            seed=0, round_=r, client=c, layer=1, num_layers=12, small_layers=6, draw="distinct"
        )  # fmt: skip
        for r in range(1, 6)
        for c in range(6)
    }
    for d in draws.values():
        assert len(d) == 4 and list(d) == sorted(set(d)) and min(d) >= 2 and max(d) <= 11
    assert len(set(draws.values())) > 20  # clients and rounds draw differently (30 draws)
    assert draws[(1, 0)] != draws[(1, 1)] and draws[(1, 0)] != draws[(2, 0)]
    again = layerwise.sample_deeper(seed=0, round_=3, client=4, layer=1, num_layers=12,
                                    small_layers=6, draw="distinct")  # fmt: skip
    assert again == draws[(3, 4)]
    other_seed = [layerwise.sample_deeper(1, r, c, 1, 12, 6, "distinct") for r in range(1, 6)
                  for c in range(6)]  # fmt: skip
    assert other_seed != list(draws.values())
    # every deeper layer shows up over many draws: uniform, not stuck on a few
    seen = {x for r in range(1, 30) for x in layerwise.sample_deeper(0, r, 0, 0, 12, 6, "distinct")}
    assert seen == set(range(1, 12))
    # nothing to sample when the small model ends at the trained layer; all when it is as deep
    assert layerwise.sample_deeper(0, 1, 0, layer=2, num_layers=6, small_layers=3) == ()
    assert layerwise.sample_deeper(0, 1, 0, 0, num_layers=6, small_layers=6, draw="distinct") == (
        1,
        2,
        3,
        4,
        5,
    )
    assert layerwise.client_layers(2, (5, 9)) == (0, 1, 2, 5, 9)


def test_deeper_layers_drawn_with_replacement_by_default() -> None:
    """The journal's draw (p. 4121, e.g. [7, 7, 11]): sorted, with replacement, so a layer may
    repeat; 4 of 10 layers repeat one with probability 1 - 10*9*8*7/10^4 = 0.496."""
    draws = [layerwise.sample_deeper(0, r, c, layer=1, num_layers=12, small_layers=6)
             for r in range(1, 41) for c in range(5)]  # fmt: skip
    for d in draws:
        assert len(d) == 4 and list(d) == sorted(d) and min(d) >= 2 and max(d) <= 11
    repeats = sum(len(set(d)) < len(d) for d in draws) / len(draws)
    assert 0.35 < repeats < 0.65, repeats  # 200 draws: sd 0.035 around 0.496
    assert draws[0] == layerwise.sample_deeper(0, 1, 0, 1, 12, 6, "replacement")
    assert layerwise.sample_deeper(0, 1, 0, layer=4, num_layers=6, small_layers=6) == (5,)
    with pytest.raises(UserError, match="unknown layer draw 'uniform'"):
        layerwise.sample_deeper(0, 1, 0, 1, 12, 6, draw="uniform")


def test_a_small_model_with_a_repeated_layer() -> None:
    """A repeated deeper layer runs twice in the client's model; only the trained layer and the
    head are the client's to send, at the trained layer's own index."""
    params = {"embeddings": {"w": 0}, "encoder": {f"layer_{i}": {"w": i} for i in range(6)},
              "mlm": {"bias": 7}}  # fmt: skip
    layers = layerwise.client_layers(1, (4, 4))
    model = layerwise.assemble(params, layers)
    assert [model["encoder"][f"layer_{i}"]["w"] for i in range(4)] == [0, 1, 4, 4]
    plan = layerwise.fedbfpt_plan(params, layer=1, round_=1, clients=[0], seed=0, small_layers=4)
    assert plan.trained == frozenset({"encoder/layer_1/w", "mlm/bias"})
    assert layerwise.paths_to_client(plan.trained, layers) == plan.trained
    assert layerwise.to_global({"encoder": {"layer_1": {"w": 9}}}, layers) == {
        "encoder": {"layer_1": {"w": 9}}
    }
    # the whole small model, as the server sends it: the repeated layer once
    assert sorted(layerwise.to_global(model, layers)["encoder"]) == ["layer_0", "layer_1",
                                                                     "layer_4"]  # fmt: skip


def test_small_model_must_hold_every_scheduled_layer() -> None:
    layerwise.check_small_model([0, 0, 0, 1, 2], num_layers=6, small_layers=3)
    with pytest.raises(UserError, match="reaches layer 2.*--small-layers 3"):
        layerwise.check_small_model([0, 0, 0, 1, 2], num_layers=6, small_layers=2)
    with pytest.raises(UserError, match="outside 1..6"):
        layerwise.check_small_model([0], num_layers=6, small_layers=7)


def test_assemble_and_back_to_global_paths() -> None:
    config = tiny_config()
    params = init_params(config, jax.random.key(0))
    params["encoder"]["layer_2"] = params["encoder"]["layer_1"]  # a 3-layer stand-in
    small = layerwise.assemble(params, (0, 2))
    assert sorted(small["encoder"]) == ["layer_0", "layer_1"]
    assert small["encoder"]["layer_1"] is params["encoder"]["layer_2"]  # the same arrays
    assert small["embeddings"] is params["embeddings"]
    back = layerwise.to_global({"encoder": {"layer_1": small["encoder"]["layer_1"]}}, (0, 2))
    assert list(back["encoder"]) == ["layer_2"]
    paths = frozenset({"encoder/layer_2/output/kernel", "classifier/bias", "encoder/layer_1/x"})
    assert layerwise.paths_to_client(paths, (0, 2)) == {
        "encoder/layer_1/output/kernel", "classifier/bias",
    }  # fmt: skip
    with pytest.raises(ValueError, match="no encoder layers"):
        layerwise.assemble(params, (0, 5))


def test_plans() -> None:
    config = tiny_config()
    params = init_params(config, jax.random.key(0))
    params["mlm"] = {"transform": {"dense": {"kernel": np.zeros((16, 16))}}, "bias": np.zeros(50)}
    params["encoder"].update({f"layer_{i}": params["encoder"]["layer_0"] for i in (2, 3)})
    plan = layerwise.fedbfpt_plan(params, layer=1, round_=4, clients=[0, 1, 2], seed=5,
                                  small_layers=3)  # fmt: skip
    assert [p[:2] for p in plan.layers] == [(0, 1)] * 3 and all(len(p) == 3 for p in plan.layers)
    assert plan.layers[0][2] in (2, 3)
    assert plan.trained == {
        p for p in flatten_paths(params) if p.startswith(("encoder/layer_1/", "mlm/"))
    }
    full = layerwise.full_plan(params, clients=[0, 1], depth=4)
    assert full.layers == ((0, 1, 2, 3),) * 2 and full.trained == set(flatten_paths(params))
    truncated = layerwise.full_plan(params, clients=[0], depth=2)
    assert truncated.layers == ((0, 1),)
    assert not any(p.startswith(("encoder/layer_2", "encoder/layer_3")) for p in truncated.trained)
    assert "embeddings/word_embeddings/embedding" in truncated.trained


def test_fedbt_cycles_down_from_the_top_layer() -> None:
    """The journal's example (Algorithm 2, c = 6 of 12): l = 11, 10, 9, 8, 7, 6, 11, 10, ...;
    MiniLM's 6 layers with the default c = 3: 5, 4, 3, 5, ..."""
    assert [layerwise.fedbt_layer(r, 12, 6) for r in range(1, 15)] == [
        11, 10, 9, 8, 7, 6, 11, 10, 9, 8, 7, 6, 11, 10]  # fmt: skip
    assert [layerwise.fedbt_layer(r, 6, 3) for r in range(1, 8)] == [5, 4, 3, 5, 4, 3, 5]
    assert [layerwise.fedbt_layer(r, 6, 1) for r in range(1, 4)] == [5, 5, 5]
    assert [layerwise.fedbt_layer(r, 6, 6) for r in range(1, 8)] == [5, 4, 3, 2, 1, 0, 5]
    for bad in (0, 7):
        with pytest.raises(UserError, match="--cycle-factor"):
            layerwise.fedbt_layer(1, 6, bad)


def test_fedbt_trains_the_layers_from_l_up_and_the_head() -> None:
    config = dataclasses.replace(tiny_config(), num_hidden_layers=4)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    paths = set(flatten_paths(params))
    for r, low in ((1, 3), (2, 2), (3, 3)):
        trained = layerwise.fedbt_trained(params, r, 4, 2)
        want = {p for p in paths if p.startswith(("pooler/", "classifier/"))
                or any(p.startswith(f"encoder/layer_{i}/") for i in range(low, 4))}  # fmt: skip
        assert trained == want, r
    ever = layerwise.fedbt_cycled(4, 2)
    assert {p for p in paths if ever(p)} == layerwise.fedbt_trained(params, 2, 4, 2)
    assert not any(ever(p) for p in paths if p.startswith(("embeddings/", "encoder/layer_1/")))
