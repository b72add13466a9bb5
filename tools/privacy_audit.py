"""An empirical lower bound on client-level DP's epsilon from one run of the server's aggregation,
with canary clients (Steinke, Nasr and Jagielski 2023, "Privacy auditing with one (1) training
run"; the canaries in the spirit of Andrew et al. 2024, "One-shot empirical privacy estimation for
federated learning"). Why: the accountant's epsilon is an upper bound that holds only if the code
does what the analysis assumes; an audit that certifies more exposes a broken mechanism, such as
noise anyone can regenerate from the run's seed.

    python tools/privacy_audit.py                   # the default settings, the table printed
    python tools/privacy_audit.py --report          # also docs/privacy_audit.md and its figure

The game: m canary clients, each with a fixed random unit direction, each in the population
independently with probability 1/2, beside N ordinary clients with random updates. Each round the
server Poisson-samples the population with its `ServerSecret` and runs the project's own
`fed.aggregation.aggregate` (client-level DP, clip norm C fixed, noise z C, denominator M). The
adversary sees only the released means. It scores each canary from the released updates projected
on the canary's direction, guesses "in" for the k highest scores, and the number of right guesses
gives, by Steinke et al.'s theorem, an epsilon the mechanism cannot have at confidence 1 - beta
(`epsilon_lower_bound`).

Settings: DP with the server's secret noise (`ServerSecret.fresh`); DP with the noise from the seed
(`ServerSecret.from_seed(--seed)`: the insecure opt-out, and what the server did before it had a
secret); no noise (z = 0, clipping only). The adversary is the same in all: it knows --seed (the
audit's own randomness, updates, canaries and bits' draws aside, is public) and tries subtracting
the noise the seed would give (`adversary_updates`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

from study_runs import pyplot, save_figure  # noqa: E402

from fedjax_split.cli import one_line_warnings  # noqa: E402
from fedjax_split.fed import accounting, aggregation  # noqa: E402
from fedjax_split.fed.privacy import DPSpec  # noqa: E402
from fedjax_split.fed.secret import ServerSecret  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "privacy_audit.md"
FIGURE = ROOT / "docs" / "figures" / "privacy_audit.png"
OUT = ROOT / "runs" / "privacy_audit"
AGGREGATE = jax.jit(aggregation.aggregate, static_argnums=0)
PAD = 128  # stacked uploads padded to a multiple of this (weight 0): few shapes, few compilations
BLOCK = 256  # canaries at a time in float64 arithmetic
SECRET, KNOWN, NONE = "secret", "known", "none"
NOISES = (SECRET, KNOWN, NONE)
SCORES = ("likelihood", "sum")
GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.4, 0.8)


# -- Steinke, Nasr and Jagielski's bound ---------------------------------------------------------


@lru_cache(maxsize=32)
def _log_binomial_coefficients(r: int) -> np.ndarray:
    return np.array([math.lgamma(r + 1) - math.lgamma(k + 1) - math.lgamma(r - k + 1)
                     for k in range(r + 1)])  # fmt: skip


def binomial_pmf(r: int, eps: float) -> np.ndarray:
    """P[W = w] for w = 0..r, W ~ Binomial(r, e^eps / (e^eps + 1)): the right guesses among r
    about bits an eps-DP mechanism released (randomized response's accuracy), from logs."""
    log_p = -math.log1p(math.exp(-eps))  # log(e^eps / (1 + e^eps)), stable for large eps
    log_q = log_p - eps  # log(1 / (1 + e^eps))
    w = np.arange(r + 1)
    return np.exp(_log_binomial_coefficients(r) + w * log_p + (r - w) * log_q)


def p_value(eps: float, delta: float, canaries: int, guesses: int, correct: int) -> float:
    """An upper bound on P[at least `correct` of `guesses` guesses right] for any mechanism that is
    (eps, delta)-DP in each of `canaries` independent fair in/out bits (Steinke et al. 2023's main
    theorem, with the p-value computation their appendix gives as code): with v = correct,
    r = guesses, m = canaries and W ~ Binomial(r, e^eps / (e^eps + 1)),

        P[W >= v] + 2 m delta max_{i = 1..v} P[v - i <= W < v] / i;

    with delta = 0 the Binomial tail alone."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries "
                         f"({canaries})")  # fmt: skip
    if correct == 0:
        return 1.0
    pmf = binomial_pmf(guesses, eps)
    tail = float(np.sum(pmf[correct:]))  # summed from the small terms: an accurate small tail
    if delta == 0:
        return min(1.0, tail)
    below = np.concatenate([[0.0], np.cumsum(pmf[:correct])])  # below[w] = P[W < w]
    i = np.arange(1, correct + 1)
    alpha = float(np.max((below[correct] - below[correct - i]) / i))
    return min(1.0, tail + 2 * canaries * delta * alpha)


def epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, beta: float, iterations: int = 60
) -> float:
    """The largest eps (by bisection, from below) whose `p_value` is at most beta: at confidence
    1 - beta the mechanism is not (eps, delta)-DP; 0 when even eps = 0 is not rejected.

    Valid without `p_value` being monotone in eps or in the count: an (e*, delta)-DP mechanism is
    (e, delta)-DP for every e >= e*, so h(v) = min over e >= e* of p_value(e, v) bounds
    P[V >= v]; the bound returned (whose own p_value is <= beta) exceeds e* only if h(V) <= beta,
    and P[h(V) <= beta] <= P[V >= v0] <= h(v0) <= beta for v0 the least count with h(v0) <= beta.
    """
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    rejected = lambda e: p_value(e, delta, canaries, guesses, correct) <= beta
    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):  # p_value -> 1 as eps grows: every guess right with probability -> 1
        low, high = high, 2 * high
        if high > 1e3:
            return low
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if rejected(mid) else (low, mid)
    return low


# -- the game ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """One audit's population, rounds and statistics (the module docstring)."""

    dim: int = 20_000  # d: coordinates of the global part (one fp32 leaf)
    ordinary: int = 200  # N ordinary clients, always in the population
    canaries: int = 3_000  # m canary clients, each in with probability 1/2
    rate: float = 0.2  # q: each client of the population Poisson-sampled each round
    rounds: int = 3  # R
    clip: float = 1.0  # C, fixed (no adaptive clipping)
    delta: float = 1e-5
    beta: float = 0.05  # the lower bound holds at confidence 1 - beta
    guesses: tuple[tuple[int, int], ...] = ()  # (k+, k-) pairs; () for `default_guesses`
    score: str = "likelihood"  # the adversary's score (`scores`)
    seed: int = 0

    @property
    def guess_counts(self) -> tuple[tuple[int, int], ...]:
        return self.guesses or default_guesses(self)

    @property
    def denominator(self) -> float:
        """M: the expected clients a round, fixed before the canaries' bits are drawn (one that
        moved with them would reveal them outside the noise)."""
        return self.rate * (self.ordinary + self.canaries / 2)


def default_guesses(cfg: AuditConfig) -> tuple[tuple[int, int], ...]:
    """"in" guesses only, as fractions `GUESS_FRACTIONS` of the included canaries expected to take
    part in any round, (m / 2) (1 - (1 - q)^R): fixed by the configuration before the run, from a
    few confident guesses (what a noisy release supports) to most of the canaries a release could
    show (what one without noise supports). No "out" guesses: with Poisson sampling an included
    canary never sampled scores like an excluded one, so the lowest scores are a mix of both."""
    seen = cfg.canaries / 2 * (1 - (1 - cfg.rate) ** cfg.rounds)
    return tuple((k, 0) for k in sorted({max(1, round(f * seen)) for f in GUESS_FRACTIONS}))


@dataclasses.dataclass
class Canaries:
    directions: np.ndarray  # [m, d] fp32 unit vectors
    included: np.ndarray  # [m] bool: the bits the adversary guesses
    received: np.ndarray  # [d] fp32: the global part every client starts each round from


def draw_canaries(cfg: AuditConfig) -> Canaries:
    """The canaries' directions and the received copy, and apart (a stream of their own, which
    the adversary never reads: the bound treats them as fair coins independent of all it uses)
    the in/out bits, all from the seed."""
    rng = np.random.default_rng([cfg.seed, 1])
    directions = rng.standard_normal((cfg.canaries, cfg.dim), dtype=np.float32)
    for start in range(0, cfg.canaries, BLOCK):  # normalised in float64, a block at a time
        block = directions[start : start + BLOCK]
        block[...] = block / np.linalg.norm(block.astype(np.float64), axis=1, keepdims=True)
    received = (0.05 * rng.standard_normal(cfg.dim)).astype(np.float32)
    included = np.random.default_rng([cfg.seed, 3]).random(cfg.canaries) < 0.5
    return Canaries(directions, included, received)


def ordinary_updates(cfg: AuditConfig, round_: int) -> np.ndarray:
    """[N, d] fp32: the ordinary clients' updates in a round, random directions of norm C times a
    log-normal factor (median C: about half are clipped), from the seed and the round alone, so
    that a client's update does not depend on which others were sampled."""
    rng = np.random.default_rng([cfg.seed, 2, round_])
    g = rng.standard_normal((cfg.ordinary, cfg.dim))
    norms = cfg.clip * rng.lognormal(0.0, 0.5, cfg.ordinary)
    return (g * (norms / np.linalg.norm(g, axis=1))[:, None]).astype(np.float32)


def aggregator_for(cfg: AuditConfig, z: float) -> aggregation.Aggregator:
    return aggregation.Aggregator(dp=DPSpec(clip=cfg.clip, noise_multiplier=z,
                                            denominator=cfg.denominator))  # fmt: skip


@dataclasses.dataclass
class Released:
    updates: np.ndarray  # [R, d] float64: each round's released mean minus the received copy
    participations: np.ndarray  # [m] int: the rounds each canary took part in (0 if out)
    sampled: list[np.ndarray]  # each round's clients as population ids: N ordinary, then canaries
    members: np.ndarray  # population id N + i is canary members[i]


def run_rounds(cfg: AuditConfig, z: float, canaries: Canaries, secret: ServerSecret) -> Released:
    """R rounds of the server's aggregation over the population (the N ordinary clients, then the
    included canaries), each round's sample and noise key from `secret`. A canary's upload is the
    received copy plus 2 C times its direction, which the server clips to exactly C."""
    aggregator = aggregator_for(cfg, z)
    state = aggregation.init_state(aggregator)
    members = np.flatnonzero(canaries.included)
    population = cfg.ordinary + len(members)
    received = jnp.asarray(canaries.received)
    updates = np.empty((cfg.rounds, cfg.dim), np.float64)
    participations = np.zeros(cfg.canaries, np.int64)
    sampled = []
    for r in range(cfg.rounds):
        ids = secret.poisson_sample(population, cfg.rate, r)
        ordinary = ids[ids < cfg.ordinary]
        canary = members[ids[ids >= cfg.ordinary] - cfg.ordinary]
        participations[canary] += 1
        rows = max(PAD, -(-len(ids) // PAD) * PAD)
        stacked = np.broadcast_to(canaries.received, (rows, cfg.dim)).copy()
        stacked[: len(ordinary)] += ordinary_updates(cfg, r)[ordinary]
        stacked[len(ordinary) : len(ids)] += 2 * cfg.clip * canaries.directions[canary]
        weights = (np.arange(rows) < len(ids)).astype(np.float32)  # padding: weight 0
        out = AGGREGATE(aggregator, jnp.asarray(stacked), received, jnp.asarray(weights), state,
                        secret.noise_key(r))  # fmt: skip
        state = out.state
        updates[r] = np.asarray(out.mean, np.float64) - canaries.received.astype(np.float64)
        sampled.append(ids)
    return Released(updates, participations, sampled, members)


def regenerated_noise(cfg: AuditConfig, z: float, received: np.ndarray, seed: int) -> np.ndarray:
    """[R, d] float64: each round's noise / M as an adversary who knows the seed computes it: the
    server's own aggregation of no client, with the round's key from `ServerSecret.from_seed`
    (the mean of an empty round is the received copy plus exactly that noise)."""
    secret = ServerSecret.from_seed(seed)
    aggregator = aggregator_for(cfg, z)
    state = aggregation.init_state(aggregator)  # the clip norm is fixed: every round's state
    nobody = jnp.zeros((0, cfg.dim), jnp.float32)
    out = np.empty((cfg.rounds, cfg.dim), np.float64)
    for r in range(cfg.rounds):
        mean = AGGREGATE(aggregator, nobody, jnp.asarray(received), jnp.zeros([0], jnp.float32),
                         state, secret.noise_key(r)).mean  # fmt: skip
        out[r] = np.asarray(mean, np.float64) - received.astype(np.float64)
    return out


def adversary_updates(
    cfg: AuditConfig, z: float, received: np.ndarray, updates: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The updates [R, d] the adversary scores, and [R] bool: the rounds where it subtracted the
    noise `regenerated_noise` gives for the public seed. It subtracts it where that shrinks the
    round's released update (as it does when the server's noise is the seed's, leaving the clipped
    sum; another noise would add its own): a choice made from the release and public things only,
    so the bound needs no correction for it."""
    if z == 0:
        return updates, np.zeros(len(updates), bool)
    cleaned = updates - regenerated_noise(cfg, z, received, cfg.seed)
    subtract = np.linalg.norm(cleaned, axis=1) < np.linalg.norm(updates, axis=1)
    return np.where(subtract[:, None], cleaned, updates), subtract


def projections(cfg: AuditConfig, directions: np.ndarray, updates: np.ndarray) -> np.ndarray:
    """[R, m] float64: each round's released update against each canary's direction, in units of
    one participation (C / M: a canary that took part adds 1), a block of canaries at a time."""
    out = np.empty((len(updates), len(directions)), np.float64)
    for start in range(0, len(directions), BLOCK):
        out[:, start : start + BLOCK] = updates @ directions[start : start + BLOCK].T.astype(
            np.float64
        )
    return out * cfg.denominator / cfg.clip


def scores(cfg: AuditConfig, x: np.ndarray, kind: str = "likelihood") -> np.ndarray:
    """[m] the adversary's score of each canary from its projections `x` [R, m].

    "sum": the sum over the rounds. "likelihood": the log-likelihood ratio of in against out were
    a round's projection N(1, s_r^2) when the canary took part (probability q) and N(0, s_r^2)
    when not: sum_r log(1 - q + q exp((x_r - 1/2) / s_r^2)), s_r estimated from the round's
    projections (1.4826 times their median absolute deviation: most canaries are not in a given
    round). Why: the sum adds every round's noise and interference to a signal only the rounds a
    canary took part in carry; the likelihood weighs each round by its evidence. Both use the
    released output and public settings only, as the bound requires."""
    if kind == "sum":
        return x.sum(axis=0)
    if kind != "likelihood":
        raise ValueError(f"unknown score {kind!r}; use one of {', '.join(SCORES)}")
    centre = np.median(x, axis=1, keepdims=True)
    s2 = (1.4826 * np.median(np.abs(x - centre), axis=1, keepdims=True)) ** 2
    skip = -np.inf if cfg.rate == 1 else math.log1p(-cfg.rate)
    return np.sum(np.logaddexp(skip, math.log(cfg.rate) + (x - 0.5) / s2), axis=0)


def count_correct(score: np.ndarray, included: np.ndarray, k_in: int, k_out: int) -> int:
    """Right guesses of "in" for the k_in highest scores and "out" for the k_out lowest."""
    if k_in + k_out > len(score):
        raise ValueError(f"{k_in} + {k_out} guesses for {len(score)} canaries")
    order = np.argsort(-score, kind="stable")
    top, bottom = order[:k_in], order[len(score) - k_out :]
    return int(np.sum(included[top]) + np.sum(~included[bottom]))


def best_bound(cfg: AuditConfig, score: np.ndarray, included: np.ndarray) -> dict[str, Any]:
    """The bound at confidence 1 - beta over the J configured guess counts, each tested at
    beta / J (Bonferroni), the largest kept: valid whichever count wins. Also the ceiling, the
    bound had every guess been right: the most this audit could show."""
    j = len(cfg.guess_counts)
    each = []
    for k_in, k_out in cfg.guess_counts:
        k = k_in + k_out
        correct = count_correct(score, included, k_in, k_out)
        bound = epsilon_lower_bound(cfg.canaries, k, correct, cfg.delta, cfg.beta / j)
        each.append({"k_in": k_in, "k_out": k_out, "guesses": k, "correct": correct,
                     "bound": bound})  # fmt: skip
    best = max(each, key=lambda x: x["bound"])
    ceiling = max(epsilon_lower_bound(cfg.canaries, x["guesses"], x["guesses"], cfg.delta,
                                      cfg.beta / j) for x in each)  # fmt: skip
    return {**best, "ceiling": ceiling, "each": each}


def accountant_epsilon(cfg: AuditConfig, z: float, name: str) -> float:
    """The accountant's epsilon for the composition each canary sees: R rounds of the Gaussian
    mechanism of multiplier z, Poisson-sampled at q; infinite without noise."""
    if z == 0:
        return math.inf
    return accounting.epsilon(accounting.Mechanism(z, cfg.rate, name), cfg.rounds, cfg.delta)


def label(z: float, noise: str) -> str:
    """The setting in words."""
    if noise == NONE:
        return "no noise (z=0), clipping only"
    how = {SECRET: "secret noise (ServerSecret.fresh)",
           KNOWN: "noise from --seed (ServerSecret.from_seed)"}[noise]  # fmt: skip
    return f"DP z={z:g}, {how}"


def audit(
    cfg: AuditConfig,
    z: float,
    noise: str,
    canaries: Canaries,
    server_secret: ServerSecret | None = None,
) -> dict[str, Any]:
    """One setting's audit: the rounds, the adversary's scores and guesses, the bound beside the
    accountant's epsilon. `noise` is where the server's randomness comes from: SECRET (its secret:
    `server_secret`, or a fresh one), KNOWN (the opt-out's secret from the seed) or NONE (z = 0, a
    fresh secret for the sample). The adversary does not know which."""
    if (noise == NONE) != (z == 0):
        raise ValueError(f"the setting {noise!r} with z = {z}: no noise goes with z = 0 only")
    t0 = time.perf_counter()
    if noise == KNOWN:
        secret = ServerSecret.from_seed(cfg.seed)
    else:
        secret = ServerSecret.fresh() if server_secret is None else server_secret
    released = run_rounds(cfg, z, canaries, secret)
    updates, subtracted = adversary_updates(cfg, z, canaries.received, released.updates)
    score = scores(cfg, projections(cfg, canaries.directions, updates), cfg.score)
    sampled = canaries.included & (released.participations > 0)
    return {
        "setting": label(z, noise),
        "noise": noise,
        "noise_multiplier": z,
        "epsilon_rdp": accountant_epsilon(cfg, z, "rdp"),
        "epsilon_pld": accountant_epsilon(cfg, z, "pld"),
        **best_bound(cfg, score, canaries.included),
        "canaries_in": int(canaries.included.sum()),
        "canaries_in_sampled": int(sampled.sum()),
        "seed_noise_subtracted": [bool(x) for x in subtracted],
        "clients_per_round": [len(x) for x in released.sampled],
        "seconds": time.perf_counter() - t0,
        "_score": score,
        "_sampled": sampled,
    }


def run_audits(
    cfg: AuditConfig, zs: Sequence[float], noises: Sequence[str]
) -> tuple[list[dict[str, Any]], Canaries]:
    """Every setting asked for (each z with secret, then with known noise, then z = 0), all with
    the same canaries and bits; and those canaries."""
    canaries = draw_canaries(cfg)
    settings = [(z, n) for n in (SECRET, KNOWN) if n in noises for z in zs]
    if NONE in noises:
        settings.append((0.0, NONE))
    return [audit(cfg, z, n, canaries) for z, n in settings], canaries


# -- output --------------------------------------------------------------------------------------

COLUMNS = ("setting", "epsilon_rdp", "epsilon_pld", "bound", "correct", "guesses", "ceiling",
           "canaries_in", "canaries_in_sampled", "seconds")  # fmt: skip


def _eps(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2f}"


def table(rows: Sequence[dict[str, Any]], cfg: AuditConfig) -> list[str]:
    """The results as a markdown table."""
    lines = [
        "| setting | accountant epsilon (RDP) | accountant epsilon (PLD) | empirical lower bound "
        f"at {100 * (1 - cfg.beta):g}% | right guesses / guesses | most the guesses could "
        "certify | canaries in (took part) |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['setting']} | {_eps(x['epsilon_rdp'])} | {_eps(x['epsilon_pld'])} | "
            f"**{x['bound']:.2f}** | {x['correct']} / {x['guesses']} | {x['ceiling']:.2f} | "
            f"{x['canaries_in']} ({x['canaries_in_sampled']}) |"
        )
    return lines


def public(row: dict[str, Any]) -> dict[str, Any]:
    """A result row as JSON holds it: no per-canary arrays, an infinite epsilon as null."""
    return {k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in row.items() if not k.startswith("_")}  # fmt: skip


def write_outputs(rows: Sequence[dict[str, Any]], cfg: AuditConfig, out: Path) -> None:
    """audit.json (the configuration, every row with each guess count's result) and audit.csv."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**dataclasses.asdict(cfg), "guesses": cfg.guess_counts,
              "denominator": cfg.denominator}  # fmt: skip
    data = {"config": config, "results": [public(r) for r in rows]}
    (out / "audit.json").write_text(json.dumps(data, indent=1) + "\n")
    with open(out / "audit.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out / 'audit.json'} and {out / 'audit.csv'}")


def figure(
    rows: Sequence[dict[str, Any]], included: np.ndarray, score_kind: str, path: Path
) -> None:
    """Histograms of the scores (in and took part, in but never sampled, out), a panel a
    setting: where the classes overlap no guess can be sure, where they part every one can."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(3.1 * len(rows), 3.0), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        score, sampled = row["_score"], row["_sampled"]
        bins = np.linspace(score.min(), score.max(), 60)
        for name, values in [("in, took part", score[sampled]),
                             ("in, never sampled", score[included & ~sampled]),
                             ("out", score[~included])]:  # fmt: skip
            ax.hist(values, bins=bins, histtype="step", label=name)
        ax.set_yscale("log")
        ax.set_title(row["setting"].split(" (")[0], fontsize=7)
        ax.set_xlabel(f"score ({score_kind})", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("canaries", fontsize=7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def report(
    rows: Sequence[dict[str, Any]], cfg: AuditConfig, argv: Sequence[str], seconds: float
) -> str:
    """docs/privacy_audit.md: the table and what it means, in this run's numbers."""
    secret = [r for r in rows if r["noise"] == SECRET]
    known = [r for r in rows if r["noise"] == KNOWN]
    none = [r for r in rows if r["noise"] == NONE]
    ks = ", ".join(f"{a}" if b == 0 else f"{a} in + {b} out" for a, b in cfg.guess_counts)
    conf = f"{100 * (1 - cfg.beta):g}%"
    lines = [
        "# Empirical privacy audit of client-level DP (generated by tools/privacy_audit.py)",
        "",
        f"`{' '.join(['python tools/privacy_audit.py', *argv])}`, {seconds:.0f} s on a 2-core "
        "CPU. It audits the server's aggregation step, `fedjax_split.fed.aggregation.aggregate` "
        "with `Aggregator(dp=DPSpec(clip=C, noise_multiplier=z, denominator=M))`, each round's "
        "client sample and noise key from `fedjax_split.fed.secret.ServerSecret`, on synthetic "
        "client updates: no BERT is trained. The step is the mechanism the accountant's epsilon "
        "is about; everything the server releases afterwards is computed from its means "
        "(post-processing), so this is where the guarantee is kept or broken.",
        "",
        "## Result",
        "",
        *table(rows, cfg),
        "",
        "The accountant's epsilon is for the composition each canary sees: "
        f"{cfg.rounds} round(s) of the Gaussian mechanism, clients Poisson-sampled at "
        f"q = {cfg.rate:g}, adjacency adding or removing one client, delta = {cfg.delta:g} (RDP: "
        "what the project's runs report; PLD: the tighter accountant, for reference). The lower "
        f"bound holds at {conf} confidence: were the mechanism (epsilon, delta)-DP for an epsilon "
        "below it, this many right guesses would have had probability at most "
        f"{cfg.beta:g}. The most the guesses could certify is the bound had every guess been "
        f"right: with {cfg.canaries} canaries and these guess counts no run can show more. "
        "\"Took part\": "
        "included canaries sampled in at least one round (the others left no trace).",
        "",
    ]
    for r in secret:
        verdict = ("below it, as it must be if the code and the accountant are right"
                   if r["bound"] <= min(r["epsilon_pld"], r["epsilon_rdp"]) else
                   "ABOVE it: the accountant or the implementation is wrong")  # fmt: skip
        lines.append(f"- {r['setting']}: {r['bound']:.2f} against the accountant's "
                     f"{_eps(r['epsilon_pld'])} (PLD), {verdict}.")  # fmt: skip
    for r in known:
        over = r["bound"] > r["epsilon_rdp"]
        lines.append(
            f"- {r['setting']}: {r['bound']:.2f} ({r['correct']} of {r['guesses']} guesses "
            "right), "
            + (f"above the accountant's {_eps(r['epsilon_rdp'])} (RDP) for the same z: with the "
               "seed known this run demonstrably lacks the privacy it reports."
               if over else f"{'at' if r['bound'] >= r['ceiling'] else 'near'} the audit's "
               f"ceiling of {r['ceiling']:.2f}; the accountant's "
               f"{_eps(r['epsilon_rdp'])} for this z is beyond what {cfg.canaries} canaries can "
               "show, but the guesses are as good as without any noise.")  # fmt: skip
        )
    for r in none:
        lines.append(f"- {r['setting']}: {r['bound']:.2f} ({r['correct']} of {r['guesses']} "
                     "guesses right), the reference: clipping alone hides nothing.")  # fmt: skip
    lines += [
        "",
        "One-run audits of the Gaussian mechanism sit well below the accountant even where the "
        "accountant is tight (Steinke et al. observe the same gap), and their ceiling grows only "
        "like the log of the number of guesses; so the secret-noise rows say the implementation "
        "shows no leak this adversary can find, not what the true epsilon is. With secret noise "
        "the numbers change from run to run (a fresh server secret each time, by design); the "
        "seed fixes everything else.",
        "",
        "## The setting",
        "",
        f"- Global part: d = {cfg.dim} fp32 coordinates; the received copy is random and known to "
        "the adversary, which subtracts it from the released mean.",
        f"- {cfg.ordinary} ordinary clients, always in the population: each round a fresh random "
        "update, a Gaussian direction of norm C times a log-normal factor (median C).",
        f"- {cfg.canaries} canary clients, each in the population independently with probability "
        "1/2 (the bits the adversary guesses), each with a fixed random unit direction u_j; a "
        "canary's upload is the received copy plus 2 C u_j, which the server clips to exactly "
        "C u_j.",
        f"- Each round the server Poisson-samples the population at q = {cfg.rate:g} "
        "(`ServerSecret.poisson_sample`), clips each update to C = "
        f"{cfg.clip:g}, adds N(0, (z C)^2) per coordinate to the sum and divides by "
        f"M = {cfg.denominator:g} (the expected clients a round, fixed before the canaries' bits "
        f"are drawn); {cfg.rounds} round(s), the clip norm fixed.",
        "- The adversary sees the released means only, and knows the seed. Each round it "
        "computes the noise the seed would give, as the server would with "
        "`ServerSecret.from_seed(seed)` (`aggregate` of no client with the round's key), and "
        "subtracts it if that makes the released update smaller: so it does where the server's "
        "noise is the seed's, leaving the exact clipped sum up to fp32 rounding, far below one "
        "canary's contribution; with the server's secret it never does, as the other noise "
        "would add its own. It projects each round's update on u_j (in units of C / M, so that "
        "taking part adds 1) and scores canary j by "
        + ("the log-likelihood ratio sum_r log(1 - q + q exp((x_r - 1/2) / s_r^2)), s_r the "
           "projections' spread in round r estimated from the release itself"
           if cfg.score == "likelihood" else "the sum of its projections over the rounds")
        + ".",
        f"- Guesses: \"in\" for the k highest scores, k in {{{ks}}} (fractions "
        f"{', '.join(f'{f:g}' for f in GUESS_FRACTIONS)} of the included canaries expected to "
        "take part), fixed before the run; each k is tested at "
        f"{cfg.beta:g} / {len(cfg.guess_counts)} (Bonferroni) and the largest bound is reported, "
        "so trying several does not inflate it. No \"out\" guesses: an included canary that was "
        "never sampled scores like an excluded one, so the lowest scores are a mix of both.",
        "",
        "## What the bound means and assumes",
        "",
        "Steinke, Nasr and Jagielski (2023): if the released output is (epsilon, delta)-DP in "
        "each canary's bit and the bits are independent fair coins, the number V of right "
        "guesses among r satisfies P[V >= v] <= P[W >= v] + 2 m delta max_i P[v - i <= W < v] / i "
        "for W ~ Binomial(r, e^epsilon / (e^epsilon + 1)) and m canaries (with delta = 0: the "
        "Binomial tail alone); the computation of that term follows the code in their appendix. "
        "The bound is the largest epsilon this rejects at the observed count. It assumes that "
        "the bits are independent fair coins, drawn before the rounds (numpy, from --seed, in a "
        "stream of their own the adversary never reads), and that the guesses depend on the "
        "released output and public things only (the canaries' directions, the received copy, "
        "the noise the seed gives); nothing about the mechanism. It is a lower bound for "
        "this adversary: a weak audit proves little about the true epsilon, a bound above the "
        "accountant's proves the accountant wrong for this code.",
        "",
    ]
    if FIGURE.is_file():
        lines += [
            "![scores of the canaries in each setting](figures/privacy_audit.png)",
            "",
            "The canaries' scores in each setting (log scale): included canaries that took part, "
            "included canaries never sampled, excluded canaries. With secret noise the three "
            "overlap; with the noise from the seed or none, those that took part stand apart.",
            "",
        ]
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------


def _guess_pair(text: str) -> tuple[int, int]:
    k_in, _, k_out = text.partition(":")
    try:
        pair = (int(k_in), int(k_out or 0))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a guess count is K or K:K_OUT, got {text!r}") from None
    if min(pair) < 0 or sum(pair) == 0:
        raise argparse.ArgumentTypeError(f"guess counts are >= 0, not both 0: {text!r}")
    return pair


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, AuditConfig]:
    d = AuditConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=d.dim, help="coordinates of the global part")
    p.add_argument("--ordinary", type=int, default=d.ordinary, help="ordinary clients N")
    p.add_argument("--canaries", type=int, default=d.canaries, help="canary clients m")
    p.add_argument("--rate", type=float, default=d.rate, help="Poisson sampling rate q")
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds R")
    p.add_argument("--clip", type=float, default=d.clip, help="clip norm C")
    p.add_argument("--noise-multipliers", type=float, nargs="+", default=[1.0, 0.5],
                   metavar="Z", help="z of the DP settings (each with secret noise and with "
                   "noise from the seed)")  # fmt: skip
    p.add_argument("--settings", default=",".join(NOISES),
                   help="comma-separated, of: secret, known (noise from --seed), "
                   "none (z = 0)")  # fmt: skip
    p.add_argument("--delta", type=float, default=d.delta, help="delta of accountant and bound")
    p.add_argument("--beta", type=float, default=d.beta,
                   help="the bound holds at confidence 1 - beta")  # fmt: skip
    p.add_argument("--guesses", type=_guess_pair, nargs="+", default=[], metavar="K[:K_OUT]",
                   help="guess counts tried, Bonferroni-corrected: 'in' for the K highest "
                   "scores (and 'out' for the K_OUT lowest); by default fractions "
                   f"{', '.join(f'{f:g}' for f in GUESS_FRACTIONS)} of the included canaries "
                   "expected to take part")  # fmt: skip
    p.add_argument("--score", choices=SCORES, default=d.score,
                   help="the adversary's score of a canary")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed,
                   help="the audit's public randomness, and the opt-out's noise seed")  # fmt: skip
    p.add_argument("--out", type=Path, default=OUT, help="folder for audit.json and audit.csv")
    p.add_argument("--report", action="store_true",
                   help="write docs/privacy_audit.md and its figure")  # fmt: skip
    args = p.parse_args(argv)
    args.noises = [x.strip() for x in args.settings.split(",") if x.strip()]
    if not args.noises or any(x not in NOISES for x in args.noises):
        p.error(f"--settings takes {', '.join(NOISES)}, got {args.settings!r}")
    if not (args.dim > 0 and args.ordinary >= 0 and args.canaries > 0 and args.rounds > 0):
        p.error("--dim, --canaries and --rounds must be > 0, --ordinary >= 0")
    if not 0 < args.rate <= 1:
        p.error(f"--rate must be in (0, 1], got {args.rate}")
    if not all(z > 0 for z in args.noise_multipliers):
        p.error("--noise-multipliers must be > 0 (z = 0 is the setting 'none')")
    if any(a + b > args.canaries for a, b in args.guesses):
        p.error(f"more guesses than the {args.canaries} canaries")
    if not (0 < args.beta < 1 and 0 < args.delta < 1):
        p.error("--beta and --delta must be in (0, 1)")
    cfg = AuditConfig(dim=args.dim, ordinary=args.ordinary, canaries=args.canaries,
                      rate=args.rate, rounds=args.rounds, clip=args.clip, delta=args.delta,
                      beta=args.beta, guesses=tuple(args.guesses), score=args.score,
                      seed=args.seed)  # fmt: skip
    return args, cfg


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse(argv)
    t0 = time.perf_counter()
    rows, canaries = run_audits(cfg, args.noise_multipliers, args.noises)
    seconds = time.perf_counter() - t0
    print("\n".join(table(rows, cfg)))
    print(f"({seconds:.0f} s; M = {cfg.denominator:g}, q = {cfg.rate:g}, R = {cfg.rounds}, "
          f"delta = {cfg.delta:g}, guesses {[k for k, _ in cfg.guess_counts]})")  # fmt: skip
    write_outputs(rows, cfg, args.out)
    if args.report:
        figure(rows, canaries.included, cfg.score, FIGURE)
        DOC.write_text(report(rows, cfg, argv, seconds) + "\n")
        print(f"wrote {DOC} and {FIGURE}")
    return 0


if __name__ == "__main__":
    one_line_warnings()
    raise SystemExit(main())
