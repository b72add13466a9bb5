"""Memory and time against the number of clients: the same cross-device run (10 clients sampled
per round) with K = 10, 100, 1000 clients, each in its own process.

    python tools/scale.py --clients 10 100 1000 --out runs/scale.json

Each run is `python -m fedjax_split.train --config configs/offline_20news.py` (MiniLM-L6, c = 3,
Dirichlet alpha = 1) with `--clients K --clients-per-round 10`, a checkpoint every round, and one
evaluation of every client after the last round. Reported per K: the steady training round (the
median of rounds 2 .. R-1, no evaluation in them), the final round's evaluation, the process's
peak resident memory (from the kernel's accounting of the finished child, `os.wait4`), the
checkpoint's bytes, the client store's bytes (every local part a kept checkpoint may need) and
the seconds spent checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_one(k: int, rounds: int, base: Path, extra: list[str]) -> dict[str, Any]:
    out = base / f"k{k}"
    cmd = [sys.executable, "-m", "fedjax_split.train", "--config", "configs/offline_20news.py",
           "--clients", str(k), "--clients-per-round", "10", "--rounds", str(rounds),
           "--eval-every", str(10 * rounds), "--checkpoint-every", "1", "--output-dir", str(out),
           *extra]  # fmt: skip
    t0 = time.perf_counter()
    # the child's progress goes to a file: a pipe nobody reads while wait4 waits would fill and
    # block the child for ever
    log = base / f"k{k}.log"
    with open(log, "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err_file)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        last = log.read_text().strip().splitlines()[-1:]
        raise SystemExit(f"error: K={k} failed ({status}): {last}; see {log}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    steady = [r["train_seconds"] for r in records[1:-1]] or [records[-1]["train_seconds"]]
    return {
        "clients": k,
        "command": " ".join(["python", *cmd[1:]]),
        "first_round_s": records[0]["seconds"],
        "steady_round_s": statistics.median(steady),
        "final_eval_s": records[-1]["eval_seconds"],
        "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,  # Linux reports KiB
        "checkpoint_mb": summary["checkpoint_bytes"] / 1e6,
        "client_store_mb": summary["client_store_bytes"] / 1e6,
        "checkpoint_s_per_round": summary["checkpoint_seconds"] / len(records),
        "wall_s": wall,
        "final_accuracy": summary["final"].get("accuracy"),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out")
    p.add_argument("--keep", metavar="DIR",
                   help="write the runs under DIR and keep them (default: a temporary directory, "
                        "removed), e.g. to compare two versions' metrics.jsonl")  # fmt: skip
    p.add_argument("extra", nargs="*", help="more train flags, after --")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedjax-scale-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        for k in args.clients:
            rows.append(run_one(k, args.rounds, base, args.extra))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| K | first round s | steady round s | final eval s | peak RSS GB | checkpoint MB | "
          "client store MB | checkpoint s/round |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['first_round_s']:.1f} | {r['steady_round_s']:.1f} | "
              f"{r['final_eval_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['checkpoint_mb']:.1f} | "
              f"{r['client_store_mb']:.0f} | {r['checkpoint_s_per_round']:.2f} |")
    return rows


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    main()
