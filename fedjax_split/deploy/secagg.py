"""Secure aggregation (SecAgg+, Bell et al. 2020) as pure stages: the server learns only the sum.

The stages of Bell et al.'s semi-honest protocol, on the complete graph (every node is every
other's neighbour: the original SecAgg of Bonawitz et al. 2017; SecAgg+'s sparse neighbourhood
graph only pays off with thousands of nodes). Each stage is a function of a frozen state and of
messages as flat dicts of ints, bytes and lists of them (a masked vector is a uint64 array), so
that a transport only carries them:

1. `node_setup`: two P-384 key pairs (one to encrypt shares, one for the pairwise masks) and a
   32-byte self-mask seed b, all from OS entropy; the advertisement carries the public keys and
   SHA-256(b), so that the server can check b when it reconstructs it.
2. `server_keys` collects the advertisements (U1) and broadcasts them.
3. `node_share_keys`: Shamir shares (threshold t) of b and of the masking private key, one per
   node of U1, each encrypted to its node with Fernet under an ECDH + HKDF key.
4. `server_route` hands each node of U2 (those whose shares came) the ciphertexts sent to it.
5. `node_masked_input`: y = x + PRG(b) + sum_v (+/-) PRG(s_uv) mod 2^64, + when u < v, where
   s_uv is u and v's ECDH key; `server_add_masked` adds each y to a running sum (U3).
6. `node_unmask`: a node of U3 reveals its shares of b for the survivors (U3) and of the masking
   key for the dropped (U2 - U3), never both for one node; `server_unmask` reconstructs from t
   shares, checks each secret against its advertisement, and removes the masks from the sum.

Masks are expanded with ChaCha20 (the `cryptography` package) under a key from HKDF-SHA256 of
the seed or the ECDH key, 64-bit words: uniform modulo 2^64 with no modulo bias. Not flwr's
`secaggplus_utils.pseudo_rand_gen`, which folds the seed into 32 bits for numpy's MT19937, a
non-cryptographic generator (docs/deployment.md). Key agreement, encryption, Shamir shares and
key serialisation are flwr's (`flwr.common.secure_aggregation`, `flwr.supercore.primitives`).

Anything malformed a node sends raises `Refused` naming it; the server records it and leaves
the node out (as dropped). Below the threshold the round raises `RoundLost`, one line.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import bytes_to_public_key, public_key_to_bytes

from fedjax_split.errors import UserError

Message = dict[str, Any]
SEED_BYTES = 32  # b, the self-mask seed
KEY_BYTES = 48  # a P-384 private scalar, what is shared of the masking key
_CURVE = ec.SECP384R1()
_SELF = b"fedjax_split secagg self mask"
_PAIR = b"fedjax_split secagg pairwise mask"
_MAX_TRIES = 256  # combinations of t shares tried when a reconstruction fails its check


def _share_len(secret: int) -> int:
    """flwr's Shamir share: a 4-byte index, then 16 bytes a chunk of the PKCS#7-padded secret."""
    return 4 + 16 * (secret // 16 + 1)


def _token_len(plaintext: int) -> int:
    """A Fernet token's length: base64 of version, time, IV, padded ciphertext and HMAC."""
    return 4 * math.ceil((57 + 16 * (plaintext // 16 + 1)) / 3)


_SEED_SHARE = _share_len(SEED_BYTES)
_KEY_SHARE = _share_len(KEY_BYTES)
_TOKEN = _token_len(20 + _SEED_SHARE + _KEY_SHARE)  # share_keys_plaintext_concat's layout


class Refused(ValueError):
    """A node's message failed validation: the server (or a peer) leaves that node out."""

    def __init__(self, node: int, what: str) -> None:
        self.node = node
        super().__init__(f"secure aggregation: node {node} refused: {what}")


class UnsafeRequest(ValueError):
    """A node refuses what the server asks (both shares of one peer, a second answer, ...)."""


class RoundLost(UserError):
    """Fewer than the threshold of nodes left: the round's sum cannot be recovered."""


@dataclasses.dataclass(frozen=True)
class Params:
    """One round's settings, the same at every node: the sampled nodes, t, the vector's length."""

    round: int
    nodes: tuple[int, ...]
    threshold: int
    length: int

    def __post_init__(self) -> None:
        nodes = tuple(sorted(int(v) for v in self.nodes))
        n, t = len(nodes), self.threshold
        if len(set(nodes)) != n or any(not 0 <= v < 2**64 for v in nodes):
            raise UserError(f"secure aggregation needs distinct node ids, got {list(self.nodes)}")
        if n < 2 or not (isinstance(t, int) and n // 2 < t <= n and t >= 2):
            raise UserError(
                f"the secure-aggregation threshold must be an integer above half the {n} nodes "
                f"and at most {n} (and at least 2), got {t}"
            )
        if not (isinstance(self.length, int) and self.length >= 1):
            raise UserError(f"a masked vector needs at least one entry, got {self.length}")
        object.__setattr__(self, "nodes", nodes)

    def as_message(self) -> Message:
        return {
            "round": self.round,
            "nodes": list(self.nodes),
            "threshold": self.threshold,
            "length": self.length,
        }

    @classmethod
    def from_message(cls, msg: Message) -> Params:
        return cls(
            int(msg["round"]), tuple(msg["nodes"]), int(msg["threshold"]), int(msg["length"])
        )


@dataclasses.dataclass(frozen=True)
class Advert:
    """A node's public keys (PEM) and the digest of its self-mask seed."""

    enc_key: bytes
    mask_key: bytes
    seed_digest: bytes


# ---- the primitives' use ----


def _stream(key: bytes, label: bytes, rnd: int, length: int) -> np.ndarray:
    """`length` uniform 64-bit words: ChaCha20's keystream under HKDF-SHA256(key, label | round).
    Each key is used for one stream, so the all-zero nonce is safe."""
    info = label + rnd.to_bytes(8, "little")
    stream_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)
    encryptor = Cipher(algorithms.ChaCha20(stream_key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype="<u8").astype(np.uint64)


def _pair_key(private: ec.EllipticCurvePrivateKey, public: bytes) -> bytes:
    """The 32-byte key two nodes agree on (ECDH + HKDF-SHA256, flwr's `generate_shared_key`)."""
    return base64.urlsafe_b64decode(generate_shared_key(private, bytes_to_public_key(public)))


def _pair_mask(u: int, v: int, key: bytes, params: Params) -> tuple[np.ndarray, bool]:
    """The mask u and v share, and whether u adds it (u < v) or subtracts it."""
    return _stream(key, _PAIR, params.round, params.length), u < v


def _public_key(pem: bytes) -> ec.EllipticCurvePublicKey:
    key = bytes_to_public_key(pem)
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != _CURVE.name:
        raise ValueError("not a P-384 public key")
    return key


def _scalar(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_numbers().private_value.to_bytes(KEY_BYTES, "big")


def _key_from_scalar(secret: bytes) -> ec.EllipticCurvePrivateKey:
    return ec.derive_private_key(int.from_bytes(secret, "big"), _CURVE)


def _digest(seed: bytes) -> bytes:
    return hashlib.sha256(seed).digest()


def _share_index(share: bytes) -> int:
    return int.from_bytes(share[:4], "little")


def _ints(msg: Message, name: str, node: int) -> list[int]:
    value = msg.get(name)
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise Refused(node, f"{name!r} is not a list of node ids")
    return value


def _blobs(msg: Message, name: str, node: int, size: int, count: int) -> list[bytes]:
    value = msg.get(name)
    if not isinstance(value, list) or len(value) != count:
        raise Refused(node, f"{name!r} is not a list of {count} byte strings")
    if not all(isinstance(b, bytes) and len(b) == size for b in value):
        raise Refused(node, f"{name!r} holds an entry that is not {size} bytes")
    return value


# ---- a node ----


@dataclasses.dataclass(frozen=True)
class NodeState:
    """One node's round. Its secrets never show in a repr (a log line or a traceback)."""

    params: Params
    node: int
    enc_key: ec.EllipticCurvePrivateKey = dataclasses.field(repr=False)
    mask_key: ec.EllipticCurvePrivateKey = dataclasses.field(repr=False)
    seed: bytes = dataclasses.field(repr=False)
    table: Mapping[int, Advert] = dataclasses.field(default_factory=dict, repr=False)  # U1
    seed_shares: Mapping[int, bytes] = dataclasses.field(default_factory=dict, repr=False)
    key_shares: Mapping[int, bytes] = dataclasses.field(default_factory=dict, repr=False)
    peers: tuple[int, ...] = ()  # U2 without this node: the nodes it masked with
    answered: bool = False  # it has revealed its shares once this round


def node_setup(params: Params, node: int) -> tuple[NodeState, Message]:
    """Stage 1: fresh keys and seed (OS entropy), and the advertisement to send."""
    if node not in params.nodes:
        raise UnsafeRequest(f"node {node} is not among this round's nodes")
    enc_key = ec.generate_private_key(_CURVE)
    mask_key = ec.generate_private_key(_CURVE)
    seed = os.urandom(SEED_BYTES)
    state = NodeState(params, node, enc_key, mask_key, seed)
    advert = {
        "node": node,
        "enc_key": public_key_to_bytes(enc_key.public_key()),
        "mask_key": public_key_to_bytes(mask_key.public_key()),
        "seed_digest": _digest(seed),
    }
    return state, advert


def _table(msg: Message, params: Params) -> dict[int, Advert]:
    """The server's broadcast of U1's advertisements, checked."""
    nodes = msg.get("nodes")
    if (
        not isinstance(nodes, list)
        or nodes != sorted(set(nodes))
        or not set(nodes) <= set(params.nodes)
    ):
        raise UnsafeRequest("the key table's nodes are not a sorted subset of the round's")
    if len(nodes) < params.threshold:
        raise UnsafeRequest(f"{len(nodes)} nodes advertised keys, below the threshold")
    fields = [msg.get(k) for k in ("enc_keys", "mask_keys", "seed_digests")]
    if not all(isinstance(f, list) and len(f) == len(nodes) for f in fields):
        raise UnsafeRequest("the key table's lists differ in length")
    table = {v: Advert(e, m, d) for v, e, m, d in zip(nodes, *fields, strict=True)}
    keys = [k for a in table.values() for k in (a.enc_key, a.mask_key)]
    if len(set(keys)) != len(keys):
        raise UnsafeRequest("the key table repeats a public key")
    return table


def node_share_keys(state: NodeState, broadcast: Message) -> tuple[NodeState, Message]:
    """Stage 3: Shamir shares of the seed and of the masking key, one per node of U1 (in node
    order, share i at index i + 1), each encrypted to its node."""
    table = _table(broadcast, state.params)
    mine = table.get(state.node)
    if mine != Advert(
        public_key_to_bytes(state.enc_key.public_key()),
        public_key_to_bytes(state.mask_key.public_key()),
        _digest(state.seed),
    ):
        raise UnsafeRequest(f"the key table leaves node {state.node} out or shows its keys wrongly")
    t, n = state.params.threshold, len(table)
    seed_shares = create_shares(state.seed, t, n)
    key_shares = create_shares(_scalar(state.mask_key), t, n)
    me = list(table).index(state.node)
    to, ciphertexts = [], []
    for i, (v, advert) in enumerate(table.items()):
        if v == state.node:
            continue
        key = generate_shared_key(state.enc_key, _public_key(advert.enc_key))
        plain = share_keys_plaintext_concat(state.node, v, seed_shares[i], key_shares[i])
        to.append(v)
        ciphertexts.append(encrypt(key, plain))
    state = dataclasses.replace(
        state,
        table=table,
        seed_shares={state.node: seed_shares[me]},
        key_shares={state.node: key_shares[me]},
    )
    return state, {"node": state.node, "to": to, "ciphertexts": ciphertexts}


def _open_share(state: NodeState, src: int, token: bytes) -> tuple[bytes, bytes]:
    """The shares `src` sent this node, checked: sender, recipient, lengths, Shamir index."""
    if src not in state.table or src == state.node:
        raise Refused(src, "a share from a node outside the key table")
    key = generate_shared_key(state.enc_key, _public_key(state.table[src].enc_key))
    try:
        plain = decrypt(key, token)
    except (InvalidToken, TypeError, ValueError):
        raise Refused(src, "a share that does not decrypt") from None
    sender, recipient, seed_share, key_share = share_keys_plaintext_separate(plain)
    index = list(state.table).index(state.node) + 1
    if (sender, recipient) != (src, state.node):
        raise Refused(src, f"a share addressed from {sender} to {recipient}")
    if len(seed_share) != _SEED_SHARE or len(key_share) != _KEY_SHARE:
        raise Refused(src, "a share of the wrong length")
    if _share_index(seed_share) != index or _share_index(key_share) != index:
        raise Refused(src, f"a share with another Shamir index than {index}")
    return seed_share, key_share


def node_masked_input(
    state: NodeState, inbox: Message, vector: np.ndarray
) -> tuple[NodeState, Message]:
    """Stage 5: the other nodes' shares kept, and y = x + PRG(b) + sum_v (+/-) PRG(s_uv) mod 2^64
    over the nodes that sent shares. A bad share raises `Refused` naming its sender: this node
    then sends nothing this round (the server counts it as dropped)."""
    params = state.params
    x = np.asarray(vector)
    if x.dtype != np.uint64 or x.shape != (params.length,):
        raise ValueError(
            f"the masked input must be uint64 of shape ({params.length},), got "
            f"{x.dtype} of shape {x.shape}"
        )
    sources = _ints(inbox, "from", state.node)
    tokens = inbox.get("ciphertexts")
    if (
        not isinstance(tokens, list)
        or len(tokens) != len(sources)
        or len(set(sources)) != len(sources)
    ):
        raise UnsafeRequest("the inbox's senders and ciphertexts do not match")
    if len(sources) + 1 < params.threshold:
        raise UnsafeRequest(f"{len(sources) + 1} nodes shared keys, below the threshold")
    seed_shares, key_shares = dict(state.seed_shares), dict(state.key_shares)
    for src, token in zip(sources, tokens, strict=True):
        seed_shares[src], key_shares[src] = _open_share(state, src, token)
    masked = np.add(x, _stream(state.seed, _SELF, params.round, params.length), dtype=np.uint64)
    for v in sources:
        mask, adds = _pair_mask(
            state.node, v, _pair_key(state.mask_key, state.table[v].mask_key), params
        )
        masked = (np.add if adds else np.subtract)(masked, mask, dtype=np.uint64)
    state = dataclasses.replace(
        state, seed_shares=seed_shares, key_shares=key_shares, peers=tuple(sorted(sources))
    )
    return state, {"node": state.node, "masked": masked}


def node_unmask(state: NodeState, request: Message) -> tuple[NodeState, Message]:
    """Stage 6: shares of the seed of every survivor and of the masking key of every dropped
    node, once a round. Refuses a request that asks both of one node, leaves a node of U2 out,
    names one outside it, or has fewer survivors than the threshold."""
    survivors, dropped = (_ints(request, k, state.node) for k in ("survivors", "dropped"))
    both = set(survivors) & set(dropped)
    if both:
        raise UnsafeRequest(f"asked for both shares of node {min(both)}: refused")
    if state.answered:
        raise UnsafeRequest("this round's shares were revealed already")
    if sorted(survivors + dropped) != sorted((*state.peers, state.node)):
        raise UnsafeRequest("survivors and dropped are not the nodes that shared keys")
    if state.node not in survivors or len(survivors) < state.params.threshold:
        raise UnsafeRequest(f"{len(survivors)} survivors, below the threshold")
    response = {
        "node": state.node,
        "seed_of": sorted(survivors),
        "key_of": sorted(dropped),
        "seed_shares": [state.seed_shares[v] for v in sorted(survivors)],
        "key_shares": [state.key_shares[v] for v in sorted(dropped)],
    }
    return dataclasses.replace(state, answered=True), response


# ---- the server ----


@dataclasses.dataclass(frozen=True)
class ServerRound:
    """What the server holds of a round: public keys, who is where, and one running sum of the
    masked vectors; never a node's vector on its own, masked or not."""

    params: Params
    table: Mapping[int, Advert] = dataclasses.field(default_factory=dict)  # U1
    shared: tuple[int, ...] = ()  # U2: the nodes whose shares were routed
    masked_sum: np.ndarray | None = None  # sum of the accepted masked vectors, mod 2^64
    contributed: tuple[int, ...] = ()  # U3: the nodes whose masked vector is in the sum
    refused: Mapping[int, str] = dataclasses.field(default_factory=dict)  # node -> why

    def _refuse(self, error: Refused) -> ServerRound:
        """The round with `error` recorded (a node's first refusal is the one kept)."""
        return dataclasses.replace(self, refused={error.node: str(error), **self.refused})

    def _lost(self, have: int, what: str) -> RoundLost:
        return RoundLost(
            f"secure aggregation round {self.params.round} cannot be recovered: {have} of "
            f"{len(self.params.nodes)} nodes {what}, the threshold is {self.params.threshold}; "
            f"the run stops (--resume runs the round again, with new keys)"
        )


class Aggregate(NamedTuple):
    total: np.ndarray  # sum of the survivors' inputs mod 2^64 (uint64)
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]  # shared keys, sent no (valid) masked vector
    refused: Mapping[int, str]


def _node_of(msg: Any, nodes: Sequence[int], seen: Sequence[int]) -> int:
    node = msg.get("node") if isinstance(msg, dict) else None
    if type(node) is not int or node not in nodes:
        raise Refused(-1 if type(node) is not int else node, "a message from outside the round")
    if node in seen:
        raise Refused(node, "a second message this stage")
    return node


def server_keys(params: Params, adverts: Sequence[Message]) -> tuple[ServerRound, Message]:
    """Stage 2: the valid advertisements (U1), broadcast to every node of U1."""
    rnd, table, keys = ServerRound(params), {}, set()
    for msg in adverts:
        try:
            node = _node_of(msg, params.nodes, [*table, *rnd.refused])
            advert = Advert(msg.get("enc_key"), msg.get("mask_key"), msg.get("seed_digest"))
            try:
                for pem in (advert.enc_key, advert.mask_key):
                    _public_key(pem)
            except (TypeError, ValueError, UnsupportedAlgorithm):
                raise Refused(node, "an advertised key that is not a P-384 public key") from None
            if not isinstance(advert.seed_digest, bytes) or len(advert.seed_digest) != 32:
                raise Refused(node, "a seed digest that is not 32 bytes")
            if {advert.enc_key, advert.mask_key} & keys or advert.enc_key == advert.mask_key:
                raise Refused(node, "a public key advertised already")
            table[node], keys = advert, keys | {advert.enc_key, advert.mask_key}
        except Refused as error:  # a node refused once is out, its first advertisement too
            rnd, _ = rnd._refuse(error), table.pop(error.node, None)
    if len(table) < params.threshold:
        raise rnd._lost(len(table), "advertised keys")
    table = dict(sorted(table.items()))
    broadcast = {
        "nodes": list(table),
        "enc_keys": [a.enc_key for a in table.values()],
        "mask_keys": [a.mask_key for a in table.values()],
        "seed_digests": [a.seed_digest for a in table.values()],
    }
    return dataclasses.replace(rnd, table=table), broadcast


def server_route(
    rnd: ServerRound, messages: Sequence[Message]
) -> tuple[ServerRound, dict[int, Message]]:
    """Stage 4: each node of U2 gets the ciphertexts the others of U2 sent it. The server keeps
    none of them (it could not read them anyway)."""
    sent: dict[int, dict[int, bytes]] = {}
    for msg in messages:
        try:
            node = _node_of(msg, list(rnd.table), [*sent, *rnd.refused])
            expected = [v for v in rnd.table if v != node]
            if _ints(msg, "to", node) != expected:
                raise Refused(node, "shares not addressed to every other node of the key table")
            tokens = _blobs(msg, "ciphertexts", node, _TOKEN, len(expected))
            sent[node] = dict(zip(expected, tokens, strict=True))
        except Refused as error:
            rnd, _ = rnd._refuse(error), sent.pop(error.node, None)
    if len(sent) < rnd.params.threshold:
        raise rnd._lost(len(sent), "shared their keys")
    shared = tuple(sorted(sent))
    inboxes = {
        v: {
            "from": [u for u in shared if u != v],
            "ciphertexts": [sent[u][v] for u in shared if u != v],
        }
        for v in shared
    }
    return dataclasses.replace(rnd, shared=shared), inboxes


def server_add_masked(rnd: ServerRound, msg: Message) -> ServerRound:
    """Stage 5, one upload at a time: a valid masked vector joins the running sum (U3); a
    malformed one is refused and recorded, and its node counts as dropped."""
    try:
        refused_here = [v for v in rnd.refused if v in rnd.shared]
        node = _node_of(msg, rnd.shared, (*rnd.contributed, *refused_here))
        y = msg.get("masked")
        if not isinstance(y, np.ndarray) or y.dtype != np.uint64 or y.shape != (rnd.params.length,):
            what = (
                f"{y.dtype} of shape {y.shape}" if isinstance(y, np.ndarray) else type(y).__name__
            )
            raise Refused(
                node, f"a masked vector of {what}, not uint64 of shape ({rnd.params.length},)"
            )
    except Refused as error:
        return rnd._refuse(error)
    total = y.copy() if rnd.masked_sum is None else np.add(rnd.masked_sum, y, dtype=np.uint64)
    return dataclasses.replace(rnd, masked_sum=total, contributed=(*rnd.contributed, node))


def unmask_request(rnd: ServerRound) -> Message:
    """Stage 6's request to every survivor: who survived (U3) and who dropped (U2 - U3)."""
    if len(rnd.contributed) < rnd.params.threshold:
        raise rnd._lost(len(rnd.contributed), "sent a valid masked vector")
    survivors = sorted(rnd.contributed)
    return {"survivors": survivors, "dropped": [v for v in rnd.shared if v not in survivors]}


def _shares_of(
    rnd: ServerRound, responses: Sequence[Message], request: Message
) -> tuple[ServerRound, dict[int, list[tuple[int, bytes]]], dict[int, list[tuple[int, bytes]]]]:
    """The valid responses' shares, by the node whose secret they share: (responder, share)."""
    seeds: dict[int, list[tuple[int, bytes]]] = {v: [] for v in request["survivors"]}
    keys: dict[int, list[tuple[int, bytes]]] = {v: [] for v in request["dropped"]}
    index = {v: i + 1 for i, v in enumerate(rnd.table)}
    answered: list[int] = []
    for msg in responses:
        try:
            node = _node_of(msg, request["survivors"], answered)
            answered.append(node)
            if (_ints(msg, "seed_of", node), _ints(msg, "key_of", node)) != (
                request["survivors"],
                request["dropped"],
            ):
                raise Refused(node, "shares of other nodes than the server asked for")
            got = (
                _blobs(msg, "seed_shares", node, _SEED_SHARE, len(seeds)),
                _blobs(msg, "key_shares", node, _KEY_SHARE, len(keys)),
            )
            if any(_share_index(b) != index[node] for b in got[0] + got[1]):
                raise Refused(node, f"a share with another Shamir index than {index[node]}")
        except Refused as error:
            rnd = rnd._refuse(error)
            continue
        for held, blobs in zip((seeds, keys), got, strict=True):
            for v, share in zip(held, blobs, strict=True):
                held[v].append((node, share))
    return rnd, seeds, keys


def _combine(shares: Sequence[tuple[int, bytes]]) -> bytes | None:
    try:
        return combine_shares([s for _, s in shares])
    except ValueError:
        return None


def _reconstruct(
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


def _seed_check(advert: Advert) -> Callable[[bytes], bool]:
    return lambda seed: _digest(seed) == advert.seed_digest


def _key_check(advert: Advert) -> Callable[[bytes], bool]:
    """Whether a rebuilt masking key is the one whose public half the node advertised."""

    def check(secret: bytes) -> bool:
        try:
            public = _key_from_scalar(secret).public_key()
        except ValueError:
            return False
        return len(secret) == KEY_BYTES and public_key_to_bytes(public) == advert.mask_key

    return check


def _secrets(
    rnd: ServerRound, seeds: Mapping[int, list], keys: Mapping[int, list]
) -> tuple[ServerRound, dict[int, bytes], dict[int, ec.EllipticCurvePrivateKey]]:
    """The survivors' seeds and the dropped nodes' masking keys, each checked; a responder whose
    share broke a reconstruction is recorded as refused."""
    t = rnd.params.threshold
    out: list[dict[int, Any]] = [{}, {}]
    jobs = [(0, v, s, _seed_check(rnd.table[v])) for v, s in seeds.items()]
    jobs += [(1, v, s, _key_check(rnd.table[v])) for v, s in keys.items()]
    for kind, v, shares, check in jobs:
        if len(shares) < t:
            raise rnd._lost(len(shares), f"revealed shares of node {v}'s secret")
        secret, bad = _reconstruct(shares, t, check)
        for r in bad:
            rnd = rnd._refuse(Refused(r, f"a share of node {v}'s secret that does not rebuild it"))
        if secret is None:
            raise RoundLost(
                f"secure aggregation round {rnd.params.round} cannot be recovered: no {t} of the "
                f"{len(shares)} shares of node {v}'s secret rebuild it; the run stops (--resume "
                "runs the round again, with new keys)"
            )
        out[kind][v] = secret if kind == 0 else _key_from_scalar(secret)
    return rnd, out[0], out[1]


def server_unmask(rnd: ServerRound, responses: Sequence[Message]) -> Aggregate:
    """Stage 6: the survivors' sum. From the running sum of masked vectors it removes every
    survivor's self mask and, for each dropped node v and survivor u, the pairwise mask u added
    for v. Only the sum is ever unmasked."""
    request = unmask_request(rnd)
    rnd, seeds, keys = _shares_of(rnd, responses, request)
    rnd, seed_of, key_of = _secrets(rnd, seeds, keys)
    params, total = rnd.params, rnd.masked_sum
    for u in request["survivors"]:
        total = np.subtract(
            total, _stream(seed_of[u], _SELF, params.round, params.length), dtype=np.uint64
        )
    for v in request["dropped"]:
        for u in request["survivors"]:
            mask, u_added = _pair_mask(u, v, _pair_key(key_of[v], rnd.table[u].mask_key), params)
            total = (np.subtract if u_added else np.add)(total, mask, dtype=np.uint64)
    return Aggregate(total, tuple(request["survivors"]), tuple(request["dropped"]), rnd.refused)
