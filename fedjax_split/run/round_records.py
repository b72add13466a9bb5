"""A round record's bytes, seconds and FLOPs, and what the records so far say about the clients
(who has trained, each one's newest round). The simulation and the Flower server write the same."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedjax_split.run import costs


def round_costs(
    history: Sequence[dict[str, Any]],
    bytes_up: int,
    bytes_down: int,
    t0: float,
    t_train: float,
    t_eval: float,
) -> dict[str, Any]:
    """A round record's bytes (this round's and, with `history`, cumulative) and seconds; the
    simulation and the Flower server write the same fields."""
    previous = history[-1] if history else None
    cum_up = bytes_up + (previous["cum_bytes_up"] if previous else 0)
    cum_down = bytes_down + (previous["cum_bytes_down"] if previous else 0)
    return dict(
        bytes_up=bytes_up,
        bytes_down=bytes_down,
        cum_bytes_up=cum_up,
        cum_bytes_down=cum_down,
        cum_bytes=cum_up + cum_down,
        seconds=t_eval - t0,
        # where the round's time went: sampling, batching, training and the server step (with
        # the first round's compilation), then evaluation (0 when not due)
        train_seconds=t_train - t0,
        eval_seconds=t_eval - t_train,
    )


def cost_record(
    history: Sequence[dict[str, Any]], bytes_up: int, bytes_down: int,
    times: tuple[float, float, float], clients: Sequence[Any], exact: bool,
    bert_fl_bytes: int | None, sampled: int,
) -> dict[str, Any]:  # fmt: skip
    """A round record's bytes and seconds (`round_costs`; `times`: the round's start, the end of
    its training and of its evaluation), then its FLOPs (`run.costs.round_record` of the
    sampled clients' `clients` counts): the simulation's and the Flower server's."""
    record = round_costs(history, bytes_up, bytes_down, *times)
    record.update(costs.round_record(history, clients, exact, bert_fl_bytes, sampled))
    return record


def newest_rounds(history: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Each client's last round among the records' sampled clients: the round of its newest
    part in a simulation's client store (every sampled client stores its part)."""
    return {int(c): int(h["round"]) for h in history for c in h["clients_sampled"]}


def trained_clients(history: Sequence[dict[str, Any]], now: Sequence[int] = ()) -> set[int]:
    """The clients whose updates the server has taken so far: every round's sampled clients but
    those that failed (a deployed round's `clients_failed`), and `now`."""
    done = {
        int(c)
        for h in history
        for c in h["clients_sampled"]
        if c not in h.get("clients_failed", ())
    }
    return done | {int(c) for c in now}
