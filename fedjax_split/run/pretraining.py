"""run_pretraining(config): text -> client split -> MLM rounds (FedBFPT or a baseline) -> outputs.

Importable (the study and notebooks call it); `python -m fedjax_split.pretrain` is a thin
wrapper. Everything a user can get wrong is checked before the first byte is written. The run
directory holds config.json, split.json (each client's and the held-out documents; with
--site-data each site's counts: its text is its own *.txt, a share of it held out there),
metrics.jsonl (one record per round: held-out MLM loss and masked-token accuracy, training loss,
bytes, FLOPs, seconds, per client too), summary.json, checkpoints/ (orbax) and, at the end,
model/: the further pre-trained model as a Hugging Face `BertForMaskedLM` directory with the
tokenizer, which `python -m fedjax_split.train --model DIR/model` fine-tunes.

Randomness comes from the seed, the round and the client only (subsample and split:
`default_rng([seed, 0, purpose])`; batches and masks: `[seed, round, client, purpose]`; layer
draws: `fed.layerwise.sample_deeper`; dropout: fold_in(key(seed), round, client)), and clients
keep no state between rounds (their optimiser starts afresh each round), so `--resume` from the
checkpoint of round r continues exactly as the uninterrupted run, also after a kill -9.

Costs, per round and client (all counted, none estimated from the paper):
- bytes_up: the trained part each client sends (fp32), from the arrays sent;
- bytes_down: what brings a client's copy of the global model up to date, i.e. the parameters the
  previous round changed (the released code's protocol: every client keeps the full model, which
  starts as the public pre-trained checkpoint, and receives only the aggregated layer and head);
  bytes_down_full: the whole model a client runs, for clients that keep nothing between rounds;
- flops: matmul FLOPs of the steps run, as autodiff computes them (`models.flops.mlm_train_flops`;
  the FLOPs check against the compiled program's matmuls is in tests/test_flops.py);
- seconds: each client's training time on this machine, wall and CPU (`cpu_seconds`).
The same counts for BERT-FL on the same text and rounds (`bert_fl_*`) give each method's shares.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedjax_split import runtime
from fedjax_split.data import tokenization
from fedjax_split.data.text import corpus_split, masking, mlm_batching, text_corpora
from fedjax_split.errors import UserError
from fedjax_split.fed import algorithms, client, layerwise, roles
from fedjax_split.fed.roles import select
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.wire import cast_from_wire, param_count, tree_bytes
from fedjax_split.models import hf_checkpoint
from fedjax_split.models.flops import mlm_train_flops
from fedjax_split.models.hf_checkpoint import save_pretrained
from fedjax_split.run import driver, outputs
from fedjax_split.run.pretrain_config import (
    SCHEMA,
    PretrainConfig,
    check_depth,
    resolve,
    validate,
)
from fedjax_split.run.sites import site_dirs
from fedjax_split.sim.pretrain_rounds import Trainer, run_round, unigram_level
from fedjax_split.sim.pretrain_rounds import evaluate as eval_mlm

STEPS_PER_SEGMENT = 8  # optimiser steps per compiled scan call (a client's last call is padded)
HELDOUT = 0x7FFF_FFFF  # the "client" part of the held-out masks' seed: no client has this id
RoundHook = Callable[[int, dict[str, Any]], None]


@dataclasses.dataclass
class Setup:
    """What a run needs in memory, built before anything is written."""

    config: PretrainConfig
    model_config: Any  # the global model's BertConfig (head "mlm")
    model_dir: Path
    small_layers: int
    truncated_layers: int
    split: Any  # data.text.corpus_split.CorpusSplit, or SitesSplit (--site-data)
    clients: list[int]  # who trains: 0..K-1, or [0] holding all the text (centralised)
    sequences: list[Any]  # per training client: data.text.text_corpora.Sequences
    sizes: list[int]  # per training client: its sequences (the weights; Flower: as nodes report)
    heldout: list[Any]  # masked held-out batches
    masking: Any
    pad_id: int
    trainer: Any
    server_optimizer: Any
    server_state: Any
    schedule: list[int]  # FedBFPT's trained layer per round (index 0 = round 1)
    frozen: frozenset[str]  # --freeze: never trained nor sent


def check(config: PretrainConfig) -> tuple[int, int]:
    """Cheap checks against the model's depth (reads only its config.json): (L_s, k)."""
    validate(config)
    model_config = hf_checkpoint.load_config(hf_checkpoint.resolve_model(config.model.name))
    return check_depth(config, model_config.num_hidden_layers)


def load_split(config: PretrainConfig, tokenizer: Any) -> tuple[Any, Any]:
    """(the corpus' token units, its split): the corpus tokenised, its documents over the
    clients, the held-out documents on none."""
    corpus = text_corpora.load_corpus(config.data.corpus, data_dir=config.data.data_dir)
    units = text_corpora.tokenize_corpus(corpus, tokenizer, config.data.text_mode)
    split = corpus_split.split_corpus(
        corpus.sources,
        scheme=config.data.split,
        num_clients=config.federation.clients,
        seed=config.seed,
        heldout_fraction=config.data.heldout_fraction,
        sigma=config.data.sigma,
        max_documents=config.data.max_documents,
    )
    return units, split


def text_sequences(config: PretrainConfig, tokenizer: Any, units: Any, docs: Any) -> Any:
    """The sequences of documents `docs` (a client's, or the held-out ones)."""
    return text_corpora.sequences(
        units, docs, mode=config.data.text_mode, max_length=config.data.max_length,
        cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id,
        pad_id=tokenizer.pad_token_id,
    )  # fmt: skip


def check_has_text(client: int, seqs: Any, site: bool = False) -> None:
    if seqs.input_ids.shape[0] == 0:
        raise UserError(
            f"site {client} has no text to train on; give it more *.txt text" if site else
            f"client {client} has no text; use more documents or fewer --clients"
        )  # fmt: skip


def heldout_batches(
    config: PretrainConfig, seqs: Any, spec: Any, pad_id: int, site: int | None = None
) -> list[Any]:
    """The masked held-out batches (their masks seeded by the seed alone, or for a site's own
    held-out text by the seed and its client id)."""
    seed = [config.seed, 0, HELDOUT] + ([] if site is None else [int(site)])
    return mlm_batching.eval_batches(
        seqs, batch_size=min(config.client.batch_size, 64), masking=spec, seed=seed, pad_id=pad_id
    )


def site_documents(config: PretrainConfig, client: int, site_dir: Any) -> tuple[Any, Any, Any]:
    """(site `client`'s corpus, its training documents, its held-out documents): the *.txt
    under `site_dir` read as --corpus local reads --data-dir, a problem named by the site. No
    tokenizer: the Flower launcher checks every site with it before it starts a process."""
    try:
        corpus = text_corpora.load_corpus("local", data_dir=site_dir)
        train, held = corpus_split.site_heldout(
            len(corpus), client=client, seed=config.seed,
            heldout_fraction=config.data.heldout_fraction,
        )
    except UserError as err:
        raise UserError(f"site {client} ({site_dir}): {err}") from None
    return corpus, train, held


def site_text(
    config: PretrainConfig, tokenizer: Any, spec: Any, client: int, site_dir: Any
) -> tuple[dict[str, int], Any, list[Any]]:
    """Site `client`'s part of the run, computed where its text lives (its SuperNode, or the
    simulation for every site in turn), from its own files alone: (its counts for split.json,
    its training sequences, its held-out masked batches)."""
    corpus, train, held = site_documents(config, client, site_dir)
    units = text_corpora.tokenize_corpus(corpus, tokenizer, config.data.text_mode)
    seqs = text_sequences(config, tokenizer, units, train)
    check_has_text(client, seqs, site=True)
    held_seqs = text_sequences(config, tokenizer, units, held)
    heldout = heldout_batches(config, held_seqs, spec, int(tokenizer.pad_token_id), site=client)
    return corpus_split.site_counts(train, held), seqs, heldout


def _sites_text(config: PretrainConfig, tokenizer: Any, spec: Any) -> tuple[Any, ...]:
    """--site-data in one process: `_client_text`'s tuple from every site's `site_text` in
    client order; the held-out batches are the sites' own, site 0's first (the order in which
    Flower's server adds up the sites' figures); centralised training holds every site's
    training sequences on one client."""
    dirs = site_dirs(config)
    if not dirs:
        raise UserError(f"--site-data {config.data.site_data}: the simulation reads every site "
                        "itself; pass the sites' directories DIR0,DIR1,...")  # fmt: skip
    parts = [site_text(config, tokenizer, spec, k, d) for k, d in enumerate(dirs)]
    split = corpus_split.SitesSplit(tuple(p[0] for p in parts), config.seed)
    seqs = [p[1] for p in parts]
    heldout = [batch for p in parts for batch in p[2]]
    if config.federation.method == "centralised":
        joined = text_corpora.Sequences(np.concatenate([s.input_ids for s in seqs]),
                                        np.concatenate([s.lengths for s in seqs]))  # fmt: skip
        return split, [0], [joined], heldout
    return split, list(range(len(dirs))), seqs, heldout


def _client_text(config: PretrainConfig, tokenizer: Any, spec: Any) -> tuple[Any, ...]:
    """(the split, the training clients, their sequences, the held-out masked batches): the
    corpus tokenised and cut into sequences, documents over the clients (all of it on one client
    for centralised training), the held-out documents on none; with --site-data, each site's own
    (`_sites_text`)."""
    if config.data.site_data is not None:
        return _sites_text(config, tokenizer, spec)
    units, split = load_split(config, tokenizer)
    make = lambda docs: text_sequences(config, tokenizer, units, docs)  # noqa: E731
    if config.federation.method == "centralised":
        clients, seqs = [0], [make(np.concatenate(split.clients))]
    else:
        clients, seqs = list(range(config.federation.clients)), [make(d) for d in split.clients]
    for c, s in zip(clients, seqs, strict=True):
        check_has_text(c, s)
    heldout = heldout_batches(config, make(split.heldout), spec, tokenizer.pad_token_id)
    return split, clients, seqs, heldout


def load_model(config: PretrainConfig) -> Any:
    """The start model with its MLM head (`hf_checkpoint.Pretrained`)."""
    return hf_checkpoint.load_pretrained(
        config.model.name, num_labels=2, seed=config.seed, dtype=config.runtime.dtype, head="mlm"
    )


def masking_spec(config: PretrainConfig, tokenizer: Any, model_config: Any) -> Any:
    """The MLM masking of `tokenizer`; UserError when its vocabulary outgrows the model's."""
    spec = masking.spec_from_tokenizer(tokenizer, config.data.mlm_probability)
    if spec.vocab_size > model_config.vocab_size:
        raise UserError(
            f"the tokenizer has {spec.vocab_size} tokens, the model's vocabulary "
            f"{model_config.vocab_size}; use the model's own tokenizer"
        )
    return spec


def make_trainer(config: PretrainConfig, model_config: Any) -> Any:
    """What the clients run (`sim.pretrain_rounds.Trainer`), with FedAvg at the server."""
    optimizer = client.default_client_optimizer(config.client.lr, config.client.weight_decay)
    return Trainer(model_config, optimizer, algorithms.server_optimizer("fedavg"))


def build(config: PretrainConfig) -> Setup:
    """Load the text and the model, split, tokenise, initialise. Writes nothing but caches."""
    pre = load_model(config)
    tokenizer = tokenization.load_tokenizer(pre.model_dir)
    spec = masking_spec(config, tokenizer, pre.config)
    split, clients, seqs, heldout = _client_text(config, tokenizer, spec)
    sizes = [int(s.input_ids.shape[0]) for s in seqs]
    return dataclasses.replace(
        model_setup(config, pre, split, clients, sizes),
        sequences=seqs, heldout=heldout, masking=spec, pad_id=int(tokenizer.pad_token_id),
    )  # fmt: skip


def model_setup(
    config: PretrainConfig, pre: Any, split: Any, clients: list[int], sizes: list[int]
) -> Setup:
    """The run's Setup without text (Flower's server holds none): the model, the server state,
    the schedule, --freeze; `split` and `sizes` (each client's sequences) as given."""
    model_cfg, fed = config.model, config.federation
    small, k = check(config)
    # --freeze chooses parameters by their Hugging Face names, as fine-tuning's does
    frozen = (
        roles.paths_where(
            pre.params, roles.name_filter(model_cfg.freeze, hf_checkpoint.tensor_names(pre.config))
        )
        if model_cfg.freeze
        else frozenset()
    )
    if fed.method != "none":  # round 1 trains layer 0 (FedBFPT) or everything
        first = [0] if fed.method == "fedbfpt" else None
        if not layerwise.trained_paths(pre.params, first) - frozen:
            raise UserError(f"--freeze {model_cfg.freeze!r} leaves nothing to train; loosen it")
    trainer = make_trainer(config, pre.config)
    schedule = (
        layerwise.schedule_layers(fed.schedule, fed.rounds, fed.schedule_period)
        if fed.method == "fedbfpt"
        else []
    )
    return Setup(
        config=config, model_config=pre.config, model_dir=Path(pre.model_dir),
        small_layers=small, truncated_layers=k, split=split, clients=clients, sequences=[],
        sizes=list(sizes), heldout=[], masking=None, pad_id=0, trainer=trainer,
        server_optimizer=trainer.server_optimizer,
        server_state=init_server_state(pre.params, trainer.server_optimizer, "float32"),
        schedule=schedule, frozen=frozen,
    )  # fmt: skip


def model_depth(setup: Setup) -> int:
    """Layers of the model the run produces: k for the truncated baseline, else L."""
    if setup.config.federation.method == "truncated":
        return setup.truncated_layers
    return setup.model_config.num_hidden_layers


def final_params(setup: Setup) -> tuple[Any, Any]:
    """(params, BertConfig) of the model the run produces, from the server's state."""
    params = cast_from_wire(setup.server_state.global_params)
    depth = model_depth(setup)
    return layerwise.assemble(params, range(depth)), setup.trainer.depth_config(depth)


def evaluate(setup: Setup) -> dict[str, float]:
    """Held-out MLM loss and masked-token accuracy of the model the run produces."""
    params, config = final_params(setup)
    return eval_mlm(config, params, setup.heldout)


def plan(setup: Setup, r: int) -> Any:
    """Round r's plan: which layers each client runs, which paths they train (--freeze's
    parameters left out)."""
    params = setup.server_state.global_params
    if setup.config.federation.method == "fedbfpt":
        the_plan = layerwise.fedbfpt_plan(
            params, layer=setup.schedule[r - 1], round_=r, clients=setup.clients,
            seed=setup.config.seed, small_layers=setup.small_layers,
            draw=setup.config.federation.layer_draw,
        )  # fmt: skip
    else:
        the_plan = layerwise.full_plan(params, clients=setup.clients, depth=model_depth(setup))
    return the_plan._replace(trained=the_plan.trained - setup.frozen)


def _bytes_of(params: Any, paths: frozenset[str]) -> int:
    return tree_bytes(select(params, paths)[0])


def bert_fl_flops(model_config: Any, segments: Sequence[Any]) -> int:
    """Matmul FLOPs of BERT-FL's client on `segments`: the whole model trained."""
    total = 0
    layers = model_config.num_hidden_layers
    for s in segments:
        real = int(np.sum(np.asarray(s.step_mask) & (np.asarray(s.example_mask).sum(-1) > 0)))
        b, t = s.input_ids.shape[-2:]
        total += real * mlm_train_flops(
            model_config, b, t, s.positions.shape[-1], layers=layers,
            trained_layers=range(layers), embeddings_trained=True,
        )  # fmt: skip
    return total


def client_costs(
    setup: Setup, params: Any, report: Any, bert_fl: int, down: int
) -> dict[str, Any]:
    """One client's line in a round's record (`report`: a pretrain_rounds.ClientReport;
    `bert_fl`: BERT-FL's FLOPs on the same batches)."""
    sends = setup.config.federation.method != "centralised"
    return {
        "client": report.client,
        "layers": list(report.layers),
        "train_loss": report.loss,
        "predicted_tokens": report.tokens,
        "steps": report.steps,
        "seconds": report.seconds,
        "cpu_seconds": report.cpu_seconds,
        "flops": report.flops,
        "bytes_up": report.bytes_up if sends else 0,
        "bytes_down": down if sends else 0,
        # a layer the draw repeats travels once (the client runs its copy twice)
        "bytes_down_full": tree_bytes(layerwise.to_global(
            layerwise.assemble(params, report.layers), report.layers)) if sends else 0,
        "bert_fl_flops": bert_fl,
    }


def client_segments(
    config: PretrainConfig, masking: Any, pad_id: int, seqs: Any, r: int, client: int
) -> list[Any]:
    """Client `client`'s masked batches of round r, wherever it trains (seeded by the seed, the
    round and the client only)."""
    return mlm_batching.train_segments(
        seqs,
        batch_size=config.client.batch_size,
        epochs=config.client.local_epochs,
        steps_per_segment=STEPS_PER_SEGMENT,
        masking=masking,
        seed=[config.seed, r, client],
        pad_id=pad_id,
    )


def round_weights(config: PretrainConfig, sizes: Sequence[int]) -> list[float]:
    """The server mean's weight of each client: its sequences, or 1 (--aggregation unweighted)."""
    if config.federation.aggregation == "weighted":
        return [float(n) for n in sizes]
    return [1.0] * len(sizes)


def bytes_down(setup: Setup, params: Any, r: int) -> int:
    """What a client receives in round r when it keeps the model: the parameters changed last
    round (nothing in round 1: every client starts from the public checkpoint)."""
    return 0 if r == 1 else _bytes_of(params, plan(setup, r - 1).trained)


def run_one_round(setup: Setup, r: int, previous: dict[str, Any] | None,
                  on_progress: Callable[[Any], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Batches, trains and aggregates round r; evaluates when due; the round's record.
    `on_progress`: `sim.pretrain_rounds.run_round`'s (each client's end)."""


    config = setup.config
    t0 = time.perf_counter()
    the_plan = plan(setup, r)
    segments = [
        client_segments(config, setup.masking, setup.pad_id, seqs, r, c)
        for c, seqs in zip(setup.clients, setup.sequences, strict=True)
    ]
    params = setup.server_state.global_params
    outcome = run_round(
        setup.trainer, setup.server_state, the_plan, setup.clients, segments,
        round_weights(config, setup.sizes), seed=config.seed, round_=r, on_progress=on_progress,
    )  # fmt: skip
    setup.server_state = outcome.state
    jax.block_until_ready(setup.server_state.global_params)
    t_train = time.perf_counter()
    down = bytes_down(setup, params, r)
    clients = [
        client_costs(setup, params, rep, bert_fl_flops(setup.model_config, segs), down)
        for rep, segs in zip(outcome.clients, segments, strict=True)
    ]
    due = driver.due(r, config.outputs.eval_every, config.federation.rounds)
    evaluated = evaluate(setup) if due else None
    return round_record(setup, r, previous, params, clients, evaluated,
                        (t0, t_train, time.perf_counter()))  # fmt: skip


def round_record(
    setup: Setup,
    r: int,
    previous: dict[str, Any] | None,
    params: Any,
    clients: list[dict[str, Any]],
    evaluated: dict[str, Any] | None,
    times: tuple[float, float, float],
) -> dict[str, Any]:
    """Round r's record (metrics.jsonl's row) from its clients' lines (`client_costs`) and the
    held-out evaluation (None: not due); `params`: the global model the round started from;
    `times`: (start, training done, evaluation done)."""
    tokens = np.asarray([c["predicted_tokens"] for c in clients], np.float64)
    losses = np.asarray([c["train_loss"] for c in clients], np.float64)
    record: dict[str, Any] = {
        "round": r,
        "layer": setup.schedule[r - 1] if setup.schedule else None,
        "train_loss": float(np.sum(losses * tokens) / max(tokens.sum(), 1.0)),
    }
    if evaluated is not None:
        record.update(evaluated)
    full_bytes = _bytes_of(params, layerwise.trained_paths(params, None))  # BERT-FL's upload
    k = len(setup.clients)
    totals = {
        "bytes_up": sum(c["bytes_up"] for c in clients),
        "bytes_down": sum(c["bytes_down"] for c in clients),
        "bytes_down_full": sum(c["bytes_down_full"] for c in clients),
        "flops": sum(c["flops"] for c in clients),
        "client_seconds": sum(c["seconds"] for c in clients),
        "client_cpu_seconds": sum(c["cpu_seconds"] for c in clients),
        "bert_fl_flops": sum(c["bert_fl_flops"] for c in clients),
        "bert_fl_bytes_up": k * full_bytes,
        "bert_fl_bytes_down": 0 if r == 1 else k * full_bytes,
    }
    record.update(totals)
    for key, value in totals.items():
        record[f"cum_{key}"] = value + (previous[f"cum_{key}"] if previous else 0)
    record["cum_bytes"] = record["cum_bytes_up"] + record["cum_bytes_down"]
    t0, t_train, t_eval = times
    record.update(
        seconds=t_eval - t0, train_seconds=t_train - t0, eval_seconds=t_eval - t_train,
        clients=clients,
    )  # fmt: skip
    return record


def _share(a: float, b: float) -> float | None:
    return None if not b else a / b


def make_summary(setup: Setup, history: Sequence[dict[str, Any]], initial: dict[str, Any],
                 seconds_total: float) -> dict[str, Any]:  # fmt: skip
    """The run at a glance: held-out MLM before and after, costs and their shares of BERT-FL's
    on the same text and rounds (FLOPs and bytes counted; time only across runs, see the study)."""
    last = history[-1] if history else {}
    evaluated = [h for h in history if h.get("mlm_loss") is not None]
    final = (
        {k: evaluated[-1][k] for k in ("mlm_loss", "mlm_accuracy")}
        if evaluated
        else {k: initial[k] for k in ("mlm_loss", "mlm_accuracy")}
    )
    cum = {k: last.get(f"cum_{k}", 0) for k in (
        "bytes_up", "bytes_down", "bytes_down_full", "flops", "client_seconds",
        "client_cpu_seconds", "bert_fl_flops",
        "bert_fl_bytes_up", "bert_fl_bytes_down",
    )}  # fmt: skip
    params, config = final_params(setup)
    fedbfpt = setup.config.federation.method == "fedbfpt"
    return {
        "method": setup.config.federation.method,
        "corpus": setup.config.data.corpus,
        "model": setup.config.model.name,
        "rounds": len(history),
        "clients": len(setup.clients),
        "layers": model_depth(setup),
        "small_layers": setup.small_layers if fedbfpt else None,
        "layer_draw": setup.config.federation.layer_draw if fedbfpt else None,
        "schedule": setup.schedule or None,
        "initial": {k: initial[k] for k in ("mlm_loss", "mlm_accuracy")},
        "unigram": unigram(setup),
        "final": final,
        "train_sequences": list(setup.sizes),
        "heldout_tokens": int(initial.get("predicted_tokens", 0)),
        **{f"cum_{k}": v for k, v in cum.items()},
        "cum_bytes": cum["bytes_up"] + cum["bytes_down"],
        "flops_share_of_bert_fl": _share(cum["flops"], cum["bert_fl_flops"]),
        "bytes_up_share_of_bert_fl": _share(cum["bytes_up"], cum["bert_fl_bytes_up"]),
        "bytes_down_share_of_bert_fl": _share(cum["bytes_down"], cum["bert_fl_bytes_down"]),
        "seconds": float(sum(h["seconds"] for h in history)),
        "train_seconds": float(sum(h["train_seconds"] for h in history)),
        "eval_seconds": float(sum(h["eval_seconds"] for h in history)),
        "wall_seconds_this_process": seconds_total,
        "params": param_count(params),
        "model_config": config.to_hf_dict(),
        "allocator": runtime.allocator(),
        "run_dir": str(setup.config.run_dir),
    }


def unigram(setup: Setup) -> dict[str, float] | None:
    """The held-out text's unigram level (`sim.pretrain_rounds.unigram_level`), beside which a
    start model's masked accuracy says whether it is a contextual masked LM; None where the
    held-out text is not here (Flower's nodes hold it)."""
    if not setup.heldout:
        return None
    level = unigram_level(setup.heldout)
    return {k: level[k] for k in ("unigram_loss", "unigram_accuracy")}


def mismatch(saved: dict[str, Any], config: PretrainConfig) -> list[str]:
    """The settings of a saved run that differ from `config`'s and would change its results on
    --resume. A FedBFPT run saved before --layer-draw existed drew its deeper layers without
    replacement ("distinct"), so it resumes with that draw only (the other methods draw none)."""
    if saved.get("method") == "fedbfpt" and config.federation.method == "fedbfpt":
        saved = {"layer_draw": "distinct", **saved}
    elif config.federation.method != "fedbfpt":
        saved = {k: v for k, v in saved.items() if k != "layer_draw"}
    return SCHEMA.trajectory_mismatch(saved, config)


def method_line(setup: Setup) -> str:
    """The further pre-training method as a person says it, for the run's first line."""
    fed, big_l = setup.config.federation, setup.model_config.num_hidden_layers
    method = fed.method
    layers = "layer" if setup.truncated_layers == 1 else "layers"
    return {
        "fedbfpt": f"FedBFPT: each client trains a {setup.small_layers}-layer model, one encoder "
        f"layer of {big_l} + the MLM head a round (deeper layers drawn "
        f"{'with' if fed.layer_draw == 'replacement' else 'without'} replacement); "
        "the server averages what was trained",
        "bert-fl": f"BERT-FL: FedAvg of the whole {big_l}-layer model and its MLM head",
        "centralised": f"centralised: one client holds all the text and trains all {big_l} layers",
        "truncated": f"truncated: FedAvg of the first {setup.truncated_layers} {layers} of "
        f"{big_l}, trained whole",
        "none": "no further pre-training: the start model, evaluated",
    }.get(method, method)


class Pretraining:
    """Further pre-training's `driver.Run`: the server state and the held-out evaluation before
    round 1; the model is written to `model/` at the end."""

    def __init__(self, setup: Setup, started: float) -> None:
        self.setup = setup
        self.run_dir = setup.config.run_dir
        fed = setup.config.federation
        self.rounds = 0 if fed.method == "none" else fed.rounds
        self.metric = "mlm_accuracy"
        self.initial: dict[str, Any] | None = None  # held-out MLM before round 1
        self.started = started
        self.progress: Any = None  # run.outputs.Progress, from the driver (`watch`)

    def watch(self, progress: Any) -> None:
        self.progress = progress

    def arrays(self) -> dict[str, Any]:
        return {"server_state": self.setup.server_state}

    def meta(self) -> dict[str, Any]:
        setup = self.setup
        return {
            "seed": setup.config.seed,
            "split": setup.split.to_dict(),
            "model_config": setup.model_config.to_hf_dict(),
            "model_dir": str(setup.model_dir),
            "initial": self.initial,
        }

    def resume(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        if meta.get("split") != self.setup.split.to_dict():
            raise UserError(
                "--resume: the text or its split differ from the checkpoint's; use the same "
                "--data-dir/--site-data/--max-documents/--seed or another --output-dir"
            )
        self.setup.server_state = arrays["server_state"]
        self.initial = meta["initial"]

    def start(self, start_round: int, note: Callable[[str], None]) -> None:
        setup, config = self.setup, self.setup.config
        outputs.write_json(self.run_dir / "split.json", setup.split.to_dict())
        note(method_line(setup))
        sizes = list(setup.sizes)
        note(
            f"{config.data.corpus}: {config.federation.method}, {len(setup.clients)} client(s) "
            f"with {sizes} "
            f"sequences of {config.data.max_length} tokens, {setup.model_config.num_hidden_layers}"
            f"-layer model" + (f", small models of {setup.small_layers} layers, layers by round "
                               f"{setup.schedule}" if setup.schedule else "")
            + (f"; resuming after round {start_round}" if start_round else "")
        )  # fmt: skip
        if self.initial is None:
            self.initial = self.evaluate()
            level = unigram(setup)
            beside = "" if level is None else (
                f" (the unigram level: loss {level['unigram_loss']:.4f}, accuracy "
                f"{level['unigram_accuracy']:.4f})")  # fmt: skip
            note(f"before: held-out MLM loss {self.initial['mlm_loss']:.4f}, "
                 f"accuracy {self.initial['mlm_accuracy']:.4f}{beside}")  # fmt: skip

    def evaluate(self) -> dict[str, Any]:
        """The held-out evaluation of the model as it stands (before round 1, here)."""
        return evaluate(self.setup)

    def step(self, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        # a round training other layers compiles its own programs again
        what = "the clients' programs (and again for each new set of trained layers)"
        hook = None if self.progress is None else self.progress.training(what)
        return run_one_round(self.setup, r, history[-1] if history else None, hook)

    def checkpointed(self, r: int, kept: Sequence[int]) -> None:
        pass  # clients keep nothing between rounds: the checkpoint is the whole state

    def summary(self, history: Sequence[dict[str, Any]], stats: Any) -> dict[str, Any]:
        params, model_config = final_params(self.setup)
        save_pretrained(params, model_config, self.run_dir / "model",
                        tokenizer_dir=self.setup.model_dir)  # fmt: skip
        return make_summary(self.setup, history, self.initial,
                            time.perf_counter() - self.started)  # fmt: skip


def run_pretraining(
    config: PretrainConfig | dict[str, Any],
    *,
    progress: bool = True,
    on_round_end: RoundHook | None = None,
) -> dict[str, Any]:
    """Run (or with --resume, continue) one further pre-training run; returns the summary.
    Everything a user can get wrong is checked before the first byte is written."""
    started = time.perf_counter()
    if isinstance(config, dict):
        config = resolve(overrides=config)
    check(config)
    runtime.apply()  # before the first JAX computation
    saved = config.outputs
    driver.check_run_dir(config.run_dir, saved.resume, lambda old: mismatch(old, config),
                         output_names=["model"])  # fmt: skip
    run = Pretraining(build(config), started)
    return driver.drive(run, config.to_dict(), resume=saved.resume,
                        checkpoint_every=saved.checkpoint_every, progress=progress,
                        on_round_end=on_round_end)  # fmt: skip
