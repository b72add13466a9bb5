"""FedBFPT's layer-wise training (Wang et al., IJCAI 2023): which layer a round trains, and the
small model a client builds around it. Pure functions of integers and parameter trees.

The server holds the full L-layer model. In round r it trains one encoder layer l(r), chosen by a
schedule that moves from shallow to deep (Progressive Learning, "PL"). Each client runs a small
model of L_s layers: positions 0..l hold the global layers 0..l, and the positions above l hold
layers sampled in order from the global layers deeper than l ("Sampled Deeper Layers", "SDL").
Only layer l and the MLM head are trained and sent; everything else is frozen.

Schedules (1-based rounds; `SCHEDULES`):
- "halving": the released code's: the trained layer starts at 0 and advances when the round
  index reaches rounds - floor(remaining / 2), remaining being the rounds left when the current
  layer started: each phase takes about half of the remaining rounds (5 rounds: 0 0 0 1 2;
  20 rounds: ten 0s, five 1s, three 2s, then 3 and 4).
- "every": advance every `period` rounds (0 for rounds 1..period, 1 for the next period, ...).

Sampling the deeper layers (`LAYER_DRAWS`): for client c in round r, the L_s - 1 - l positions
above l get global layers from l+1..L-1, in increasing order, drawn from
`np.random.default_rng([seed, r, c, LAYER_PURPOSE])`:
- "replacement" (the default): with replacement, then sorted, as the FedBT journal describes the
  draw (Journal of Software 2025, 36(9), p. 4121: its example is [7, 7, 11]) and as the released
  code draws (`np.random.randint`), so a client can run the same global layer twice;
- "distinct": without replacement, every sampled layer a distinct global layer in the
  pre-trained order.
The released code also reseeds numpy's global generator (`setup_seed(24)` in every `dp_pretrain`
call) right before the next client's draw, so all clients of a round, and the rounds too, get
the same draw; the paper describes a random sample per client. Keys per (seed, round, client)
make the draws differ between clients and rounds yet reproducible from the seed.

FedBT's fine-tuning (the journal version's Algorithm 2, Journal of Software 2025, 36(9), pp.
4122-4123): every client runs the whole model; round r trains the encoder layers l..L-1 and the
task head (pooler and classifier), l = L-1-((r-1) mod c) for a cycle factor c (c = 6 of 12:
l = 11, 10, ..., 6, then 11 again). Everything below l only runs forward that round, and only the
trained parameters are uploaded and averaged. The embeddings and layers 0..L-c-1 are never
trained: they are frozen parameters, never sent (`fedbt_cycled`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.fed.roles import layer_filter, layer_index, paths_where

LAYER_PURPOSE = 0x6C_79  # "ly": the `purpose` part of the layer draws' numpy seed
HEAD_PATHS = ("mlm/transform/", "mlm/bias")  # the MLM head a FedBFPT client trains
TASK_HEAD_PATHS = ("pooler/", "classifier/")  # the task head a FedBT client trains every round
SCHEDULES = ("halving", "every")
LAYER_DRAWS = ("replacement", "distinct")
_LAYER_KEY = re.compile(r"^layer_(\d+)$")


def halving_layers(rounds: int) -> list[int]:
    """The trained layer of rounds 1..`rounds` under the released code's schedule."""
    remaining, layer, out = rounds, 0, []
    for i in range(rounds):  # the released loop's 0-based round index
        if i == rounds - remaining // 2:
            layer += 1
            remaining = rounds - i
        out.append(layer)
    return out


def every_layers(rounds: int, period: int) -> list[int]:
    """The trained layer of rounds 1..`rounds` when it advances every `period` rounds."""
    if period < 1:
        raise UserError(f"--schedule-period must be at least 1, got {period}")
    return [(r - 1) // period for r in range(1, rounds + 1)]


def schedule_layers(name: str, rounds: int, period: int = 1) -> list[int]:
    """The trained layer of each round 1..`rounds` (index 0 is round 1) for schedule `name`."""
    if name == "halving":
        return halving_layers(rounds)
    if name == "every":
        return every_layers(rounds, period)
    raise UserError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def check_small_model(layers: Sequence[int], num_layers: int, small_layers: int) -> None:
    """UserError unless every scheduled layer fits a small model of `small_layers` layers cut
    from a `num_layers`-layer model (the trained layer sits at its own index in it)."""
    if not 1 <= small_layers <= num_layers:
        raise UserError(
            f"--small-layers {small_layers} is outside 1..{num_layers} for this "
            f"{num_layers}-layer model"
        )
    top = max(layers, default=0)
    if top >= small_layers:
        raise UserError(
            f"the schedule reaches layer {top}, but a client's small model has {small_layers} "
            f"layers (0..{small_layers - 1}); use --small-layers {top + 1} or more, fewer "
            "--rounds, or a slower schedule"
        )


def sample_deeper(
    seed: int,
    round_: int,
    client: int,
    layer: int,
    num_layers: int,
    small_layers: int,
    draw: str = "replacement",
) -> tuple[int, ...]:
    """The global layers (increasing; distinct only for draw "distinct") at positions
    layer+1..small_layers-1 of client `client`'s small model in round `round_` (see the module
    docstring)."""
    if draw not in LAYER_DRAWS:
        raise UserError(f"unknown layer draw {draw!r}; use one of {', '.join(LAYER_DRAWS)}")
    count = small_layers - 1 - layer
    deeper = np.arange(layer + 1, num_layers)
    if count < 0 or count > deeper.size:
        raise ValueError(f"no {count} deeper layers above {layer} in {num_layers}")
    rng = np.random.default_rng([seed, round_, client, LAYER_PURPOSE])
    drawn = rng.choice(deeper, size=count, replace=draw == "replacement")
    return tuple(int(x) for x in np.sort(drawn))


def client_layers(layer: int, deeper: Sequence[int]) -> tuple[int, ...]:
    """Global layer at each position of a small model: 0..layer, then the sampled ones."""
    return tuple(range(layer + 1)) + tuple(int(d) for d in deeper)


def _map_layers(tree: Mapping[str, Any], rename: Callable[[int], int]) -> dict[str, Any]:
    out = dict(tree)
    encoder = tree.get("encoder")
    if encoder is not None:
        new = {}
        for key, value in encoder.items():
            m = _LAYER_KEY.match(key)
            new[f"layer_{rename(int(m.group(1)))}" if m else key] = value
        out["encoder"] = new
    return out


def assemble(params: Mapping[str, Any], layers: Sequence[int]) -> dict[str, Any]:
    """The model whose layer i is `params`' layer `layers[i]` (embeddings and head as they are);
    the very same arrays, no copy."""
    encoder = params["encoder"]
    missing = [i for i in layers if f"layer_{i}" not in encoder]
    if missing:
        raise ValueError(f"no encoder layers {missing} in the parameters")
    out = {k: v for k, v in params.items() if k != "encoder"}
    out["encoder"] = {f"layer_{i}": encoder[f"layer_{g}"] for i, g in enumerate(layers)}
    return out


def to_global(tree: Mapping[str, Any], layers: Sequence[int]) -> dict[str, Any]:
    """A client-model subtree (e.g. its trained part) with each layer_i renamed to the global
    layer it came from, layers[i]: the inverse of `assemble` on the layers present."""
    return _map_layers(tree, lambda i: int(layers[i]))


def trained_paths(
    params: Mapping[str, Any], layers: Sequence[int] | None, head: Sequence[str] = HEAD_PATHS
) -> frozenset[str]:
    """Paths of `params` in encoder layers `layers` (None: every path) or under `head`: the
    roles' layer filter."""
    return paths_where(params, layer_filter(layers, head))


def paths_to_client(paths: frozenset[str], layers: Sequence[int]) -> frozenset[str]:
    """Global paths -> the client model's paths (layers it does not run are dropped)."""
    position = {int(g): i for i, g in enumerate(layers)}
    out = set()
    for p in paths:
        g = layer_index(p)
        if g is None:
            out.add(p)
        elif g in position:
            out.add(re.sub(r"^encoder/layer_\d+", f"encoder/layer_{position[g]}", p))
    return frozenset(out)


class Plan(NamedTuple):
    """What the clients of one round run and train: the global layer at each position of each
    client's model, and the global paths they train and send (the same for every client)."""

    layers: tuple[tuple[int, ...], ...]  # one tuple per client, in the order of `clients`
    trained: frozenset[str]


def fedbfpt_plan(
    params: Mapping[str, Any],
    *,
    layer: int,
    round_: int,
    clients: Sequence[int],
    seed: int,
    small_layers: int,
    draw: str = "replacement",
) -> Plan:
    """FedBFPT's round: every client runs its own small model around `layer` and trains that
    layer and the MLM head."""
    num_layers = len(params["encoder"])
    layers = tuple(
        client_layers(layer, sample_deeper(seed, round_, c, layer, num_layers, small_layers, draw))
        for c in clients
    )
    return Plan(layers, trained_paths(params, [layer]))


def full_plan(params: Mapping[str, Any], *, clients: Sequence[int], depth: int) -> Plan:
    """Every client runs the first `depth` layers and trains all of that model: BERT-FL and
    centralised training (depth L), the truncated baselines (depth k < L)."""
    everything = trained_paths(params, None)
    kept = frozenset(p for p in everything if (layer_index(p) or 0) < depth)
    return Plan(tuple(tuple(range(depth)) for _ in clients), kept)


def fedbt_layer(round_: int, num_layers: int, cycle_factor: int) -> int:
    """The lowest layer FedBT trains in round `round_` (1-based): L-1-((r-1) mod c)."""
    if not 1 <= cycle_factor <= num_layers:
        raise UserError(
            f"--cycle-factor {cycle_factor} is outside 1..{num_layers} for this "
            f"{num_layers}-layer model; pass a value in 1..{num_layers} (the journal's L/2)"
        )
    return num_layers - 1 - (round_ - 1) % cycle_factor


def fedbt_cycled(num_layers: int, cycle_factor: int) -> Callable[[str], bool]:
    """The parameters FedBT ever trains: layers L-c..L-1 and the task head (the others are
    frozen for the whole run)."""
    return layer_filter(range(num_layers - cycle_factor, num_layers), TASK_HEAD_PATHS)


def fedbt_trained(
    params: Mapping[str, Any], round_: int, num_layers: int, cycle_factor: int
) -> frozenset[str]:
    """The paths of `params` FedBT trains in round `round_`: layers l..L-1 and the task head."""
    low = fedbt_layer(round_, num_layers, cycle_factor)
    return paths_where(params, layer_filter(range(low, num_layers), TASK_HEAD_PATHS))
