"""What the server takes from a round's TRAIN replies: a trust boundary.

An upload must decode to the trained global part's paths, shapes and wire dtypes with finite
values (`take_uploads`); a reply's figures must be finite, its example count the one its node
reported when it joined, its FLOP counts whole numbers (`reply_figures`), and with DP its update
norm finite. A reply that fails is rejected with why and the round goes on without it: one NaN
would spread through every client's model, one inflated example count would outweigh every
other client. A round in which clients were sampled and none replied stops the run
(`check_replies`). Further pre-training's server (`deploy.pretrain_server`) checks its replies
with the same pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedjax_split.deploy import codec, protocol
from fedjax_split.deploy.joining import ServerRun
from fedjax_split.deploy.messaging import warn_line
from fedjax_split.errors import UserError
from fedjax_split.fed.roles import flatten_paths, select
from fedjax_split.fed.wire import cast_from_wire
from fedjax_split.run import costs


def decode_upload(
    reply: Any, expected: Mapping[str, Any], wire: str, dtypes: Mapping[str, np.dtype]
) -> Any:

    if protocol.UPLOAD not in reply.content.array_records:
        arrays: dict[str, np.ndarray] = {}
    else:
        arrays = codec.from_record(reply.content[protocol.UPLOAD])
    codec.check_like(arrays, expected, "upload", dtypes)
    return cast_from_wire(codec.decode(arrays, wire)), codec.nbytes(arrays)


@dataclasses.dataclass
class Taken:
    """The uploads the server takes into a round, in client order."""

    clients: list[int] = dataclasses.field(default_factory=list)
    uploads: list[Any] = dataclasses.field(default_factory=list)  # fp32 trees
    weights: list[float] = dataclasses.field(default_factory=list)  # example counts
    losses: list[float] = dataclasses.field(default_factory=list)
    norms: list[float] | None = None  # DP: the update norms the clients report (before clipping)
    bytes_up: int = 0  # the taken uploads' bytes as sent
    costs: list[dict[str, int]] = dataclasses.field(default_factory=list)  # run.costs' figures
    secagg_bytes: int | None = None  # secure aggregation: the keys and shares the clients sent

    def add(self, cid: int, examples: int, loss: float, spent: dict[str, int], nbytes: int,
            upload: Any = None) -> None:  # fmt: skip
        """One client's reply taken (`upload` None: secure aggregation's, summed elsewhere)."""
        self.clients.append(cid)
        if upload is not None:
            self.uploads.append(upload)
        self.weights.append(examples)
        self.losses.append(loss)
        self.bytes_up += nbytes
        self.costs.append(spent)

    def answered(
        self, rejected: Mapping[int, str], valid: Any, norms: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The safeguards' view of the round, as the simulation has it: the clients that
        replied (taken or rejected, in client order), whether the server accepted each upload
        (`valid`: the server step's, over the taken ones; a rejected one never), each one's
        update norm (0 for a rejected one)."""
        answered = sorted([*self.clients, *rejected])
        accepted = dict(zip(self.clients, np.asarray(valid, bool).tolist(), strict=True))
        norm_of = dict(zip(self.clients, np.asarray(norms, np.float32).tolist(), strict=True))
        return (np.asarray(answered, np.int64),
                np.asarray([accepted.get(c, False) for c in answered], bool),
                np.asarray([norm_of.get(c, 0.0) for c in answered], np.float32))  # fmt: skip


def whole_count(metrics: Any, key: str) -> int:
    """A reply's whole-number figure, checked: present, an integer (FLOPs pass 2**53: no float
    on the way), >= 0."""
    value = metrics[key] if key in metrics else None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{key} {value!r} is not a whole number >= 0")
    return int(value)


def reply_number(metrics: Any, key: str, what: str, integral: bool = False) -> float:
    """A reply's metric, checked: present, finite, >= 0 (and a whole number where it counts)."""
    if key not in metrics:
        raise ValueError(f"no {what} ({key!r})")
    value = float(metrics[key])
    if not (np.isfinite(value) and value >= 0) or (integral and value != int(value)):
        kind = "whole number" if integral else "number"
        raise ValueError(f"{what} {value!r} is not a finite {kind} >= 0")
    return value


def expected_costs(run: ServerRun, spec: Any) -> tuple[str, ...]:
    """The FLOP counts every node's TRAIN reply must carry this round (as the simulation's
    clients count them: none where the roles train part of a layer)."""
    if not costs.counted(run.paths, spec.trained):
        return ()
    return ("flops", "bert_fl_flops") if run.model.cycle_factor is not None else ("flops",)


def take_uploads(
    run: ServerRun, spec: Any, replies: Mapping[int, Any], rejected: dict[int, str],
    expect: tuple[str, ...] = (),
) -> Taken:  # fmt: skip
    """The replies whose upload decodes to the trained global part's paths, shapes and wire
    dtype with finite values, and whose figures are finite (the example count the node reported
    when it joined; with DP, an update norm), in client order; each other reply is added to
    `rejected` with why (a trust boundary: one NaN would spread through every client's model,
    one inflated example count would outweigh every other client)."""
    params = run.server_state.global_params
    trained = select(params, spec.trained)[0]
    expected = {p: np.shape(x) for p, x in flatten_paths(trained).items()}
    dtypes = codec.sent_dtypes(trained)
    dp = spec.aggregator.dp is not None
    taken = Taken(norms=[] if dp else None)
    for cid in sorted(replies):
        reply = replies[cid]
        try:
            upload, nbytes = decode_upload(reply, expected, spec.wire_dtype, dtypes)
            examples, loss, spent = reply_figures(run, cid, reply, expect)
            norm = reply_number(reply.content[protocol.METRICS], protocol.UPDATE_NORM,
                           "update norm") if dp else None  # fmt: skip
        except ValueError as err:
            rejected[cid] = f"bad upload: {err}"
            continue
        taken.add(cid, examples, loss, spent, nbytes, upload)
        if norm is not None:
            taken.norms.append(norm)
    return taken


def reply_figures(
    run: ServerRun, cid: int, reply: Any, expect: tuple[str, ...]
) -> tuple[int, float, dict[str, int]]:
    """A TRAIN reply's figures, checked (ValueError): (its example count, the one the node
    reported when it joined; its mean loss as the simulation computes it; its FLOP counts)."""
    if protocol.METRICS not in reply.content.metric_records:
        raise ValueError("no training metrics")
    m = reply.content[protocol.METRICS]
    examples = reply_number(m, protocol.NUM_TRAIN, "example count", integral=True)
    if examples != len(run.partition.clients[cid].train):
        raise ValueError(
            f"example count {examples:g}, but the node reported "
            f"{len(run.partition.clients[cid].train)} training examples when it joined"
        )
    loss_sum = reply_number(m, protocol.LOSS_SUM, "loss sum")
    units = reply_number(m, protocol.LOSS_UNITS, "loss count")
    # the simulation's loss_sum / max(num_examples, 1), in fp32
    loss = np.float32(loss_sum) / np.maximum(np.float32(units), np.float32(1.0))
    return int(examples), float(loss), {k: whole_count(m, protocol.COSTS[k]) for k in expect}


def check_replies(
    r: int, sampled: np.ndarray, replies: Mapping[int, Any], failed: Mapping[int, str],
    rejected: Mapping[int, str],
) -> None:  # fmt: skip
    """Warns of each failed client and rejected upload; a round in which clients were sampled
    and none replied stops the run (its last checkpoint stays)."""
    for cid, why in sorted(failed.items()):
        warn_line(f"round {r}: client {cid} failed ({why})")
    for cid, why in sorted(rejected.items()):
        warn_line(f"round {r}: client {cid}'s upload rejected ({why})")
    if len(sampled) and not replies:
        raise UserError(
            f"round {r}: no sampled client replied ({'; '.join(sorted(set(failed.values())))}); "
            "check the SuperNodes, then continue with --resume"
        )
