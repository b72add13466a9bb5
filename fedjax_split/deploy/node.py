"""A client of a real federation: its share of the data, its local part on its own disk, and the
very computations the simulation runs for it.

Nothing here imports Flower: the ClientApp's handlers (`handlers.py`) turn messages into these
calls. A node derives its share exactly as the simulation does (`run.pieces`: the pool, the
subsample, the partition, its client id = its partition id; with --site-data, its own site's
files and nothing else, split as the simulation splits that site), trains with
`fed.client_program.client_round` on its own examples' steps (the programs the one-at-a-time
simulation runs for that client, with the same key), and evaluates with the simulation's
per-client evaluation. So a node computes, bit for bit, what the simulation computes for its
client.

Its local (personal) part never leaves it: `store` keeps one file per round it trained in,
under `<state-dir>/<run id>/client_<id>/`, so that a restarted server can resume from an older
checkpoint and the node still has the local part of that round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split import atomic
from fedjax_split.data import batching, partition, sources, tokenization
from fedjax_split.deploy import protocol
from fedjax_split.errors import UserError
from fedjax_split.fed import roles, wire
from fedjax_split.fed.client_program import client_functions, client_key, client_round
from fedjax_split.fed.roles import flatten_paths
from fedjax_split.run import client_data, client_scores, costs, pieces
from fedjax_split.run.config import ExperimentConfig
from fedjax_split.sim import evaluation
from fedjax_split.sim.client_store import ClientStore, load_tree, save_tree, tree_digest
from fedjax_split.sim.round_spec import RoundSpec
from fedjax_split.tasks import registry as tasks


@dataclasses.dataclass
class NodeSetup:
    """What one client needs in memory (built anew by every ClientApp process: Flower starts one
    per message)."""

    config: ExperimentConfig
    task: tasks.Task
    client_id: int
    pool: client_data.Pool  # the whole pool (its steps use its own rows only)
    split: partition.ClientSplit  # this client's train / test pool indices
    shares: list[float] | None  # its realised label shares (partition.json), None without target
    partition_meta: dict[str, Any]  # the partition's settings (what partition.json records)
    pool_size: int
    apply: Callable[..., Any]
    round_spec: RoundSpec
    local0: Any  # the pretrained local part every client starts from
    frozen: Any
    global_shapes: dict[str, tuple[int, ...]]  # flat paths of the global part -> shapes
    paths: costs.ModelPaths  # the architecture and the roles' paths (its FLOP counts)
    model_meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # pieces.model_meta


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "merges.txt",
                    "special_tokens_map.json")  # fmt: skip


def _tokenized(
    config: ExperimentConfig, task: tasks.Task, examples: Any, model_dir: Any, cache: Path | None
) -> Any:
    """The pool tokenised and packed, cached on the node's disk keyed by the data, the
    tokenizer's files and the length, so that only a node's first ClientApp process loads a
    tokenizer (transformers' import alone takes seconds, and Flower starts a process per
    message)."""
    data = config.data
    path = None
    fingerprint = getattr(examples, "fingerprint", None)
    if cache is not None and model_dir is not None and fingerprint is not None:
        h = hashlib.sha256(json.dumps([task.name, int(data.max_length), fingerprint()]).encode())
        for name in _TOKENIZER_FILES:
            f = Path(model_dir) / name
            if f.is_file():
                h.update(name.encode() + f.read_bytes())
        path = cache / f"{task.name}-{h.hexdigest()[:32]}.npz"
        if path.is_file():
            try:
                with np.load(path) as z:
                    return batching.Packed(**{k: np.array(z[k]) for k in z.files})
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable: tokenise again and rewrite it
    tokenizer = tokenization.load_tokenizer(config.model.name if model_dir is None else model_dir)
    packed = batching.pack(sources.tokenize_examples(examples, tokenizer, task, data.max_length))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {k: v for k, v in packed._asdict().items() if v is not None}
        atomic.atomic_write(path, lambda f: np.savez(f, **arrays))
    return packed


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def node_clients(node_config: Mapping[str, Any]) -> list[int]:
    """The clients a SuperNode holds, from its node config: `partition-id=K` (one), or
    `partition-ids="0-33"` / `"0,4,7-9"` (several, so that a few nodes can run a federation of
    many clients)."""
    if protocol.PARTITION_IDS in node_config:
        if protocol.PARTITION_ID in node_config:
            raise UserError("give a SuperNode partition-id or partition-ids, not both")
        text = str(node_config[protocol.PARTITION_IDS])
        ids: list[int] = []
        for part in text.replace(" ", "").split(","):
            m = _RANGE.match(part)
            if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
                raise UserError(f"partition-ids {text!r}: write ids and ranges like '0-33' or "
                                "'0,4,7-9'")  # fmt: skip
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi - lo >= 100_000:
                raise UserError(f"partition-ids {text!r}: more clients than a node can hold")
            ids.extend(range(lo, hi + 1))
        if len(set(ids)) != len(ids):
            raise UserError(f"partition-ids {text!r} names a client twice")
        return ids
    if protocol.PARTITION_ID not in node_config:
        raise UserError("give the SuperNode its client: --node-config 'partition-id=K'")
    value = str(node_config[protocol.PARTITION_ID])
    if not value.isdigit():
        raise UserError(f"partition-id {value!r} is not a client id; give a whole number")
    return [int(value)]


def prepare(
    config: ExperimentConfig,
    client_id: int,
    cache: Path | None = None,
    site_dir: str | Path | None = None,
) -> NodeSetup:
    """This client's share and model, derived by `run.pieces` as the simulation derives them.
    `cache`: a directory of the node's own for the tokenised pool (None: tokenise each time);
    `site_dir`: with --site-data, this site's own files (its node config's data-dir), the only
    data the node reads."""
    return prepare_many(config, [client_id], cache, site_dir)[client_id]


def prepare_many(
    config: ExperimentConfig, client_ids: Sequence[int], cache: Path | None = None,
    site_dir: str | Path | None = None,
) -> dict[int, NodeSetup]:  # fmt: skip
    """`prepare` for each of a node's clients, the data, the partition and the model loaded once
    and shared by them (a site is one client)."""
    bad = [c for c in client_ids if not 0 <= c < config.federation.clients]
    if bad:
        raise UserError(
            f"partition-id {bad[0]} is outside 0..{config.federation.clients - 1} (--clients "
            f"{config.federation.clients}); give each SuperNode one of those"
        )
    task = tasks.get_task(config.data.task)
    if config.data.site_data is not None:
        if len(client_ids) != 1:
            raise UserError("a site is one client: give its SuperNode one partition-id")
        shares = {client_ids[0]: _site_share(config, task, client_ids[0], site_dir)}
    else:
        shares = _pool_shares(config, task, client_ids)
    examples = next(iter(shares.values()))[0]
    model = pieces.build_model(config, task, getattr(examples, "tag_names", ()))
    pool = client_data.make_pool(
        config, examples, _tokenized(config, task, examples, model.model_dir, cache)
    )
    common = dict(
        config=config, task=task, pool=pool, pool_size=len(pool.labels), apply=model.apply,
        round_spec=model.round_spec, local0=model.local0, frozen=model.frozen,
        global_shapes={p: tuple(np.shape(x)) for p, x in flatten_paths(model.global0).items()},
        paths=costs.paths_of(model),
        model_meta={**pieces.model_meta(model), "seed": config.seed},  # seed: model_record
    )  # fmt: skip
    return {
        cid: NodeSetup(client_id=cid, split=split, shares=sh, partition_meta=meta, **common)
        for cid, (_, split, sh, meta) in shares.items()
    }


Share = tuple[Any, Any, Any, dict[str, Any]]  # examples, split, label shares or None, settings


def _pool_shares(
    config: ExperimentConfig, task: tasks.Task, client_ids: Sequence[int]
) -> dict[int, Share]:
    """Each client's share of the pool every node loads and partitions alike: (the pool, its
    split of it, its realised label shares, the partition's settings)."""
    examples = client_data.load_pool(config, task)
    labels = np.asarray(examples.labels)
    part = client_data.make_partition(config, task, labels)
    meta = _meta(part, "clients")
    out = {}
    for cid in client_ids:
        split = part.clients[cid]
        shares = None if part.target_shares is None else partition.client_shares(
            split, labels, part.target_shares.shape[1]).tolist()  # fmt: skip
        out[cid] = (examples, split, shares, meta)
    return out


def _site_share(
    config: ExperimentConfig, task: tasks.Task, client_id: int, site_dir: str | Path
) -> Share:
    """A site's own data (--site-data): (its examples, its own split of them, its label
    shares, the settings every site has alike; the server offsets each site's indices by the
    sizes the sites report, `partition.sites_partition`)."""
    if site_dir is None:
        raise UserError(
            f"this run's sites read their own data: give SuperNode {client_id} its directory "
            f"in its node config (--node-config 'partition-id={client_id} data-dir=DIR')"
        )
    examples = client_data.load_site(config, task, client_id, site_dir)
    split = client_data.site_split(config, examples, client_id, site_dir)
    labels = np.asarray(examples.labels)
    # a token task's shares are of each sentence's dominant entity type, as the simulation's
    names = sources.label_names_or_none(task, examples) or ()
    shares = partition.client_shares(split, labels, len(names)).tolist() if names else None
    part = partition.sites_partition([split], [len(labels)], config.seed, task.name)
    return examples, split, shares, _meta(part, "clients", "num_examples")


def _meta(part: Any, *leave_out: str) -> dict[str, Any]:
    """The partition's settings as JSON holds them (what partition.json records besides the
    indices), less `leave_out`."""
    return {f.name: _plain(getattr(part, f.name))
            for f in dataclasses.fields(part) if f.name not in leave_out}  # fmt: skip


def _plain(value: Any) -> Any:
    """A partition setting as JSON holds it (arrays as lists)."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def train(
    node: NodeSetup,
    global_wire: Any,
    round_index: int,
    state_round: int,
    local: Any,
    clip: float | None = None,
) -> tuple[Any, Any, Any, float | None, dict[str, int]]:
    """Round `round_index` for this client: (upload in fp32 as the server receives it, new local
    part, ClientMetrics, the update's norm before clipping or None, its FLOPs as
    `run.costs.client_costs` counts them). `global_wire`: the received
    global part in the wire dtype; `state_round`: the rounds the server's state had completed
    (the key folds it in); `clip`: client-level DP's clip norm for this round (the server's
    state holds it), None without DP. With it the client clips its own update, as the
    simulation's clients do (`ClientProgram.clip_one`), before anything leaves the node."""
    import jax
    import jax.numpy as jnp

    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"the server asked for a DP clip norm of {clip}; refusing to train")
    steps = client_data.client_steps(
        node.config, node.task, node.pool, node.split.train, node.client_id, round_index
    )
    key = client_key(jax.random.key(node.config.seed), state_round, node.client_id)
    upload, new_local, metrics = client_round(node.round_spec, global_wire, local, steps, key,
                                              node.frozen)  # fmt: skip
    schedule = node.config.federation.layer_schedule != "none"
    spent = costs.client_costs(node.paths, node.round_spec.trained, steps, schedule)
    if clip is None:
        return upload, new_local, metrics, None, spent
    clip_one = client_functions(node.round_spec).clip_one
    upload, norm = clip_one(upload, global_wire, jnp.asarray(clip, jnp.float32))
    return upload, new_local, metrics, float(norm), spent


def evaluate(node: NodeSetup, global_wire: Any, local: Any) -> dict[str, Any]:
    """This client's metrics: its merged model [received global, frozen, own local] on its own
    test split, scored as the simulation scores each client ({} without test examples)."""
    import jax.numpy as jnp

    batches = client_data.client_eval_steps(node.config, node.task, node.pool, node.split.test)
    received = wire.cast_from_wire(global_wire, jnp.float32)
    params = roles.merge_params(received, node.frozen, local)
    res = evaluation.evaluate_client(node.apply, params, batches, node.task.objective)
    if len(res.labels) == 0:
        return {}
    return client_scores.score(node.task, node.pool.examples, res)


def store(state_dir: str | Path, run_id: str, node: NodeSetup) -> ClientStore:
    """This client's local parts on the node's disk: `<state_dir>/<run id>/client_<id>/`, one
    file per round it trained in (`sim.client_store`: the simulation's store, for one client);
    before its first round the pretrained part. The run id keeps runs apart."""
    if not re.fullmatch(r"[0-9a-f]{8,64}", run_id):
        raise ValueError(f"bad run id {run_id!r}")
    return ClientStore(Path(state_dir) / run_id, initial=node.local0)


MODEL_FILE = "model.json"
FROZEN_FILE = "frozen.npz"
FROZEN_DIGEST = "frozen_sha256"  # model.json's: the frozen part the node did not copy
EXPORT_DIR = "export"  # under the run's directory on the node: what the export at the site reads
_GLOBAL_FILE = re.compile(r"^global_after_(\d+)\.npz$")


def keep_for_export(
    store: ClientStore, node: NodeSetup, global_wire: Any, after_round: int, local: Any
) -> None:
    """What `python -m fedjax_split.export --state-dir` needs at this site, so that the personal
    model is assembled where it lives and never travels: the model's description (once), and, as
    one pair, the global part this node last received (after round `after_round`, in the wire
    dtype) and this client's local part it was evaluated with. Only the latest pair is kept (the
    run's present, even after a server resumed from an older checkpoint); the local part is a
    second name (a hard link) of the store's version, which the store prunes by the server's
    checkpoints, not by evaluations. Nothing is copied that the node has elsewhere: the frozen
    part (a LoRA run's base weights) is the node's model directory's, named in model.json with
    its sha256 (`model_record`); the pretrained local part is written only while the client has
    not trained (`keep_initial`)."""
    d = store.directory
    (d / f"client_{node.client_id}").mkdir(parents=True, exist_ok=True)  # this node's client
    if not (d / MODEL_FILE).is_file():
        record = model_record(node)
        if node.frozen and FROZEN_DIGEST not in record:  # no model directory to name: a copy
            save_tree(d / FROZEN_FILE, node.frozen)
        atomic.write_text(d / MODEL_FILE, json.dumps(record))
    version = store.version(node.client_id, after_round)
    if version is None:
        keep_initial(store, node)
    out = d / EXPORT_DIR
    name, mine = f"global_after_{after_round}.npz", f"client_{node.client_id}_after_"
    _keep_local(store, node.client_id, version, local, out / f"{mine}{after_round}.npz")
    if not (out / name).is_file():  # a node's other clients evaluated with the same global part
        save_tree(out / name, global_wire)
    for f in out.iterdir():
        if (_GLOBAL_FILE.match(f.name) and f.name != name) or (
            f.name.startswith(mine) and f.name != f"{mine}{after_round}.npz"
        ):
            f.unlink(missing_ok=True)


def model_record(node: NodeSetup) -> dict[str, Any]:
    """model.json: the model as `pieces.model_meta` describes it, and with a frozen part, the
    sha256 of it (`sim.client_store.tree_digest`), so that the export rebuilds it from the
    model directory and the seed and knows it rebuilt the very arrays the node trained with."""
    record = dict(node.model_meta)
    if node.frozen and record.get("model_dir") and "seed" in record:
        record[FROZEN_DIGEST] = tree_digest(node.frozen)
    return record


def keep_initial(store: ClientStore, node: NodeSetup) -> None:
    """The pretrained local part as `initial.npz`, once: what an export of a round before the
    client first trained reads (`python -m fedjax_split.export --run-dir` of a launcher run)."""
    if not (store.directory / "initial.npz").is_file():
        save_tree(store.directory / "initial.npz", node.local0)


def _keep_local(
    store: ClientStore, client: int, version: int | None, local: Any, path: Path
) -> None:
    """`local` (the store's version `version` of `client`'s part) at `path`: a hard link to the
    store's file (files are replaced, never rewritten, so the two names stay the same bytes), or
    a copy where no link can be made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    source = None if version is None else store.path(client, version)
    if source is not None and source.is_file():
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.link(source, tmp)
            os.replace(tmp, path)
            return
        except OSError:
            tmp.unlink(missing_ok=True)
    save_tree(path, local)


def exported_pair(directory: Path, client: int) -> tuple[Any, Any, int]:
    """(the global part a node kept for export, in the wire dtype, client `client`'s local part
    evaluated with it, the round both are after)."""
    out = directory / EXPORT_DIR
    found = sorted(
        (int(m.group(1)), f) for f in (out.iterdir() if out.is_dir() else [])
        if (m := _GLOBAL_FILE.match(f.name))
    )  # fmt: skip
    if not found:
        raise UserError(
            f"{directory} holds no global part: the node keeps one from its first evaluation "
            "on; export after a round that evaluated"
        )
    r, f = found[-1]
    try:
        return load_tree(f), load_tree(out / f"client_{int(client)}_after_{r}.npz"), r
    except FileNotFoundError:
        raise UserError(
            f"client {client} was not evaluated at this node after round {r} (or an evaluation "
            "is writing now); export after the run, with one of its clients"
        ) from None


def local_part(node: NodeSetup, store: ClientStore, at_most: int) -> Any:
    """The client's local part after round `at_most` (the pretrained one before its first)."""
    import jax.numpy as jnp

    tree = store.load(node.client_id, at_most)
    expected = {p: np.shape(x) for p, x in flatten_paths(node.local0).items()}
    got = {p: np.shape(x) for p, x in flatten_paths(tree).items()}
    if expected != got:
        raise UserError(
            f"the local part in {store.directory} does not fit this model; use another state-dir"
        )
    return jax_tree(tree, jnp.asarray)


def jax_tree(tree: Mapping[str, Any], fn: Callable[[Any], Any]) -> Any:
    import jax

    return jax.tree.map(fn, tree)
