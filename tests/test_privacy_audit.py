"""tools/privacy_audit.py: Steinke et al.'s bound against the Binomial tail computed independently
(scipy, and a direct sum for the delta term), its closed form when every guess is right, and small
one-run audits of the real aggregation by an adversary who knows the seed: with the server's
secret noise the bound stays below the accountant's epsilon; with the noise from the seed (the
opt-out, and the server before it had a secret), or none, it goes above it."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from fedjax_split.fed.secret import ServerSecret

_SPEC = importlib.util.spec_from_file_location(
    "privacy_audit", Path(__file__).resolve().parents[1] / "tools" / "privacy_audit.py"
)
pa = importlib.util.module_from_spec(_SPEC)
sys.modules["privacy_audit"] = pa  # its dataclasses look their module up
_SPEC.loader.exec_module(pa)

# a small audit: 200 canaries (about 100 in), 20 ordinary clients, 3 rounds at q = 0.5
SMALL = pa.AuditConfig(dim=2000, ordinary=20, canaries=200, rate=0.5, rounds=3, seed=0)
Z = 2.0  # its accountant's epsilon (about 2.2 by PLD) is below what 200 canaries can certify
HIDDEN = ServerSecret(bytes(range(32)))  # a server secret the adversary does not know


def _direct_p_value(eps: float, delta: float, m: int, r: int, v: int) -> float:
    """The bound written out term by term in plain floats."""
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, w) * p**w * (1 - p) ** (r - w) for w in range(r + 1)]
    tail = sum(pmf[v:])
    alpha = max(sum(pmf[v - i : v]) / i for i in range(1, v + 1))
    return min(1.0, tail + 2 * m * delta * alpha)


@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0, 2.5, 6.0])
@pytest.mark.parametrize(("r", "v"), [(1, 1), (10, 7), (100, 50), (100, 93), (400, 400)])
def test_p_value_without_delta_is_the_binomial_tail(eps: float, r: int, v: int) -> None:
    want = scipy.stats.binom.sf(v - 1, r, math.exp(eps) / (1 + math.exp(eps)))
    assert pa.p_value(eps, 0.0, 1000, r, v) == pytest.approx(want, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(("eps", "delta", "m", "r", "v"),
                         [(1.0, 1e-5, 1000, 50, 40), (2.0, 1e-3, 200, 80, 75),
                          (0.5, 1e-2, 100, 30, 20), (4.0, 1e-4, 500, 120, 120)])  # fmt: skip
def test_p_value_with_delta_adds_the_2m_delta_term(
    eps: float, delta: float, m: int, r: int, v: int
) -> None:
    got = pa.p_value(eps, delta, m, r, v)
    assert got == pytest.approx(_direct_p_value(eps, delta, m, r, v), rel=1e-9)
    assert got > pa.p_value(eps, 0.0, m, r, v)  # delta only ever weakens the test


@pytest.mark.parametrize("r", [20, 100, 586])
@pytest.mark.parametrize("beta", [0.05, 0.01])
def test_every_guess_right_without_delta_has_a_closed_form(r: int, beta: float) -> None:
    # P[W = r] = p^r = beta: p = beta^(1/r), eps = log(p / (1 - p))
    p = beta ** (1 / r)
    assert pa.epsilon_lower_bound(1000, r, r, 0.0, beta) == pytest.approx(
        math.log(p / (1 - p)), abs=1e-9
    )


def test_the_bound_is_the_edge_of_the_rejected_epsilons() -> None:
    m, r, v, delta, beta = 1000, 300, 240, 1e-5, 0.05
    eps = pa.epsilon_lower_bound(m, r, v, delta, beta)
    assert 0.5 < eps < 3
    assert pa.p_value(eps, delta, m, r, v) <= beta < pa.p_value(eps + 1e-6, delta, m, r, v)


def test_more_right_guesses_give_a_larger_bound_and_chance_gives_none() -> None:
    m, r, delta, beta = 1000, 300, 1e-5, 0.05
    bounds = [pa.epsilon_lower_bound(m, r, v, delta, beta) for v in range(150, 301, 10)]
    assert bounds[0] == 0.0  # half right: what coin flips get
    assert all(a <= b for a, b in zip(bounds, bounds[1:], strict=False))
    assert bounds[-1] > bounds[-2] > bounds[len(bounds) // 2] > 0
    # a larger delta can only lower the bound
    assert pa.epsilon_lower_bound(m, r, 280, 1e-3, beta) < pa.epsilon_lower_bound(
        m, r, 280, 0.0, beta
    )


def test_guesses_from_scores_unrelated_to_the_bits_certify_next_to_nothing() -> None:
    cfg = pa.AuditConfig(canaries=3000, rate=0.2, rounds=3)
    rng = np.random.default_rng(7)
    bound = pa.best_bound(cfg, rng.standard_normal(3000), rng.random(3000) < 0.5)
    assert bound["bound"] < 0.3
    assert bound["ceiling"] > 4  # what right guesses would have certified


def test_guesses_count_in_at_the_top_and_out_at_the_bottom() -> None:
    score = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, False, True, False, False, True])
    assert pa.count_correct(score, included, 2, 0) == 1  # 0 in, 1 out
    assert pa.count_correct(score, included, 0, 2) == 1  # 5 in, 4 out
    assert pa.count_correct(score, included, 3, 3) == 2 + 2  # 0, 2 in; 3, 4 out
    with pytest.raises(ValueError):
        pa.count_correct(score, included, 4, 3)


def test_default_guesses_are_fractions_of_the_canaries_expected_to_take_part() -> None:
    # 1500 in, 1 - 0.8^3 = 0.488 of them sampled at least once: 732 expected
    cfg = pa.AuditConfig(canaries=3000, rate=0.2, rounds=3)
    assert cfg.guess_counts == ((37, 0), (73, 0), (146, 0), (293, 0), (586, 0))
    assert pa.AuditConfig(guesses=((10, 5),)).guess_counts == ((10, 5),)


def _clipped_sum(cfg: pa.AuditConfig, canaries: pa.Canaries, released: pa.Released,
                 r: int) -> np.ndarray:  # fmt: skip
    """Round r's sum of the clipped updates / M, in float64 from the uploads the server got."""
    ids = released.sampled[r]
    ordinary = pa.ordinary_updates(cfg, r)[ids[ids < cfg.ordinary]]
    canary = canaries.directions[released.members[ids[ids >= cfg.ordinary] - cfg.ordinary]]
    uploads = np.concatenate([canaries.received + ordinary,
                              canaries.received + 2 * cfg.clip * canary])  # fmt: skip
    deltas = uploads.astype(np.float64) - canaries.received.astype(np.float64)
    norms = np.linalg.norm(deltas, axis=1, keepdims=True)
    return np.sum(deltas * np.minimum(1.0, cfg.clip / norms), axis=0) / cfg.denominator


def test_the_noise_regenerated_from_the_seed_is_the_servers_to_fp32_rounding() -> None:
    canaries = pa.draw_canaries(SMALL)
    regenerated = pa.regenerated_noise(SMALL, Z, canaries.received, SMALL.seed)
    noise_scale = Z * SMALL.clip / SMALL.denominator  # per coordinate
    for secret, leaks in [(ServerSecret.from_seed(SMALL.seed), True), (HIDDEN, False)]:
        released = pa.run_rounds(SMALL, Z, canaries, secret)
        for r in range(SMALL.rounds):
            left = released.updates[r] - regenerated[r] - _clipped_sum(SMALL, canaries, released, r)
            if leaks:  # the exact clipped sum is left, up to fp32 rounding
                assert np.max(np.abs(left)) < 1e-5 * noise_scale
            else:  # another secret's noise: two independent draws
                assert np.std(left) == pytest.approx(math.sqrt(2) * noise_scale, rel=0.1)


def test_with_secret_noise_the_bound_stays_below_the_accountants_epsilon() -> None:
    row = pa.audit(SMALL, Z, pa.SECRET, pa.draw_canaries(SMALL), server_secret=HIDDEN)
    assert row["seed_noise_subtracted"] == [False] * SMALL.rounds  # it would only add noise
    assert row["epsilon_pld"] < row["epsilon_rdp"] < 3
    assert row["bound"] < row["epsilon_pld"]
    assert row["ceiling"] > row["epsilon_rdp"]  # the audit could have shown more


@pytest.mark.parametrize(("z", "noise"), [(Z, pa.KNOWN), (0.0, pa.NONE)])
def test_with_the_noise_from_the_seed_or_none_the_bound_exceeds_the_accountants(
    z: float, noise: str
) -> None:
    row = pa.audit(SMALL, z, noise, pa.draw_canaries(SMALL))
    assert row["seed_noise_subtracted"] == [noise == pa.KNOWN] * SMALL.rounds
    # above even the tighter accountant's epsilon of the run with DP z = 2: not (eps, delta)-DP
    assert row["bound"] > pa.accountant_epsilon(SMALL, Z, "pld") > 2
    assert row["correct"] >= row["guesses"] - 1  # a miss at most (one would still do)
    assert row["canaries_in_sampled"] >= row["guesses"]


def test_the_command_writes_the_table_json_csv_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(pa, "DOC", tmp_path / "privacy_audit.md")
    monkeypatch.setattr(pa, "FIGURE", tmp_path / "figures" / "privacy_audit.png")
    argv = ["--dim=1000", "--ordinary=10", "--canaries=100", "--rate=0.5", "--rounds=2",
            "--noise-multipliers", "2", "--settings=known,none", f"--out={tmp_path / 'out'}",
            "--report"]  # fmt: skip
    assert pa.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| DP z=2, noise from --seed (ServerSecret.from_seed) |" in printed
    data = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert [r["noise"] for r in data["results"]] == ["known", "none"]
    assert data["results"][1]["epsilon_rdp"] is None  # no noise: no finite epsilon
    csv_lines = (tmp_path / "out" / "audit.csv").read_text().splitlines()
    assert csv_lines[0].startswith("setting,epsilon_rdp") and len(csv_lines) == 3
    doc = (tmp_path / "privacy_audit.md").read_text()
    assert "python tools/privacy_audit.py --dim=1000" in doc
    assert "figures/privacy_audit.png" in doc and (tmp_path / "figures").is_dir()
    for row in data["results"]:
        assert f"**{row['bound']:.2f}**" in doc


def test_bad_flags_stop_with_a_usage_error() -> None:
    for argv in (["--settings=secret,bogus"], ["--noise-multipliers", "0"], ["--rate=0"],
                 ["--canaries=10", "--guesses", "8:4"], ["--guesses", "x"]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            pa.parse(argv)
        assert e.value.code == 2
