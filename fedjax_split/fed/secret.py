"""The server's secret randomness: client-level DP's noise and its Poisson client sample.

DP's guarantee holds only if nobody but the server can predict the noise it adds. Before, the
noise came from the run's seed (written to config.json, sent to every Flower node), so anyone
holding the seed could regenerate it and subtract it. Here a run's server draws 256 bits from the
operating system (`secrets.token_bytes`) once, at the start of the run, and keeps them: in its
checkpoints (so that `--resume` after a crash continues with the same noise, exactly) and nowhere
else: never in config.json, metrics, logs or a message to a node.

Each round's randomness is derived from that secret with HMAC-SHA256, the standard
pseudo-random function (Python's `hmac`, no primitive of our own), under a purpose label:
- the noise key: 128 bits of HMAC(secret, "noise" | round) as a JAX key of the "rbg"
  implementation (four 32-bit words, all four feeding XLA's random bit generator; the default
  threefry key has 64 bits), from which `fed.privacy` draws the updates' and the count's noise;
- the Poisson sample: client i takes part in round r when HMAC(secret, "sample" | r | i), read
  as a 53-bit fraction, is below the sampling rate.

JAX's generators are not cryptographically secure: what the secret buys is that the noise is a
function of 128 unknown bits, not of a seed anyone can read (docs/privacy.md: "What the noise's
secrecy rests on").

`ServerSecret.from_seed` derives the secret from the seed instead: the explicit opt-out
(`--dp-insecure-reproducible-noise`) for tests and studies that need the same noise twice, under
which no privacy guarantee holds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

import jax
import jax.numpy as jnp
import numpy as np

SECRET_BYTES = 32  # 256 bits of OS entropy
NOISE_IMPL = "rbg"  # a JAX key of 4 x 32 bits (threefry's has 2)
CHECKPOINT_KEY = "dp_secret"  # the secret's name among a server checkpoint's arrays
_INSECURE_LABEL = b"fedjax_split: DP noise from the seed (insecure, reproducible)"


class ServerSecret:
    """The server's secret for a run's DP randomness (the module docstring). Its repr never shows
    the secret, so that a log line or a traceback cannot leak it."""

    __slots__ = ("_key", "reproducible")

    def __init__(self, key: bytes, reproducible: bool = False) -> None:
        if not isinstance(key, bytes) or len(key) != SECRET_BYTES:
            raise ValueError(f"a server secret is {SECRET_BYTES} bytes")
        self._key = key
        self.reproducible = reproducible  # derived from the seed: no guarantee

    @classmethod
    def fresh(cls) -> ServerSecret:
        """A new secret from the operating system's entropy."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_seed(cls, seed: int) -> ServerSecret:
        """The opt-out: a secret anyone who knows `seed` can compute (no privacy)."""
        data = _INSECURE_LABEL + int(seed).to_bytes(16, "big", signed=True)
        return cls(hashlib.sha256(data).digest(), reproducible=True)

    @classmethod
    def for_run(cls, seed: int, reproducible: bool) -> ServerSecret:
        """A run's secret: fresh, or with the opt-out derived from the seed."""
        return cls.from_seed(seed) if reproducible else cls.fresh()

    def __repr__(self) -> str:
        return f"ServerSecret(<hidden>, reproducible={self.reproducible})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ServerSecret) and hmac.compare_digest(self._key, other._key)
                and self.reproducible == other.reproducible)  # fmt: skip

    def __hash__(self) -> int:
        return hash((type(self), self.reproducible))

    def _prf(self, purpose: bytes, *numbers: int) -> bytes:
        message = purpose + b"".join(struct.pack(">q", int(n)) for n in numbers)
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def noise_key(self, round_: int) -> jax.Array:
        """Round `round_`'s key for the server's DP noise (a typed JAX key, impl "rbg")."""
        words = np.frombuffer(self._prf(b"noise", round_)[:16], dtype=">u4").astype(np.uint32)
        return jax.random.wrap_key_data(jnp.asarray(words), impl=NOISE_IMPL)

    def poisson_sample(self, num_clients: int, rate: float, round_: int) -> np.ndarray:
        """Sorted ids of round `round_`'s clients, each independently with probability `rate`."""
        fractions = np.asarray(
            [int.from_bytes(self._prf(b"sample", round_, i)[:8], "big") >> 11
             for i in range(num_clients)], np.float64,
        ) / 2.0**53  # fmt: skip
        return np.flatnonzero(fractions < rate).astype(np.int32)

    def to_array(self) -> np.ndarray:
        """The secret as a checkpoint holds it: its bytes, then 1 if reproducible (uint8[33])."""
        return np.frombuffer(self._key + bytes([int(self.reproducible)]), np.uint8).copy()

    @classmethod
    def from_array(cls, array: np.ndarray) -> ServerSecret:
        data = np.asarray(array, np.uint8).tobytes()
        if len(data) != SECRET_BYTES + 1 or data[-1] not in (0, 1):
            raise ValueError("not a server secret")
        return cls(data[:-1], reproducible=bool(data[-1]))

    @staticmethod
    def array_like() -> np.ndarray:
        """The shape and dtype `to_array` gives (a checkpoint's restore target)."""
        return np.zeros([SECRET_BYTES + 1], np.uint8)


def no_noise_key() -> jax.Array:
    """A key for the aggregation of a run without DP noise, which never draws from it."""
    return jax.random.wrap_key_data(jnp.zeros([4], jnp.uint32), impl=NOISE_IMPL)
