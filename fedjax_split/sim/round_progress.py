"""A simulated round's progress, told to a hook as its client programs finish (`run_round(
on_progress=...)`, off by default).

The host learns when a client program has finished only by waiting for it, so with a hook the
loop waits, after enqueueing each program, for the one enqueued a device's worth earlier (a scalar
read from its output before the next program takes that output over): every device keeps one
program queued behind the one running, and the hook hears the clients, steps and examples finished
so far. Without a hook the host waits for nothing and the round is unchanged; with one the models
are the same bit for bit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.fed.client import ClientState


class RoundProgress(NamedTuple):
    """How far a round's training has come, as far as the host has seen it finish."""

    clients_done: int  # sampled clients whose every step has finished
    clients: int  # sampled clients
    steps_done: int  # real local steps finished, all clients together (padded steps not counted)
    steps: int  # real local steps of the round
    examples_done: int  # training examples those steps consumed (an example once per epoch)


ProgressHook = Callable[[RoundProgress], None]


def real_counts(seg: Any) -> tuple[int, int]:
    """(real steps, examples) of one client's segment [S, ...] (a `Batch`, or anything with its
    example and step masks): the steps with examples that end there (a step of several parts
    counts at its last), and the examples of every real part; padding not counted."""
    rows = np.asarray(seg.example_mask).reshape(np.shape(seg.example_mask)[0], -1).sum(-1)
    real = rows > 0
    if seg.step_mask is not None:
        real &= np.asarray(seg.step_mask).reshape(-1)
    last = getattr(seg, "last_part", None)
    ends = real if last is None else real & np.asarray(last).reshape(-1)
    return int(ends.sum()), int(np.rint(rows[real].sum()))


class Watcher:
    """Waits for a round's programs `lag` behind the latest enqueued and tells the hook what has
    finished (the module's docstring says why)."""

    def __init__(self, hook: ProgressHook, segments: Sequence[Sequence[Batch]], lag: int) -> None:
        self.hook, self.lag = hook, lag
        self.counts = [[real_counts(s) for s in client] for client in segments]
        self.left = [len(client) for client in segments]
        self.steps = sum(n for client in self.counts for n, _ in client)
        self.done = [0, 0, 0]  # clients, steps, examples
        self.queue: collections.deque[tuple[jax.Array, list[tuple[int, int]]]] = collections.deque()

    def enqueued(self, state: ClientState, items: list[tuple[int, int]]) -> None:
        """`state`: the output of the program that ran segment j of client i for each (i, j) of
        `items`; read (a scalar) before another program takes it over."""
        self.queue.append((jnp.sum(state.steps), items))
        while len(self.queue) > self.lag:
            marker, finished = self.queue.popleft()
            jax.block_until_ready(marker)
            for i, j in finished:
                steps, examples = self.counts[i][j]
                self.left[i] -= 1
                self.done[0] += self.left[i] == 0
                self.done[1] += steps
                self.done[2] += examples
            clients, steps, examples = self.done
            self.hook(RoundProgress(clients, len(self.left), steps, self.steps, examples))
