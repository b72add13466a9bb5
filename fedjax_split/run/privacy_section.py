"""The run's privacy section: the server's aggregation rule, client-level DP, secure aggregation
and the attacker a robustness study simulates; the settings' own checks beside them
(`PrivacySettings.check`).

What these settings cannot take together is refused here before anything runs; the rules that
also need other sections (the clients a round for the trimmed mean, secure aggregation and DP's
calibration, the chunk size of secure aggregation) are `run.cross_checks`'. The choices are
copies of `fed.aggregation`'s and `fed.accounting`'s, so that parsing the flags imports no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.run.settings import PRIVACY, Section, as_given, value_of
from fedjax_split.run.settings import setting as _setting
from fedjax_split.run.value_checks import number_above_zero, require

AGGREGATORS = ("mean", "trimmed-mean", "median")  # fed.aggregation.RULES
ACCOUNTANTS = ("rdp", "pld")  # fed.accounting
ATTACKS = ("none", "scale", "sign-flip")
# settings of DP alone: without --dp-noise-multiplier they would be silently ignored
_DP_ONLY = ("dp_clip", "dp_clip_quantile", "dp_max_epsilon", "dp_insecure_reproducible_noise",
            "dp_publish_clients")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PrivacySettings(Section):
    """Privacy and robustness: the server's aggregation rule, client-level DP, secure
    aggregation, and the simulated attacker of the robustness studies."""

    aggregator: str = _setting(
        "mean",
        "How the server combines the clients' updates: mean (example-weighted, FedAvg's), or "
        "coordinate-wise trimmed-mean or median over the clients (unweighted; robust to a few "
        "bad clients).",
        choices=AGGREGATORS,
        group=PRIVACY,
    )
    trim_fraction: float = _setting(
        0.1,
        "--aggregator trimmed-mean: the fraction of clients cut at each end, per coordinate: "
        "floor(fraction x M) of M clients a round, which must be at least 1 (0.1 needs 10).",
        group=PRIVACY,
        metavar="FRACTION",
    )
    max_update_norm: float | None = _setting(
        None, "Clip each client's update of the global part to this L2 norm (no noise).",
        metavar="NORM", group=PRIVACY,
    )  # fmt: skip
    dp_noise_multiplier: float | None = _setting(
        None,
        "Client-level differential privacy: Gaussian noise of this many times --dp-clip on the "
        "sum of the clients' clipped updates of the global part, then a uniform mean (the local "
        "part gets none: it never leaves a client). docs/privacy.md.",
        metavar="Z",
        group=PRIVACY,
    )
    dp_clip: float | None = _setting(
        None, "DP: each client's update of the global part is clipped to this L2 norm.",
        metavar="C", group=PRIVACY,
    )  # fmt: skip
    dp_clip_quantile: float | None = _setting(
        None,
        "DP: adaptive clipping (Andrew et al. 2021): the clip norm follows this quantile of the "
        "clients' update norms, starting at --dp-clip.",
        metavar="Q",
        group=PRIVACY,
    )
    dp_delta: float = _setting(
        1e-5, "DP: the delta of the (epsilon, delta) reported.", group=PRIVACY, metavar="DELTA"
    )
    dp_accountant: str = _setting(
        "rdp",
        "DP: the accountant (Google's dp_accounting): rdp or pld.",
        choices=ACCOUNTANTS,
        group=PRIVACY,
    )
    dp_max_epsilon: float | None = _setting(
        None, "DP: stop before the round that would take epsilon past this budget.",
        metavar="EPS", group=PRIVACY,
    )  # fmt: skip
    dp_insecure_reproducible_noise: bool = _setting(
        False,
        "DP: draw the server's noise and client sample from --seed, not from a secret, so that "
        "a run can be repeated noise for noise (tests, studies). Anyone who knows the seed can "
        "then remove the noise: no privacy guarantee holds, and the run says so.",
        group=PRIVACY,
    )
    dp_publish_clients: bool = _setting(
        False,
        "DP: write each client's figures (sampled clients, update norms, losses, metrics) to "
        "metrics.jsonl and summary.json as without DP; the guarantee does not cover them. By "
        "default they go to the server-private private/clients.jsonl only.",
        group=PRIVACY,
    )
    secure_aggregation: bool = _setting(
        False,
        "Secure aggregation (SecAgg+): the server learns only the sum of the clients' updates, "
        "fixed-point in 64 bits (Flower: masked by the sites; the simulation models the same "
        "sums). Clients are trained one at a time. docs/deployment.md.",
        group=PRIVACY,
    )
    attack: str = _setting(
        "none",
        "A study's attack (simulation only): --attack-fraction of the clients upload their "
        "update scaled by --attack-scale, or sign-flipped.",
        choices=ATTACKS,
        group=PRIVACY,
    )
    attack_fraction: float = _setting(
        0.1, "--attack: the fraction of clients that attack.", group=PRIVACY, metavar="FRACTION"
    )
    attack_scale: float = _setting(
        100.0,
        "--attack scale: the factor on the attackers' updates.",
        group=PRIVACY,
        metavar="FACTOR",
    )

    @property
    def dp(self) -> bool:
        """Whether client-level DP is on."""
        return self.dp_noise_multiplier is not None

    def check(self, config: Any) -> None:
        """Positive norms and scales, the fractions' and --dp-delta's ranges, and the settings
        that go together: secure aggregation's (`_check_secure`), DP's (`_check_dp`)."""
        for name in ("max_update_norm", "dp_clip", "dp_max_epsilon", "attack_scale"):
            number_above_zero(config, name)
        number_above_zero(config, "dp_noise_multiplier", zero_ok=True)
        require(config, "trim_fraction", 0 <= self.trim_fraction < 0.5, "in [0, 0.5)")
        require(config, "dp_delta", 0 < self.dp_delta < 1, "in (0, 1)")
        require(config, "attack_fraction", 0 < self.attack_fraction <= 1, "in (0, 1]")
        if self.secure_aggregation:
            self._check_secure(config)
        self._check_dp(config)

    def _check_secure(self, config: Any) -> None:
        """What cannot work on a sum alone is refused before anything runs."""
        if self.aggregator != "mean":
            raise UserError(
                f"{as_given(config, 'aggregator')} with --secure-aggregation: a robust rule needs "
                "every upload side by side, and secure aggregation shows the server only their "
                "sum; use --aggregator mean (--max-update-norm still bounds each update: the "
                "clients clip their own)"
            )
        if self.attack != "none":
            raise UserError("--attack with --secure-aggregation: the simulated attack edits "
                            "uploads the server can no longer see; drop one of them")  # fmt: skip

    def _check_dp(self, config: Any) -> None:
        """DP's settings only with --dp-noise-multiplier, which needs --dp-clip and the plain
        mean; a budget needs noise."""
        if not self.dp:
            given = [n for n in _DP_ONLY if value_of(config, n) not in (None, False)]
            if given:
                raise UserError(
                    f"{as_given(config, given[0])} needs --dp-noise-multiplier (client-level DP); "
                    "for clipping without noise use --max-update-norm"
                )
            return
        if self.dp_clip is None:
            raise UserError("--dp-noise-multiplier needs --dp-clip C, the clip norm of the updates")
        if self.aggregator != "mean":
            raise UserError(
                f"{as_given(config, 'aggregator')} with DP: the noise is calibrated to a sum of "
                "clipped updates; use --aggregator mean"
            )
        if self.dp_max_epsilon is not None and self.dp_noise_multiplier == 0:
            raise UserError("--dp-max-epsilon with --dp-noise-multiplier 0: no noise, no budget")
