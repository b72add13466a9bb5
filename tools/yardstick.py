"""The rotten-tomatoes round of docs/performance.md as a new user runs it, against a plain
PyTorch loop over the same clients, in one process, with utilisation against this machine's
measured fp32 matmul peak.

    python tools/yardstick.py --config configs/offline_rotten_tomatoes.py --clients 10 \
        --local-epochs 1 --max-examples 2000 --rounds 3 --out runs/yardstick.json

Ours: `run_experiment`'s rounds (`experiment.build` + `Simulation.step`) with the defaults a user
gets, each round with its evaluation of every client; the first round (compilation, or loading
it from the XLA cache) is reported apart from the steady rounds (their median).
PyTorch: transformers' BertForSequenceClassification from the same checkpoint, the same sampled
clients each round with the same mini-batches (the same examples in each step, padded to the
longest in the batch, as a DataCollatorWithPadding loop does), AdamW afresh each round, dropout
on; each client's local part kept apart and loaded with the global part before it trains; the
global part averaged by examples; then every client's test batches (the same ones) scored. Its
steady round is the last of `--torch-rounds`.
MFU: model matmul FLOPs (fedjax_split.models.flops) of the examples trained, each at its own
length (3 forward passes: forward and backward), plus those evaluated (one forward pass), per
second of a steady round, over the best fp32 jitted matmul rate measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _flops(setup: Any, sampled: list[int]) -> tuple[int, int]:
    """(training, evaluation) model FLOPs of one round: each example at its own length."""
    from fedjax_split.models import flops

    config, lengths = setup.model.config, setup.pool.tokenized.lengths
    epochs = setup.config.client.local_epochs
    train = sum(
        epochs * flops.train_step_flops(config, 1, int(n))
        for i in sampled
        for n in lengths[setup.partition.clients[i].train]
    )
    tests = [n for c in setup.partition.clients for n in lengths[c.test]]
    evaluate = sum(flops.forward_flops(config, 1, int(n)) for n in tests)
    return train, evaluate


def ours(config: Any, rounds: int) -> tuple[Any, list[dict[str, Any]]]:
    """The experiment's own rounds, as run_experiment runs them (what a round writes, its client
    store and plot, goes to a temporary directory)."""
    from fedjax_split import runtime
    from fedjax_split.run import experiment
    from fedjax_split.run.settings import replaced
    from fedjax_split.sim.client_store import ClientStore

    runtime.apply(config.runtime.cpu_devices)
    scratch = Path(tempfile.mkdtemp(prefix="yardstick-"))
    setup = experiment.build(replaced(config, output_dir=str(scratch)))
    store = ClientStore.create(scratch / "clients", setup.model.local0)
    simulation = experiment.Simulation(setup, store)
    history: list[dict[str, Any]] = []
    for r in range(1, rounds + 1):
        history.append(simulation.step(r, history))
        rec = history[-1]
        print(f"ours round {r}: {rec['seconds']:.1f} s (eval {rec['eval_seconds']:.1f} s), "
              f"accuracy {rec.get('accuracy', float('nan')):.4f}", file=sys.stderr, flush=True)
    return setup, history


def torch_rounds(setup: Any, rounds: int) -> list[float]:
    """Seconds of each round of the plain PyTorch loop over the same clients and batches."""
    import torch
    import transformers

    from fedjax_split.run import experiment
    from fedjax_split.sim import rounds as rounds_mod

    config, c = setup.config, setup.model.critical_layer
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(setup.model.model_dir), num_labels=2
    )
    prefixes = ("bert.embeddings.",) + tuple(f"bert.encoder.layer.{i}." for i in range(c))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    global_sd = {k: v for k, v in state.items() if k.startswith(prefixes)}
    local_sd = [{k: v.clone() for k, v in state.items() if not k.startswith(prefixes)}
                for _ in range(config.federation.clients)]  # fmt: skip
    packed, labels = setup.pool.tokenized, setup.pool.labels

    def batch(rows: np.ndarray) -> dict[str, torch.Tensor]:
        rows = rows[rows >= 0]
        n = packed.lengths[rows]
        t = int(n.max())
        ids = np.zeros((rows.size, t), np.int64)
        types = np.zeros((rows.size, t), np.int64)
        mask = np.zeros((rows.size, t), np.int64)
        for j, (e, k) in enumerate(zip(rows, n, strict=True)):
            start = packed.offsets[e]
            ids[j, :k] = packed.input_ids[start : start + k]
            types[j, :k] = packed.token_type_ids[start : start + k]
            mask[j, :k] = 1
        return {"input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
                "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels[rows].astype(np.int64))}  # fmt: skip

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    seconds = []
    for r in range(1, rounds + 1):
        steps = experiment.round_batches(setup, r)  # the same examples in each step as ours
        fed = config.federation
        sampled = rounds_mod.sample_clients(fed.clients, fed.sampled_clients, config.seed, r)
        t0 = time.perf_counter()
        total = {k: torch.zeros_like(v) for k, v in global_sd.items()}
        weights = 0.0
        for i, own in zip(sampled, steps, strict=True):
            model.load_state_dict({**global_sd, **local_sd[i]})
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                     {"params": no_decay, "weight_decay": 0.0}],
                                    lr=config.client.lr, fused=True)  # fmt: skip
            model.train()
            for step in own:
                opt.zero_grad(set_to_none=True)
                model(**batch(np.asarray(step.example_index).reshape(-1))).loss.backward()
                opt.step()
            sd = model.state_dict()
            local_sd[i] = {k: sd[k].detach().clone() for k in local_sd[i]}
            n_i = float(len(setup.partition.clients[i].train))
            for k in total:
                total[k] += n_i * sd[k].detach()
            weights += n_i
        global_sd = {k: v / weights for k, v in total.items()}
        model.eval()
        with torch.no_grad():
            for i, own in enumerate(setup.eval_batches):
                model.load_state_dict({**global_sd, **local_sd[i]})
                for step in own:
                    model(**{k: v for k, v in batch(
                        np.asarray(step.example_index).reshape(-1)).items() if k != "labels"})
        seconds.append(time.perf_counter() - t0)
        print(f"torch round {r}: {seconds[-1]:.1f} s", file=sys.stderr, flush=True)
    return seconds


def run(argv: list[str] | None = None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from benchmark import measure_peak

    from fedjax_split import runtime
    from fedjax_split.run.config import resolve_config
    from fedjax_split.run.settings import load_config_file

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/offline_rotten_tomatoes.py")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--critical-layer", type=int, default=3)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--max-examples", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-rounds", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                   help="other settings, e.g. cpu_devices=2 packing=false")  # fmt: skip
    p.add_argument("--out")
    args = p.parse_args(argv)
    extra = {}
    for item in args.set:
        name, _, value = item.partition("=")
        extra[name] = json.loads(value) if value not in ("", None) else None
    config = resolve_config(
        load_config_file(args.config),
        {"clients": args.clients, "critical_layer": args.critical_layer,
         "local_epochs": args.local_epochs, "max_examples": args.max_examples,
         "batch_size": args.batch_size, "rounds": args.rounds, **extra},
    )  # fmt: skip
    setup, history = ours(config, args.rounds)
    peak = measure_peak(jnp.float32)
    steady = [h["seconds"] for h in history[1:]] or [history[0]["seconds"]]
    sampled = history[-1]["clients_sampled"]
    train_flops, eval_flops = _flops(setup, sampled)
    torch_s = torch_rounds(setup, args.torch_rounds)
    ours_s = statistics.median(steady)
    import torch

    result = {
        "command": " ".join(["python", "tools/yardstick.py", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "allocator": runtime.allocator()},
        "config": config.to_dict(),
        "peak": peak,
        "ours": {"first_round_s": history[0]["seconds"], "steady_round_s": ours_s,
                 "rounds_s": [h["seconds"] for h in history],
                 "eval_s": [h["eval_seconds"] for h in history],
                 "accuracy": [h.get("accuracy") for h in history]},
        "torch": {"rounds_s": torch_s, "steady_round_s": torch_s[-1]},
        "speedup_vs_torch": torch_s[-1] / ours_s,
        "model_flops": {"train": train_flops, "eval": eval_flops},
        "mfu": (train_flops + eval_flops) / ours_s / peak["flops_per_s"],
        "torch_mfu": (train_flops + eval_flops) / torch_s[-1] / peak["flops_per_s"],
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    out = run()
    print(json.dumps({k: out[k] for k in ("ours", "torch", "speedup_vs_torch", "mfu", "torch_mfu",
                                          "peak")}, indent=1))  # fmt: skip
