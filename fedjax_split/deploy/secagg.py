"""Secure aggregation (SecAgg+, Bell et al. 2020) as pure stages: the server learns only the sum.

The stages of Bell et al.'s semi-honest protocol, on the complete graph (every node is every
other's neighbour: the original SecAgg of Bonawitz et al. 2017; SecAgg+'s sparse neighbourhood
graph only pays off with thousands of nodes). Each stage is a function of a frozen state and of
messages as flat dicts of ints, bytes and lists of them (a masked vector is a uint64 array), so
that a transport only carries them; a node's stages are `deploy.secagg_node`'s, the server's
`deploy.secagg_server`'s:

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

The primitives (key agreement, shares, masks) are `deploy.secagg_crypto`'s. This module holds
what both sides share: a round's settings (`Params`), a node's advertisement, the checks of a
message's fields and the errors. Anything malformed a node sends raises `Refused` naming it; the
server records it and leaves the node out (as dropped). Below the threshold the round raises
`RoundLost`, one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.errors import UserError

Message = dict[str, Any]


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


def node_ids(msg: Message, name: str, node: int) -> list[int]:
    """Field `name` of node `node`'s message, which must be a list of ints (else `Refused`)."""
    value = msg.get(name)
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise Refused(node, f"{name!r} is not a list of node ids")
    return value


def blobs(msg: Message, name: str, node: int, size: int, count: int) -> list[bytes]:
    """Field `name` of node `node`'s message, which must be `count` byte strings of `size` bytes
    each (else `Refused`)."""
    value = msg.get(name)
    if not isinstance(value, list) or len(value) != count:
        raise Refused(node, f"{name!r} is not a list of {count} byte strings")
    if not all(isinstance(b, bytes) and len(b) == size for b in value):
        raise Refused(node, f"{name!r} holds an entry that is not {size} bytes")
    return value
