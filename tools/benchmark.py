"""Benchmark of federated rounds: the vmapped round against the same clients one at a time and
against a step-by-step Python loop, with utilisation against this machine's measured matmul peak.

    python tools/benchmark.py --model minilm-l6 --clients 10 --batch-size 16 \
        --lengths rotten_tomatoes --out runs/bench/minilm_k10.json
    python tools/benchmark.py --model bert-base-random --clients 10 --batch-size 32 --lengths 128

Definitions (all in the JSON):
- peak: the best fp32 (CPU) or bf16 (GPU) FLOP/s of large square jitted matmuls, measured in the
  same process just before the rounds.
- model FLOPs: matmul FLOPs (fedjax_split.models.flops) of the examples actually trained, each at
  its own length; hardware FLOPs: the same for every computed position (padding, masked steps
  included).
  MFU = model FLOP/s / peak; HFU = hardware FLOP/s / peak.
- padding waste: share of computed token positions that are padding.
- seconds per round: steady state (median over --repeats), compilation reported apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.data import batching, stacking
from fedjax_split.data.batch import apply_batch
from fedjax_split.errors import UserError, report
from fedjax_split.fed import client, server_optimizers
from fedjax_split.fed.client_program import client_round
from fedjax_split.fed.roles import merge_params, split_params
from fedjax_split.models import flops
from fedjax_split.models.bert import init_params, make_apply
from fedjax_split.models.bert_config import (
    ATTENTION_IMPLEMENTATIONS,
    BertConfig,
    Compute,
    check_attention,
)
from fedjax_split.runtime import allocator, tune_malloc, use_cpu_devices
from fedjax_split.sim import rounds
from fedjax_split.tasks.objectives import CLASSIFICATION


def _seconds(fn, repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of `fn`, each waited on to completion."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def measure_peak(dtype: Any, sizes: tuple[int, ...] = (1024, 2048, 3072), repeats: int = 5) -> dict:
    """Best matmul FLOP/s over square sizes (jitted, inputs on device, timed after warm-up)."""
    best = {"flops_per_s": 0.0}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        mm = jax.jit(lambda x, y: x @ y)
        mm(a, b).block_until_ready()
        rate = 2 * n**3 / min(_seconds(functools.partial(mm, a, b), repeats))
        if rate > best["flops_per_s"]:
            best = {"flops_per_s": rate, "n": n, "dtype": jnp.dtype(dtype).name}
    return best


def peak_sizes(args: argparse.Namespace) -> tuple[int, ...]:
    """--peak-sizes, by default sizes that reach the device's peak: on an H200 a 3072 matmul
    reaches 292 TFLOP/s of bf16, an 8192 one about 790 (docs/benchmarks.md, GPU)."""
    if args.peak_sizes:
        return args.peak_sizes
    return (1024, 2048, 3072) if jax.default_backend() == "cpu" else (2048, 4096, 8192)


def compute_dtype(args: argparse.Namespace) -> str:
    """--dtype, by default bf16 on a GPU and fp32 elsewhere (whose matmul peak is measured)."""
    return args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")


def model_config(
    name: str, num_labels: int, dtype: str, attention: str = "xla"
) -> tuple[BertConfig, Any]:
    """Config and parameters: the real MiniLM weights, or a random config of the named size."""
    if name == "minilm-l6":
        from fedjax_split.models.hf_checkpoint import load_pretrained

        pre = load_pretrained("minilm-l6", num_labels=num_labels, dtype=dtype, attention=attention)
        return pre.config, pre.params
    shapes = {
        "bert-base-random": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072),
        "minilm-random": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                              intermediate_size=1536),
        "tiny": dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64),
    }  # fmt: skip
    if name not in shapes:
        raise UserError(f"unknown --model {name!r}; use minilm-l6 or one of {sorted(shapes)}")
    config = BertConfig(num_labels=num_labels, compute=Compute(dtype, attention), **shapes[name])
    return config, init_params(config, jax.random.key(0))


def client_lengths(
    spec: str, num_clients: int, per_client: int, max_length: int
) -> list[np.ndarray]:
    """Token lengths of each client's examples: real rotten-tomatoes lengths, or a fixed length."""
    rng = np.random.default_rng([0, 7])
    if spec.isdigit():
        return [np.full(per_client, int(spec), np.int32) for _ in range(num_clients)]
    if spec != "rotten_tomatoes":
        raise UserError(f"unknown --lengths {spec!r}; use rotten_tomatoes or a number like 128")
    from fedjax_split.data.sources import load_examples
    from fedjax_split.data.tokenization import load_tokenizer, tokenize
    from fedjax_split.tasks.registry import get_task

    ex = load_examples(get_task("rotten_tomatoes"))
    pick = rng.choice(len(ex.texts_a), size=num_clients * per_client, replace=False)
    tok = tokenize(
        load_tokenizer("minilm-l6"), [ex.texts_a[i] for i in pick], max_length=max_length
    )
    return list(np.asarray(tok.lengths, np.int32).reshape(num_clients, per_client))


def synthetic_tokens(lengths: list[np.ndarray], vocab: int) -> Any:
    """Ragged token ids of the given lengths ([CLS]=101 first), shaped like tokenize's output."""
    from fedjax_split.data.tokenization import Tokenized

    rng = np.random.default_rng([0, 11])
    flat = np.concatenate(lengths)
    ids = [np.concatenate([[min(101, vocab - 1)], rng.integers(1000 % vocab, vocab, n - 1)]).astype(
        np.int32) for n in flat]  # fmt: skip
    return Tokenized(ids, [np.zeros(n, np.int32) for n in flat], flat.astype(np.int32))


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first-call seconds including compilation, median steady-state seconds)."""
    (first,) = _seconds(fn, 1)
    return first, statistics.median(_seconds(fn, repeats))


def run(args: argparse.Namespace) -> dict:
    backend = jax.default_backend()
    dtype = compute_dtype(args)
    peak = measure_peak(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32, peak_sizes(args))
    config, params = model_config(args.model, 2, dtype, args.attention)
    apply = make_apply(config)
    lengths = client_lengths(args.lengths, args.clients, args.examples_per_client, args.max_length)
    tokens = synthetic_tokens(lengths, config.vocab_size)
    offsets = np.cumsum([0] + [len(x) for x in lengths])
    clients_ix = [np.arange(offsets[i], offsets[i + 1]) for i in range(args.clients)]
    labels = np.random.default_rng([0, 13]).integers(0, 2, offsets[-1])
    # the run's one shape (W, N) from the pool, as a run chooses it
    how = batching.resolved(tokens, batching.Batching(
        batch_size=args.batch_size, bucketing=args.bucketing, packing=args.packing))
    parts = [  # [client][step]: each client's own steps, built from its examples alone
        batching.client_batches(tokens, ix, labels, how, epochs=args.local_epochs, seed=0,
                                client_id=i)  # fmt: skip
        for i, ix in enumerate(clients_ix)
    ]
    segments = stacking.stack_clients(parts)  # what the vmapped round computes
    skipped = args.chunk_size == 1  # clients one at a time: each computes only its own steps
    computed = [p for ps in parts for p in ps] if skipped else segments
    waste = batching.padding_waste(computed, skip_masked_steps=skipped)
    c = config.num_hidden_layers if args.critical_layer is None else args.critical_layer
    g, local = split_params(params, critical_layer=c)
    opt = client.default_client_optimizer(2e-5)
    cspec = client.ClientSpec(apply=apply, objective=CLASSIFICATION, optimizer=opt)
    server_opt = server_optimizers.fedavg()
    spec = rounds.RoundSpec(
        client=cspec, server_optimizer=server_opt, chunk_size=args.chunk_size, donate=False
    )
    state = rounds.init_server_state(g, server_opt, "float32")
    locals_k = rounds.replicate(local, args.clients)
    n_i = np.array([len(ix) for ix in clients_ix], np.float32)
    own_steps = [[jax.tree.map(jnp.asarray, s.for_training()) for s in ps] for ps in parts]
    rng = jax.random.key(0)

    def vmapped():
        return rounds.run_round(spec, state, locals_k, n_i, own_steps, rng)[:2]

    compile_s, round_s = timed(vmapped, args.repeats)
    if args.skip_baselines:
        seq_compile_s = seq_s = step_compile_s = step_s = float("nan")
        per_client = []

    # The same clients one after another (client_program.client_round: each client's own steps, one
    # jitted program per step shape), on one device.
    alone = dataclasses.replace(spec, chunk_size=1, devices=tuple(jax.local_devices()[:1]))
    per_client = own_steps

    def sequential():
        outs = [
            client_round(alone, state.global_params, jax.tree.map(lambda x, i=i: x[i], locals_k),
                         pc, jax.random.key(i))  # fmt: skip
            for i, pc in enumerate(per_client)
        ]
        return jax.tree.map(lambda *x: sum(x), *[o[0] for o in outs])

    if not args.skip_baselines:
        seq_compile_s, seq_s = timed(sequential, max(1, args.repeats // 2))

    # Step by step from Python: one jitted optimiser step per batch (the naive loop).
    @jax.jit
    def step(p, o, batch, key):
        def loss(p):
            logits = apply_batch(apply, p, batch, train=True, rng=key)
            total, n = CLASSIFICATION.loss_sums(logits, batch.labels, batch.example_mask)
            return total / jnp.maximum(n, 1.0)

        grads = jax.grad(loss)(p)
        updates, o = opt.update(grads, o, p)
        return jax.tree.map(lambda a, b: a + b, p, updates), o

    def stepwise():
        out = None
        for i, pc in enumerate(per_client):
            p = merge_params(g, local)
            o = opt.init(p)
            for s in pc:
                for j in range(s.step_mask.shape[0]):
                    batch = jax.tree.map(lambda v, j=j: v[j], s.replace(step_mask=None))
                    p, o = step(p, o, batch, jax.random.fold_in(jax.random.key(i), int(j)))
            out = p
        return out

    if not args.skip_baselines:
        step_compile_s, step_s = timed(stepwise, max(1, args.repeats // 2))

    model_flops = sum(flops.train_step_flops(config, 1, int(n)) for x in lengths for n in x)
    model_flops *= args.local_epochs
    hw_flops = sum(flops.segment_train_flops(config, s, skipped) for s in computed)
    real_tokens = int(sum(int(x.sum()) for x in lengths)) * args.local_epochs
    mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if backend == "gpu":
        mem = jax.devices()[0].memory_stats().get("peak_bytes_in_use", mem)
    return {
        "command": " ".join(["python", "tools/benchmark.py"] + sys.argv[1:]),
        "machine": {"backend": backend, "device": str(jax.devices()[0].device_kind),
                    "cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "allocator": allocator(),
                   "round_devices": len(rounds.round_devices(spec))},
        "config": {"model": args.model, "clients": args.clients, "batch_size": args.batch_size,
                   "examples_per_client": args.examples_per_client, "lengths": args.lengths,
                   "local_epochs": args.local_epochs, "critical_layer": c, "dtype": dtype,
                   "attention": args.attention,
                   "chunk_size": args.chunk_size, "bucketing": args.bucketing,
                   "packing": args.packing,
                   "segment_shapes": [list(s.input_ids.shape) for s in segments]},
        "peak": peak,
        "round": {"compile_s": compile_s - round_s, "seconds": round_s,
                  "tokens_per_s": real_tokens / round_s,
                  "model_flops_per_s": model_flops / round_s, "mfu": model_flops / round_s / peak[
                      "flops_per_s"], "hfu": hw_flops / round_s / peak["flops_per_s"]},
        "sequential": {"compile_s": seq_compile_s - seq_s, "seconds": seq_s},
        "stepwise": {"compile_s": step_compile_s - step_s, "seconds": step_s},
        "speedup_vs_sequential": seq_s / round_s,
        "speedup_vs_stepwise": step_s / round_s,
        "padding_waste": waste,
        "real_tokens": real_tokens,
        "model_flops": model_flops,
        "hardware_flops": hw_flops,
        "peak_memory_bytes": int(mem),
    }  # fmt: skip


def _step_problem(args: argparse.Namespace) -> tuple[BertConfig, Any, Any, Any, str]:
    """One client batch of `--batch-size` x `--profile-length` tokens: (config, params,
    loss(params, train, key), the client optimiser, compute dtype)."""
    dtype = compute_dtype(args)
    config, params = model_config(args.model, 2, dtype, args.attention)
    apply = make_apply(config)
    b, t = args.batch_size, args.profile_length
    ids = jnp.full((b, t), 2000 % config.vocab_size, jnp.int32)
    ones, zeros = jnp.ones((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32)
    labels = jnp.zeros((b,), jnp.int32)

    def loss(p, train, k=None):
        logits = apply(p, ids, ones, zeros, train=train, rng=k)
        return CLASSIFICATION.unit_losses(logits, labels).mean()

    return config, params, loss, client.default_client_optimizer(2e-5), dtype


def profile_step(args: argparse.Namespace) -> dict:
    """Milliseconds of the pieces of one client step (forward, backward with and without dropout,
    the optimiser update), each jitted on its own: where a training step's time goes."""
    config, params, loss, opt, dtype = _step_problem(args)
    b, t = args.batch_size, args.profile_length
    key = jax.random.key(0)

    def best_ms(f, *a, n=5):
        _seconds(lambda: f(*a), 1)  # warm-up and compilation
        return 1e3 * min(_seconds(lambda: f(*a), n))

    grads = jax.grad(loss)(params, False)
    state = opt.init(params)

    def full(p, o, k):
        u, o = opt.update(jax.grad(loss)(p, True, k), o, p)
        return jax.tree.map(lambda a, c: a + c, p, u), o

    pieces = {
        "forward": best_ms(jax.jit(lambda p: loss(p, False)), params),
        "forward_backward_no_dropout": best_ms(jax.jit(jax.grad(lambda p: loss(p, False))), params),
        "forward_backward_dropout": best_ms(jax.jit(jax.grad(lambda p, k: loss(p, True, k))),
                                            params, key),
        "optimizer_update": best_ms(jax.jit(lambda g, o, p: opt.update(g, o, p)), grads, state,
                                    params),
        "full_step": best_ms(jax.jit(full), params, state, key),
    }  # fmt: skip
    peak = measure_peak(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32, peak_sizes(args))
    fwd = flops.forward_flops(config, b, t)
    rates = {
        "forward": fwd,
        "forward_backward_no_dropout": 3 * fwd,
        "forward_backward_dropout": 3 * fwd,
        "full_step": 3 * fwd,
    }
    out = {
        "batch": b, "length": t, "model": args.model, "allocator": allocator(), "peak": peak,
        "ms": pieces,
        "share_of_peak": {k: v / (pieces[k] / 1e3) / peak["flops_per_s"] for k, v in rates.items()},
    }  # fmt: skip
    if args.torch_reference:
        ref = torch_reference(config, b, t, peak_sizes(args))
        ref["share_of_peak"] = {
            k: rates[k] / (ms / 1e3) / peak["flops_per_s"] for k, ms in ref["ms"].items()
        }
        out["torch"] = ref
    return out


def torch_reference(
    config: BertConfig, b: int, t: int, peak_sizes: tuple[int, ...], repeats: int = 5
) -> dict:
    """The same client step in PyTorch: transformers' BertForSequenceClassification of the same
    shape (random weights: the work does not depend on them), train mode with dropout, torch's
    fused AdamW, the same inputs. What a mature CPU framework makes of this machine, as a yardstick
    for our step; torch's own fp32 matmul peak is measured too. Timed as ours: best of `repeats`
    after warm-up, for the step and the peak alike."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise UserError(f"--torch-reference needs torch ({e}); pip install -e '.[test]'") from e

    torch.manual_seed(0)
    hf = transformers.BertConfig(**config.to_hf_dict())
    net = transformers.BertForSequenceClassification(hf)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-5, weight_decay=0.01, fused=True)
    ids = torch.full((b, t), 2000 % config.vocab_size, dtype=torch.long)
    ones, zeros = torch.ones((b, t), dtype=torch.long), torch.zeros((b, t), dtype=torch.long)
    labels = torch.zeros((b,), dtype=torch.long)

    def forward():
        net.eval()
        with torch.no_grad():
            net(input_ids=ids, attention_mask=ones, token_type_ids=zeros)

    def full_step():
        net.train()
        opt.zero_grad(set_to_none=True)
        net(input_ids=ids, attention_mask=ones, token_type_ids=zeros, labels=labels).loss.backward()
        opt.step()

    def best_ms(f):
        for _ in range(3):
            f()  # warm-up
        return 1e3 * min(_seconds(f, repeats))  # torch returns when done: nothing to wait on

    peak = 0.0
    for n in peak_sizes:
        x, y = torch.randn(n, n), torch.randn(n, n)
        peak = max(peak, 2 * n**3 / (best_ms(lambda x=x, y=y: x @ y) / 1e3))
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "attention": hf._attn_implementation,
        "parameters": sum(x.numel() for x in net.parameters()),
        "ms": {"forward": best_ms(forward), "full_step": best_ms(full_step)},
        "own_peak_flops_per_s": peak,
    }


_OP_FLAG = "--xla_cpu_enable_xprof_traceme=true"  # XLA:CPU then traces every op it runs


def op_breakdown(events: list[dict], hlo_text: str, steps: int) -> dict:
    """Milliseconds per step of a compiled step's ops, by phase (forward / backward / optimizer,
    from each op's jax op_name) and kind (matmul: dot or YNNPACK fusion; elementwise: the rest),
    from the op events of a profiler trace (perfetto JSON) of `steps` steps of `hlo_text`.
    Ops that run at the same time both count, and a loop's time also holds the ops it runs (the
    dropout hashes), so the sum can exceed the wall time."""
    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*op_name=\"([^\"]*)\"", line)
        if m:
            names[m.group(1)] = m.group(2)
    table: dict[str, float] = {}
    ops: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name not in names:
            continue
        op_name = names[name]
        phase = ("backward" if "transpose(jvp(" in op_name else
                 "forward" if "jvp(" in op_name else "optimizer")  # fmt: skip
        if name.startswith(("dot", "ynn_fusion")):
            kind = "matmul"
        elif name.startswith(("while", "call", "conditional")):
            kind = "loop"
        else:
            kind = "elementwise"
        ms = e.get("dur", 0) / 1e3 / steps
        table[f"{phase} {kind}"] = table.get(f"{phase} {kind}", 0.0) + ms
        ops[name] = ops.get(name, 0.0) + ms
    top = sorted(ops.items(), key=lambda x: -x[1])[:15]
    return {"ms_per_step": dict(sorted(table.items(), key=lambda x: -x[1])),
            "top_ops": [{"op": n, "ms": v, "op_name": names[n]} for n, v in top]}  # fmt: skip


def op_profile(args: argparse.Namespace, steps: int = 5) -> dict:
    """One client's full training step (grad + AdamW, donated), traced op by op: run in a fresh
    process (main sets the XLA flag that makes XLA:CPU trace its ops before jax starts)."""
    _, params, loss, opt, _ = _step_problem(args)
    b, t = args.batch_size, args.profile_length

    def full(p, o, k):
        u, o = opt.update(jax.grad(loss)(p, True, k), o, p)
        return jax.tree.map(lambda a, c: a + c, p, u), o

    state, key = opt.init(params), jax.random.key(0)
    # The executable that runs is the one whose HLO names the traced ops (compiled once).
    step = jax.jit(full, donate_argnums=(0, 1)).lower(params, state, key).compile()
    hlo = step.as_text()
    for i in range(3):
        params, state = jax.block_until_ready(step(params, state, jax.random.fold_in(key, i)))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t0 = time.perf_counter()
        for i in range(steps):
            params, state = jax.block_until_ready(step(params, state, jax.random.fold_in(key, i)))
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        (trace,) = Path(d).glob("**/*.trace.json.gz")
        data = json.loads(gzip.decompress(trace.read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = op_breakdown(events, hlo, steps)
    if not out["ms_per_step"]:
        raise SystemExit(
            f"no op events in the trace: run in a fresh process with XLA_FLAGS={_OP_FLAG}"
        )
    return {"batch": b, "length": t, "model": args.model, "allocator": allocator(),
            "traced_step_ms": 1e3 * wall, **out}  # fmt: skip


def markdown_row(r: dict) -> str:
    c, rd = r["config"], r["round"]
    return (
        f"| {c['model']} | {r['machine']['device']} | {c['clients']} | {c['batch_size']} | "
        f"{c['lengths']} | {c['critical_layer']} | {rd['seconds']:.2f} | {rd['compile_s']:.1f} | "
        f"{rd['tokens_per_s']:.0f} | {rd['model_flops_per_s'] / 1e9:.1f} | "
        f"{r['peak']['flops_per_s'] / 1e9:.1f} | {100 * rd['mfu']:.1f}% | {100 * rd['hfu']:.1f}% | "
        f"{100 * r['padding_waste']:.1f}% | {r['speedup_vs_sequential']:.2f}x | "
        f"{r['speedup_vs_stepwise']:.2f}x | {r['peak_memory_bytes'] / 2**30:.1f} |"
    )


MARKDOWN_HEADER = (
    "| model | device | K | B | lengths | c | s/round | compile s | tokens/s | model GFLOP/s | "
    "peak GFLOP/s | MFU | HFU | padding | vs one-at-a-time | vs step loop | peak mem GiB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        default="minilm-l6",
        help="minilm-l6 (real weights), minilm-random, bert-base-random or tiny",
    )
    p.add_argument("--clients", type=int, default=10, help="clients K trained in the round")
    p.add_argument("--batch-size", type=int, default=16, help="client batch size")
    p.add_argument("--examples-per-client", type=int, default=64, help="training examples each")
    p.add_argument("--local-epochs", type=int, default=1, help="local epochs per round")
    p.add_argument(
        "--lengths",
        default="rotten_tomatoes",
        help="'rotten_tomatoes' (real tokenised lengths) or a fixed length like 128",
    )
    p.add_argument("--max-length", type=int, default=128, help="truncation length")
    p.add_argument("--critical-layer", type=int, default=None, help="split layer c (default L)")
    p.add_argument("--chunk-size", type=int, default=None, help="clients vmapped at once")
    p.add_argument("--dtype", default=None, help="compute dtype (default fp32 CPU, bf16 GPU)")
    p.add_argument(
        "--attention",
        default="xla",
        choices=ATTENTION_IMPLEMENTATIONS,
        help="attention kernel; cudnn (GPU, bf16) runs in evaluation only: --profile-step's "
        "forward row, not the training rounds",
    )
    p.add_argument("--bucketing", action="store_true",
                   help="length-sorted windows (batches of similar length) instead of plain "
                        "shuffled batches")  # fmt: skip
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack each batch end to end (no padding computed; see batching.py); the default",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="CPU devices the one-at-a-time round deals clients to (default: JAX's, 1)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions after warm-up")
    p.add_argument(
        "--skip-baselines",
        action="store_true",
        help="time only the federated round (no one-at-a-time or step-loop runs)",
    )
    p.add_argument(
        "--profile-step",
        action="store_true",
        help="time the pieces of one client step instead of whole rounds",
    )
    p.add_argument(
        "--op-profile",
        action="store_true",
        help="trace one client step op by op (forward / backward / optimizer, matmul / rest)",
    )
    p.add_argument("--profile-length", type=int, default=32, help="sequence length for the profile")
    p.add_argument(
        "--torch-reference",
        action="store_true",
        help="with --profile-step: time the same step in PyTorch too (fp32 on CPU; needs torch)",
    )
    p.add_argument(
        "--peak-sizes",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=None,
        help="square matmul sizes the peak is the best of (default 1024,2048,3072 on a CPU, "
        "2048,4096,8192 on an accelerator)",
    )
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    tune_malloc()  # as the commands do, before JAX starts its threads
    use_cpu_devices(args.cpu_devices)  # before the first JAX computation
    check_attention(args.attention, compute_dtype(args), jax.default_backend())  # before timing
    if args.torch_reference and not (
        args.profile_step
        and not args.op_profile
        and compute_dtype(args) == "float32"
        and jax.default_backend() == "cpu"
    ):
        raise UserError("--torch-reference goes with --profile-step (alone), fp32, on a CPU")
    if args.op_profile:
        result = op_profile(args)
    elif args.profile_step:
        result = profile_step(args)
    else:
        result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    if not (args.op_profile or args.profile_step):
        print(MARKDOWN_HEADER)
        print(markdown_row(result))
    return result


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    if "--op-profile" in sys.argv[1:] and _OP_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OP_FLAG}".strip()
    try:
        main()
    except UserError as e:  # a one-line error, exit status 2, as the CLI
        sys.exit(report(e))
