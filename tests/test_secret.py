"""Tests for fed/secret.py: the server's secret for DP's noise and sample. Expected values are
derived here from the definitions (HMAC-SHA256 from Python's hmac, JAX's key data)."""

from __future__ import annotations

import hashlib
import hmac
import struct

import jax
import numpy as np
import pytest

from fedjax_split.fed.secret import SECRET_BYTES, ServerSecret, no_noise_key

KEY = bytes(range(7, 7 + SECRET_BYTES))


def test_a_fresh_secret_is_os_entropy_and_never_shown() -> None:
    a, b = ServerSecret.fresh(), ServerSecret.fresh()
    assert a != b and not a.reproducible
    for s in (a, ServerSecret(KEY)):
        raw = s.to_array()[:-1].tobytes()
        assert raw.hex() not in repr(s) and raw.hex() not in str(s) and "<hidden>" in repr(s)


def test_the_noise_key_is_128_bits_of_hmac_sha256() -> None:
    secret = ServerSecret(KEY)
    for r in (1, 2, 77):
        want = hmac.new(KEY, b"noise" + struct.pack(">q", r), hashlib.sha256).digest()[:16]
        data = np.asarray(jax.random.key_data(secret.noise_key(r)), np.uint32)
        assert data.shape == (4,) and data.astype(">u4").tobytes() == want
    # every one of the four words changes the noise (an rbg key uses all 128 bits)
    base = np.asarray(jax.random.key_data(secret.noise_key(1)), np.uint32)
    draw = lambda d: np.asarray(jax.random.normal(  # noqa: E731
        jax.random.wrap_key_data(d, impl="rbg"), (8,)))
    for i in range(4):
        other = base.copy()
        other[i] ^= 1
        assert not np.array_equal(draw(other), draw(base))


def test_rounds_and_purposes_draw_apart() -> None:
    secret = ServerSecret(KEY)
    keys = {np.asarray(jax.random.key_data(secret.noise_key(r))).tobytes() for r in range(50)}
    assert len(keys) == 50
    other = ServerSecret(bytes(SECRET_BYTES))
    assert not np.array_equal(jax.random.key_data(other.noise_key(1)),
                              jax.random.key_data(secret.noise_key(1)))  # fmt: skip


def test_the_opt_out_follows_the_seed_and_says_so() -> None:
    a, b, c = ServerSecret.from_seed(3), ServerSecret.from_seed(3), ServerSecret.from_seed(4)
    assert a.reproducible and a == b and a != c
    assert ServerSecret.for_run(3, True) == a and ServerSecret.for_run(3, False) != a
    label = b"fedjax_split: DP noise from the seed (insecure, reproducible)"
    want = hashlib.sha256(label + (3).to_bytes(16, "big", signed=True)).digest()
    assert a.to_array()[:-1].tobytes() == want and a.to_array()[-1] == 1


def test_a_checkpoint_round_trip_and_bad_arrays() -> None:
    for s in (ServerSecret.fresh(), ServerSecret.from_seed(0)):
        back = ServerSecret.from_array(s.to_array())
        assert back == s and back.reproducible == s.reproducible
        assert s.to_array().shape == ServerSecret.array_like().shape
    for bad in (np.zeros(5, np.uint8), np.full(SECRET_BYTES + 1, 2, np.uint8)):
        with pytest.raises(ValueError, match="not a server secret"):
            ServerSecret.from_array(bad)
    with pytest.raises(ValueError):
        ServerSecret(b"short")


def test_the_no_noise_key_is_a_fixed_rbg_key() -> None:
    np.testing.assert_array_equal(jax.random.key_data(no_noise_key()), np.zeros(4, np.uint32))
