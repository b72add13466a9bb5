"""The server's stages of secure aggregation (`deploy.secagg` has the protocol): it collects and
broadcasts the keys, routes the encrypted shares, adds the masked vectors to one running sum, and
reconstructs from the survivors' shares what removes the masks from that sum. It never holds a
node's vector on its own, masked or not. Pure: `deploy.secure_round` carries the messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.supercore.primitives.asymmetric import public_key_to_bytes

from fedjax_split.deploy.secagg import (
    Advert,
    Message,
    Params,
    Refused,
    RoundLost,
    blobs,
    node_ids,
)
from fedjax_split.deploy.secagg_crypto import (
    KEY_BYTES,
    KEY_SHARE,
    SEED_SHARE,
    TOKEN,
    digest,
    key_from_scalar,
    pair_key,
    pair_mask,
    public_key,
    reconstruct,
    self_mask,
    share_index,
)


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
                    public_key(pem)
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
            if node_ids(msg, "to", node) != expected:
                raise Refused(node, "shares not addressed to every other node of the key table")
            tokens = blobs(msg, "ciphertexts", node, TOKEN, len(expected))
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
            if (node_ids(msg, "seed_of", node), node_ids(msg, "key_of", node)) != (
                request["survivors"],
                request["dropped"],
            ):
                raise Refused(node, "shares of other nodes than the server asked for")
            got = (
                blobs(msg, "seed_shares", node, SEED_SHARE, len(seeds)),
                blobs(msg, "key_shares", node, KEY_SHARE, len(keys)),
            )
            if any(share_index(b) != index[node] for b in got[0] + got[1]):
                raise Refused(node, f"a share with another Shamir index than {index[node]}")
        except Refused as error:
            rnd = rnd._refuse(error)
            continue
        for held, found in zip((seeds, keys), got, strict=True):
            for v, share in zip(held, found, strict=True):
                held[v].append((node, share))
    return rnd, seeds, keys


def _seed_check(advert: Advert) -> Callable[[bytes], bool]:
    return lambda seed: digest(seed) == advert.seed_digest


def _key_check(advert: Advert) -> Callable[[bytes], bool]:
    """Whether a rebuilt masking key is the one whose public half the node advertised."""

    def check(secret: bytes) -> bool:
        try:
            public = key_from_scalar(secret).public_key()
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
        secret, bad = reconstruct(shares, t, check)
        for r in bad:
            rnd = rnd._refuse(Refused(r, f"a share of node {v}'s secret that does not rebuild it"))
        if secret is None:
            raise RoundLost(
                f"secure aggregation round {rnd.params.round} cannot be recovered: no {t} of the "
                f"{len(shares)} shares of node {v}'s secret rebuild it; the run stops (--resume "
                "runs the round again, with new keys)"
            )
        out[kind][v] = secret if kind == 0 else key_from_scalar(secret)
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
        total = np.subtract(total, self_mask(seed_of[u], params), dtype=np.uint64)
    for v in request["dropped"]:
        for u in request["survivors"]:
            mask, u_added = pair_mask(u, v, pair_key(key_of[v], rnd.table[u].mask_key), params)
            total = (np.subtract if u_added else np.add)(total, mask, dtype=np.uint64)
    return Aggregate(total, tuple(request["survivors"]), tuple(request["dropped"]), rnd.refused)
