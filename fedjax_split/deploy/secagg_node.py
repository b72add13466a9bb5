"""A node's stages of secure aggregation (`deploy.secagg` has the protocol): its keys and
seed, its shares encrypted to the other nodes, its masked vector, and the shares it reveals once
to unmask the sum. Pure: a stage takes the node's frozen state and a message and returns both
anew; `deploy.secure_node` keeps the state between a round's queries.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import numpy as np
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import public_key_to_bytes

from fedjax_split.deploy.secagg import (
    Advert,
    Message,
    Params,
    Refused,
    UnsafeRequest,
    node_ids,
)
from fedjax_split.deploy.secagg_crypto import (
    CURVE,
    KEY_SHARE,
    SEED_BYTES,
    SEED_SHARE,
    digest,
    pair_key,
    pair_mask,
    public_key,
    scalar,
    self_mask,
    share_index,
)


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
    enc_key = ec.generate_private_key(CURVE)
    mask_key = ec.generate_private_key(CURVE)
    seed = os.urandom(SEED_BYTES)
    state = NodeState(params, node, enc_key, mask_key, seed)
    advert = {
        "node": node,
        "enc_key": public_key_to_bytes(enc_key.public_key()),
        "mask_key": public_key_to_bytes(mask_key.public_key()),
        "seed_digest": digest(seed),
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
        digest(state.seed),
    ):
        raise UnsafeRequest(f"the key table leaves node {state.node} out or shows its keys wrongly")
    t, n = state.params.threshold, len(table)
    seed_shares = create_shares(state.seed, t, n)
    key_shares = create_shares(scalar(state.mask_key), t, n)
    me = list(table).index(state.node)
    to, ciphertexts = [], []
    for i, (v, advert) in enumerate(table.items()):
        if v == state.node:
            continue
        key = generate_shared_key(state.enc_key, public_key(advert.enc_key))
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
    key = generate_shared_key(state.enc_key, public_key(state.table[src].enc_key))
    try:
        plain = decrypt(key, token)
    except (InvalidToken, TypeError, ValueError):
        raise Refused(src, "a share that does not decrypt") from None
    sender, recipient, seed_share, key_share = share_keys_plaintext_separate(plain)
    index = list(state.table).index(state.node) + 1
    if (sender, recipient) != (src, state.node):
        raise Refused(src, f"a share addressed from {sender} to {recipient}")
    if len(seed_share) != SEED_SHARE or len(key_share) != KEY_SHARE:
        raise Refused(src, "a share of the wrong length")
    if share_index(seed_share) != index or share_index(key_share) != index:
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
    sources = node_ids(inbox, "from", state.node)
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
    masked = np.add(x, self_mask(state.seed, params), dtype=np.uint64)
    for v in sources:
        mask, adds = pair_mask(
            state.node, v, pair_key(state.mask_key, state.table[v].mask_key), params
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
    survivors, dropped = (node_ids(request, k, state.node) for k in ("survivors", "dropped"))
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
