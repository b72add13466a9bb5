"""The server of further pre-training (FedBFPT, BERT-FL, the truncated baseline) on a real
federation: the rounds of `python -m fedjax_split.pretrain` over a Flower Grid, written to the
run directory `pretrain` writes.

The server holds the global model and no text. Each round it computes the simulation's plan
(`run.pretraining.plan`: the trained layer, each client's layers, the trained paths), sends each
client the parameters its model runs (its layers, the embeddings and the head: what the
simulation's `bytes_down_full` counts) with the plan in the message's config, takes the replies
whose uploads are exactly the trained paths' shapes and dtypes, finite, with finite figures and the
node's own sequence count (as fine-tuning's server does: a reply is untrusted), and steps with the
run's `fed.strategy.Strategy`, as the simulation does. A client that fails or is rejected is
left out of the round (listed in `clients_failed` / `clients_rejected`); a round nobody answers
stops the run (its last checkpoint stays; `--resume` continues).

Held-out evaluation is at the nodes (the server opens no text): every node derives the held-out
batches as the simulation does and scores its share of them (batch i goes to client i mod K;
with --site-data each site scores its own, the run's batches being site 0's, then site 1's, ...)
with the full model sent down; the server puts the per-batch figures together in batch order, so
the held-out MLM loss and accuracy are the simulation's bit for bit. An evaluation that misses a
batch records no figures that round (`eval_failed`); the one before round 1 must succeed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_split.data.text.corpus_split import CorpusSplit, SitesSplit
from fedjax_split.deploy import codec, protocol
from fedjax_split.deploy.joining import connect
from fedjax_split.deploy.messaging import (
    DeployOptions,
    Exchange,
    Stopped,
    config_record,
    new_message,
    warn_line,
)
from fedjax_split.deploy.pretrain_node import check_deployable
from fedjax_split.deploy.train_replies import decode_upload, reply_number, whole_count
from fedjax_split.errors import UserError
from fedjax_split.fed import layerwise
from fedjax_split.fed.roles import flatten_paths, select
from fedjax_split.run import driver, pretrain_setup, pretraining
from fedjax_split.run.pretrain_config import PretrainConfig
from fedjax_split.sim.pretrain_rounds import ClientReport, mlm_metrics

TRAIN = f"{protocol.TRAIN}.{protocol.PRETRAIN}"
EVALUATE = f"{protocol.EVALUATE}.{protocol.PRETRAIN}"
QUERY = f"{protocol.QUERY}.{protocol.PRETRAIN}"


class HeldoutShare(NamedTuple):
    """What one client scores of the held-out batches: batches i with i % parts == part of its
    `count`, the run's batch `offset + i` (one corpus: batches c, c + K, ... of them all; a
    site: all of its own, after the sites before it)."""

    part: int
    parts: int
    count: int
    offset: int


# The most held-out batches (all sites' together) and training sequences a node may report
# when it joins. The server never sees the text, so it cannot count them; the bound keeps a
# wrong or lying count from exhausting the server's memory (`heldout_rows`' np.arange, the rows
# it adds up): 10**6 batches of 64 sequences is some 10**10 held-out tokens at 128 a sequence.
MAX_HELDOUT_BATCHES = 10**6
MAX_SEQUENCES = 10**9


def join_count(
    found: Mapping[int, tuple[int, Any]], client: int, key: str, limit: int, who: str = "client"
) -> int:
    """A count client `client`'s node (`who`: "site" with --site-data) reported when it joined,
    checked: a whole number from 0 to `limit` (a negative held-out count would shift the sites
    after it onto its rows)."""
    node_id, cfg = found[client]
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
            0 <= value <= limit):  # fmt: skip
        raise UserError(f"{who} {client} (SuperNode {node_id}) reported {key} {str(value)[:40]}, "
                        f"not a whole number from 0 to {limit:,}; is it running this version "
                        "of fedjax_split?")  # fmt: skip
    return int(value)


def join_counts(
    config: PretrainConfig, found: Mapping[int, tuple[int, Any]]
) -> tuple[Any, list[HeldoutShare], list[int]]:
    """(the corpus split or the sites' split.json record, each client's `HeldoutShare`, each
    client's training sequences) from the nodes' query replies, checked."""
    clients = list(range(config.federation.clients))
    if config.data.site_data is not None:
        split, shares = _sites_from_nodes(config, found)
    else:
        split, count = _split_from_nodes(found)
        shares = [HeldoutShare(c, len(clients), count, 0) for c in clients]
    who = "client" if config.data.site_data is None else "site"
    sizes = [join_count(found, c, protocol.SEQUENCES, MAX_SEQUENCES, who) for c in clients]
    return split, shares, sizes


def setup_from_nodes(
    config: PretrainConfig, found: Mapping[int, tuple[int, Any]]
) -> tuple[pretrain_setup.Setup, list[HeldoutShare]]:
    """(the run's text-free Setup, each client's `HeldoutShare`) from the nodes' query replies:
    the split they derive (all the same; sites: each its own counts), each client's sequences."""
    split, shares, sizes = join_counts(config, found)
    pre = pretrain_setup.load_model(config)
    clients = list(range(config.federation.clients))
    return pretrain_setup.model_setup(config, pre, split, clients, sizes), shares


def _split_from_nodes(found: Mapping[int, tuple[int, Any]]) -> tuple[Any, int]:
    """(the corpus split, the held-out batch count) every node derives from one corpus."""
    try:
        splits = {json.dumps(json.loads(str(cfg[protocol.SPLIT_JSON])), sort_keys=True)
                  for _, cfg in found.values()}  # fmt: skip
    except (KeyError, ValueError, RecursionError):
        raise UserError("a SuperNode answered the query without its split as JSON; is it "
                        "running this version of fedjax_split?") from None  # fmt: skip
    counts = {join_count(found, c, protocol.HELDOUT_BATCHES, MAX_HELDOUT_BATCHES) for c in found}
    if len(splits) != 1 or len(counts) != 1:
        raise UserError("the SuperNodes split the text differently; give them the same text")
    raw = json.loads(splits.pop())
    try:
        split = CorpusSplit(
            clients=tuple(np.asarray(c, np.int64) for c in raw["clients"]),
            heldout=np.asarray(raw["heldout"], np.int64),
            scheme=str(raw["scheme"]),
            seed=int(raw["seed"]),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise UserError(f"the SuperNodes report the split {str(raw)[:60]} ({err}); is each "
                        "running this version of fedjax_split?") from None  # fmt: skip
    if counts and split.heldout.size == 0 and max(counts) > 0:
        raise UserError(f"the SuperNodes report {max(counts)} held-out batches of no held-out "
                        "document; is each running this version of fedjax_split?")  # fmt: skip
    return split, counts.pop()


def _sites_from_nodes(
    config: PretrainConfig, found: Mapping[int, tuple[int, Any]]
) -> tuple[Any, list[HeldoutShare]]:
    """(the sites' split.json record, each site's held-out share) from what each site says of
    itself: its counts (whole numbers, train + held out = documents) and held-out batches."""
    sites, shares, offset = [], [], 0
    for c in range(config.federation.clients):
        cfg = found[c][1]
        try:
            counts = json.loads(str(cfg[protocol.SPLIT_JSON]))
        except (KeyError, ValueError, RecursionError):
            counts = None
        keys = ("documents", "train", "heldout")
        if (not isinstance(counts, dict) or set(counts) != set(keys)
                or not all(type(counts[k]) is int and counts[k] >= 0 for k in keys)
                or counts["train"] + counts["heldout"] != counts["documents"]):  # fmt: skip
            raise UserError(f"site {c} reported {str(counts)[:80]} as its counts; is its "
                            "SuperNode running this version of fedjax_split?")  # fmt: skip
        count = join_count(found, c, protocol.HELDOUT_BATCHES, MAX_HELDOUT_BATCHES - offset, "site")
        if count and not counts["heldout"]:
            raise UserError(f"site {c} reported {count} held-out batches of no held-out "
                            "document; is its SuperNode running this version of fedjax_split?")
        sites.append({k: counts[k] for k in keys})
        shares.append(HeldoutShare(0, 1, count, offset))
        offset += count
    return SitesSplit(tuple(sites), config.seed), shares


def _train_message(
    node_id: int, r: int, client: int, layers: Sequence[int], trained: frozenset[str],
    params: Any,
) -> Any:  # fmt: skip
    """Round r's message to `client`: the global parameters of its model, the plan's part."""
    model = layerwise.assemble(params, layers)
    sent = codec.encode(layerwise.to_global(model, layers), "float32")
    cfg = {protocol.ROUND: r, protocol.CLIENT: client, protocol.LAYERS: [int(g) for g in layers],
           protocol.TRAINED: sorted(trained)}  # fmt: skip
    content = {protocol.CONFIG: config_record(cfg), protocol.GLOBAL: codec.to_record(sent)}
    return new_message(content, node_id, TRAIN)


def take_upload(
    setup: pretrain_setup.Setup, reply: Any, client: int, layers: Sequence[int],
    trained: frozenset[str],
) -> tuple[Any, Any, int]:  # fmt: skip
    """(upload in fp32, its `ClientReport`, BERT-FL's FLOPs) of a train reply, or ValueError:
    the upload must be exactly the trained paths in fp32, finite; the figures finite numbers,
    the sequence count the node's own (as it said when it joined)."""
    part = select(setup.server_state.global_params, trained)[0]
    expected = {p: np.shape(x) for p, x in flatten_paths(part).items()}
    upload, nbytes = decode_upload(reply, expected, "float32", codec.sent_dtypes(part))
    if protocol.METRICS not in reply.content.metric_records:
        raise ValueError("no training metrics")
    m = reply.content[protocol.METRICS]
    whole = {k: whole_count(m, k) for k in (protocol.TOKENS, protocol.STEPS, protocol.FLOPS,
                                       protocol.BERT_FL_FLOPS, protocol.SEQUENCES)}  # fmt: skip
    if whole[protocol.SEQUENCES] != setup.sizes[client]:
        raise ValueError(f"sequence count {whole[protocol.SEQUENCES]}, but the node reported "
                         f"{setup.sizes[client]} when it joined")  # fmt: skip
    report = ClientReport(
        client=client, layers=tuple(int(g) for g in layers),
        loss=reply_number(m, protocol.TRAIN_LOSS, "training loss"), tokens=whole[protocol.TOKENS],
        steps=whole[protocol.STEPS], seconds=reply_number(m, protocol.SECONDS, "seconds"),
        cpu_seconds=reply_number(m, protocol.CPU_SECONDS, "CPU seconds"),
        flops=whole[protocol.FLOPS], bytes_up=nbytes,
    )  # fmt: skip
    return upload, report, whole[protocol.BERT_FL_FLOPS]


def heldout_rows(reply: Any, part: int, parts: int, count: int) -> dict[int, np.ndarray]:
    """{batch index: [loss sum, tokens, correct]} of an evaluate reply, or ValueError: indices
    of this node's share, finite figures >= 0, correct <= tokens."""
    if protocol.HELDOUT not in reply.content.array_records:
        raise ValueError("no held-out figures")
    arrays = codec.from_record(reply.content[protocol.HELDOUT])
    index, sums = arrays.get("batches"), arrays.get("sums")
    want = np.arange(part, count, parts, dtype=np.int64)
    if set(arrays) != {"batches", "sums"} or index.dtype != np.int64 or sums.dtype != np.float64:
        raise ValueError("held-out figures are not int64 batches and float64 sums")
    if not np.array_equal(index, want) or sums.shape != (want.size, 3):
        raise ValueError(f"held-out batches {index.tolist()[:4]}, expected {want.tolist()[:4]}")
    if not (np.all(np.isfinite(sums)) and np.all(sums >= 0) and np.all(sums[:, 2] <= sums[:, 1])):
        raise ValueError("held-out figures are not finite sums >= 0")
    return {int(i): row for i, row in zip(index, sums, strict=True)}


class FlowerPretraining(pretraining.Pretraining):
    """Further pre-training's `driver.Run` over a federation: the simulation's `Pretraining`
    (checkpoints, resume, summary, model/), its rounds and evaluations at the nodes."""

    def __init__(
        self,
        setup: pretrain_setup.Setup,
        started: float,
        grid: Any,
        nodes: dict[int, int],
        heldout: Sequence[HeldoutShare],
        options: DeployOptions,
    ) -> None:
        super().__init__(setup, started)
        self.exchange = Exchange(grid, options)
        self.nodes = nodes  # client id -> Flower node id
        self.heldout = list(heldout)  # client id -> what it scores
        self.options = options
        self.eval_failed: dict[int, str] = {}
        self.eval_bytes = 0

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "deploy": "flower"}

    def evaluate(self) -> dict[str, Any]:
        """The held-out figures from the nodes; before round 1 they must all answer."""
        metrics = self.evaluate_at_nodes()
        if metrics is None:
            raise UserError(
                f"the held-out evaluation before round 1 failed ({self.eval_failed}); check the "
                "SuperNodes' logs"
            )
        return metrics

    def evaluate_at_nodes(self) -> dict[str, Any] | None:
        """The model the run produces scored by the nodes on the held-out batches (client c
        scores its `HeldoutShare`), their figures added up in the run's batch order; None if a
        share is missing (`eval_failed` says why)."""
        params, _ = pretrain_setup.final_params(self.setup)
        depth = pretrain_setup.model_depth(self.setup)
        sent = codec.to_record(codec.encode(params, "float32"))
        msgs = {}
        for c, node_id in sorted(self.nodes.items()):
            share = self.heldout[c]
            cfg = {protocol.CLIENT: c, protocol.DEPTH: depth, protocol.PART: share.part,
                   protocol.PARTS: share.parts}  # fmt: skip
            msgs[c] = new_message({protocol.CONFIG: config_record(cfg), protocol.GLOBAL: sent},
                               node_id, EVALUATE)  # fmt: skip
        replies, failed = self.exchange.send(msgs, self.options.round_timeout)
        self.eval_bytes = codec.nbytes(codec.from_record(sent)) * len(msgs)
        rows: dict[int, np.ndarray] = {}
        for c, reply in sorted(replies.items()):
            share = self.heldout[c]
            try:
                got = heldout_rows(reply, share.part, share.parts, share.count)
            except ValueError as err:
                failed[c] = f"bad evaluation: {err}"
                continue
            rows.update({share.offset + i: row for i, row in got.items()})
        self.eval_failed = failed
        for c, why in sorted(failed.items()):
            warn_line(f"client {c} failed to evaluate ({why})")
        if failed:
            return None
        total = max((s.offset + s.count for s in self.heldout), default=0)
        return mlm_metrics(np.asarray([rows[i] for i in range(total)]).reshape(-1, 3))

    def step(self, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return run_round(self, r, history[-1] if history else None)

    def summary(self, history: Sequence[dict[str, Any]], stats: Any) -> dict[str, Any]:
        return {**super().summary(history, stats), "deploy": "flower",
                "supernodes": len(self.nodes)}  # fmt: skip


def _send_round(run: FlowerPretraining, r: int, the_plan: Any) -> tuple[dict, dict, dict]:
    """Round r's messages out, replies in: ({client: (upload, report, BERT-FL FLOPs)},
    failed, rejected)."""
    params = run.setup.server_state.global_params
    msgs = {
        c: _train_message(run.nodes[c], r, c, layers, the_plan.trained, params)
        for c, layers in zip(run.setup.clients, the_plan.layers, strict=True)
    }
    layers_of = dict(zip(run.setup.clients, the_plan.layers, strict=True))
    replies, failed = run.exchange.send(msgs, run.options.round_timeout)
    taken, rejected = {}, {}
    for c, reply in sorted(replies.items()):
        try:
            taken[c] = take_upload(run.setup, reply, c, layers_of[c], the_plan.trained)
        except ValueError as err:
            rejected[c] = f"bad upload: {err}"
    for c, why in sorted(failed.items()):
        warn_line(f"round {r}: client {c} failed ({why})")
    for c, why in sorted(rejected.items()):
        warn_line(f"round {r}: client {c}'s upload rejected ({why})")
    return taken, failed, rejected


def run_round(run: FlowerPretraining, r: int, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Round r over the federation; its record, the simulation's plus who failed."""
    setup, config = run.setup, run.setup.config
    t0 = time.perf_counter()
    the_plan = pretraining.plan(setup, r)
    params = setup.server_state.global_params
    taken, failed, rejected = _send_round(run, r, the_plan)
    if not taken:
        raise UserError(
            f"round {r}: no client's upload was taken ({len(failed)} failed, {len(rejected)} "
            "rejected); check the SuperNodes, then continue with --resume"
        )
    clients = sorted(taken)
    weights = pretraining.round_weights(config, [setup.sizes[c] for c in clients])
    setup.server_state, accepted, _ = setup.strategy.aggregate(
        the_plan, setup.server_state, [taken[c][0] for c in clients],
        np.asarray(weights, np.float32))  # fmt: skip
    for c, ok in zip(clients, np.asarray(accepted), strict=True):
        if not ok:  # take_upload checks finiteness already: the server's step is the backstop
            rejected[c] = "upload not finite"
            warn_line(f"round {r}: client {c}'s upload rejected (not finite)")
    clients = pretraining.counted(r, clients, list(rejected), diverged=False)
    jax.block_until_ready(setup.server_state.global_params)
    t_train = time.perf_counter()
    down = pretraining.bytes_down(setup, params, r)
    lines = [pretraining.client_costs(setup, params, taken[c][1], taken[c][2], down)
             for c in clients]  # fmt: skip
    evaluated, run.eval_failed, run.eval_bytes = None, {}, 0
    if driver.due(r, config.outputs.eval_every, config.federation.rounds):
        evaluated = run.evaluate_at_nodes()
    record = pretraining.round_record(setup, r, previous, params, lines, evaluated,
                                      (t0, t_train, time.perf_counter()))  # fmt: skip
    record.update(clients_failed=sorted(failed), clients_rejected=sorted(rejected),
                  eval_failed=sorted(run.eval_failed), eval_bytes_down=run.eval_bytes)  # fmt: skip
    return record


def run_pretrain_server(
    grid: Any, config: PretrainConfig, options: DeployOptions, *, progress: bool = True
) -> dict[str, Any]:
    """The whole further pre-training run (or with config.outputs.resume, its continuation) over
    `grid`; the summary. Writes what `python -m fedjax_split.pretrain` writes (config.json,
    split.json, metrics.jsonl, summary.json, checkpoints/, model/). Raises
    `deploy.messaging.Stopped` after the checkpoint of `options.stop_after_round`."""
    started = time.perf_counter()
    pretrain_setup.check(config)
    check_deployable(config)
    driver.check_run_dir(config.run_dir, config.outputs.resume,
                         lambda saved: pretraining.mismatch(saved, config),
                         output_names=["model"])  # fmt: skip
    found = connect(grid, config, options, query=QUERY)
    setup, heldout = setup_from_nodes(config, found)
    nodes = {c: node_id for c, (node_id, _) in found.items()}
    run = FlowerPretraining(setup, started, grid, nodes, heldout, options)

    def stop(round_: int, record: dict[str, Any]) -> None:
        if options.stop_after_round == round_:
            raise Stopped(round_)

    return driver.drive(run, config.to_dict(), resume=config.outputs.resume,
                        checkpoint_every=config.outputs.checkpoint_every, progress=progress,
                        on_round_end=stop)  # fmt: skip
