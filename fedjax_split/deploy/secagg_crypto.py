"""The primitives of secure aggregation (`deploy.secagg`): key agreement, Shamir shares and the
masks, wrapping flwr's secure-aggregation code and the `cryptography` package (no crypto of our
own).

Masks are expanded with ChaCha20 (the `cryptography` package) under a key from HKDF-SHA256 of
the seed or the ECDH key, 64-bit words: uniform modulo 2^64 with no modulo bias. Not flwr's
`secaggplus_utils.pseudo_rand_gen`, which folds the seed into 32 bits for numpy's MT19937, a
non-cryptographic generator (docs/deployment.md). Key agreement, encryption, Shamir shares and
key serialisation are flwr's (`flwr.common.secure_aggregation`, `flwr.supercore.primitives`).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import bytes_to_public_key

from fedjax_split.deploy.secagg import Params

SEED_BYTES = 32  # b, the self-mask seed
KEY_BYTES = 48  # a P-384 private scalar, what is shared of the masking key
CURVE = ec.SECP384R1()
_SELF = b"fedjax_split secagg self mask"
_PAIR = b"fedjax_split secagg pairwise mask"
_MAX_TRIES = 256  # combinations of t shares tried when a reconstruction fails its check


def _share_len(secret: int) -> int:
    """flwr's Shamir share: a 4-byte index, then 16 bytes a chunk of the PKCS#7-padded secret."""
    return 4 + 16 * (secret // 16 + 1)


def _token_len(plaintext: int) -> int:
    """A Fernet token's length: base64 of version, time, IV, padded ciphertext and HMAC."""
    return 4 * math.ceil((57 + 16 * (plaintext // 16 + 1)) / 3)


SEED_SHARE = _share_len(SEED_BYTES)
KEY_SHARE = _share_len(KEY_BYTES)
TOKEN = _token_len(20 + SEED_SHARE + KEY_SHARE)  # share_keys_plaintext_concat's layout


def stream(key: bytes, label: bytes, rnd: int, length: int) -> np.ndarray:
    """`length` uniform 64-bit words: ChaCha20's keystream under HKDF-SHA256(key, label | round).
    Each key is used for one stream, so the all-zero nonce is safe."""
    info = label + rnd.to_bytes(8, "little")
    stream_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)
    encryptor = Cipher(algorithms.ChaCha20(stream_key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype="<u8").astype(np.uint64)


def pair_key(private: ec.EllipticCurvePrivateKey, public: bytes) -> bytes:
    """The 32-byte key two nodes agree on (ECDH + HKDF-SHA256, flwr's `generate_shared_key`)."""
    return base64.urlsafe_b64decode(generate_shared_key(private, bytes_to_public_key(public)))


def pair_mask(u: int, v: int, key: bytes, params: Params) -> tuple[np.ndarray, bool]:
    """The mask u and v share, and whether u adds it (u < v) or subtracts it."""
    return stream(key, _PAIR, params.round, params.length), u < v


def self_mask(seed: bytes, params: Params) -> np.ndarray:
    """A node's self mask PRG(b) for the round."""
    return stream(seed, _SELF, params.round, params.length)


def public_key(pem: bytes) -> ec.EllipticCurvePublicKey:
    """The P-384 public key a PEM advertises (ValueError if it is not one)."""
    key = bytes_to_public_key(pem)
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != CURVE.name:
        raise ValueError("not a P-384 public key")
    return key


def scalar(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as the bytes its Shamir shares share."""
    return key.private_numbers().private_value.to_bytes(KEY_BYTES, "big")


def key_from_scalar(secret: bytes) -> ec.EllipticCurvePrivateKey:
    """The private key a rebuilt scalar is (ValueError if it is none)."""
    return ec.derive_private_key(int.from_bytes(secret, "big"), CURVE)


def digest(seed: bytes) -> bytes:
    """SHA-256 of a seed: what its advertisement shows of it."""
    return hashlib.sha256(seed).digest()


def share_index(share: bytes) -> int:
    """A Shamir share's index (its node's place in the key table, from 1)."""
    return int.from_bytes(share[:4], "little")


def _combine(shares: Sequence[tuple[int, bytes]]) -> bytes | None:
    try:
        return combine_shares([s for _, s in shares])
    except ValueError:
        return None


def reconstruct(
    shares: list[tuple[int, bytes]], t: int, check: Callable[[bytes], bool]
) -> tuple[bytes | None, list[int]]:
    """A secret from exactly t shares (pycryptodome's Shamir takes no more), checked against its
    advertisement; if the first t fail, other sets of t are tried (at most `_MAX_TRIES`).
    Returns the secret (None if no set passes) and, when the first t failed, the responders
    whose share, put in a passing set, breaks it (a bad share never used does no harm)."""

    def passes(subset: Sequence[tuple[int, bytes]]) -> bool:
        secret = _combine(subset)
        return secret is not None and check(secret)

    if passes(shares[:t]):
        return _combine(shares[:t]), []
    for subset in itertools.islice(itertools.combinations(shares, t), _MAX_TRIES):
        if passes(subset):
            rest = [(r, s) for r, s in shares if (r, s) not in subset]
            bad = [r for r, s in rest if not passes((*subset[1:], (r, s)))]
            return _combine(subset), bad
    return None, []
