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

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from fedjax_split import runtime
from fedjax_split.data.text import mlm_batching
from fedjax_split.errors import UserError
from fedjax_split.fed import layerwise
from fedjax_split.fed.roles import select
from fedjax_split.fed.strategy import RoundPlan
from fedjax_split.fed.wire import param_count, tree_bytes
from fedjax_split.models.flops import mlm_train_flops
from fedjax_split.models.hf_checkpoint import save_pretrained
from fedjax_split.run import driver, outputs
from fedjax_split.run.pretrain_config import (
    SCHEMA,
    PretrainConfig,
    resolve,
)
from fedjax_split.run.pretrain_setup import Setup, build, check, final_params, model_depth
from fedjax_split.sim.pretrain_rounds import evaluate as eval_mlm
from fedjax_split.sim.pretrain_rounds import run_round, unigram_level

STEPS_PER_SEGMENT = 8  # optimiser steps per compiled scan call (a client's last call is padded)
RoundHook = Callable[[int, dict[str, Any]], None]


def evaluate(setup: Setup) -> dict[str, float]:
    """Held-out MLM loss and masked-token accuracy of the model the run produces."""
    params, config = final_params(setup)
    return eval_mlm(config, params, setup.heldout)


def plan(setup: Setup, r: int) -> RoundPlan:
    """Round r's plan (`run.pretrain_setup.strategy`): the clients, which layers each runs, the
    paths they train and send (--freeze's parameters left out)."""
    return setup.strategy.plan(r, setup.server_state, None)


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
        setup.trainer, setup.strategy, setup.server_state, the_plan, segments,
        round_weights(config, setup.sizes), seed=config.seed, on_progress=on_progress,
    )  # fmt: skip
    setup.server_state = outcome.state
    jax.block_until_ready(setup.server_state.global_params)
    t_train = time.perf_counter()
    down = bytes_down(setup, params, r)
    kept = counted(r, [rep.client for rep in outcome.clients], outcome.rejected, diverged=True)
    clients = [
        client_costs(setup, params, rep, bert_fl_flops(setup.model_config, segs), down)
        for rep, segs in zip(outcome.clients, segments, strict=True)
        if rep.client in kept
    ]
    due = driver.due(r, config.outputs.eval_every, config.federation.rounds)
    evaluated = evaluate(setup) if due else None
    record = round_record(setup, r, previous, params, clients, evaluated,
                          (t0, t_train, time.perf_counter()))  # fmt: skip
    record["clients_rejected"] = outcome.rejected  # uploads left out: not finite
    return record


def counted(
    r: int, clients: Sequence[int], rejected: Sequence[int], *, diverged: bool
) -> list[int]:
    """The clients of round r whose upload the server's step took (a rejected one has no line in
    the record). None left: a UserError, since the model did not move; `diverged`: every
    client trained here and none stayed finite (the simulation's case, where --resume would
    repeat it), else the federation's (nodes failed or sent bad uploads)."""
    kept = [c for c in clients if c not in set(rejected)]
    if kept:
        return kept
    if diverged:
        raise UserError(
            f"round {r}: every client's update was not finite (training diverged); start again "
            "with a lower --lr"
        )
    raise UserError(
        f"round {r}: no client's upload was taken ({len(rejected)} rejected); check the "
        "SuperNodes, then continue with --resume"
    )


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
    outputs = config.outputs
    driver.check_run_dir(config.run_dir, outputs.resume, lambda old: mismatch(old, config),
                         output_names=["model"])  # fmt: skip
    run = Pretraining(build(config), started)
    return driver.drive(run, config.to_dict(), resume=outputs.resume,
                        checkpoint_every=outputs.checkpoint_every, progress=progress,
                        on_round_end=on_round_end)  # fmt: skip
