"""What a round costs on Flower beyond the simulation's: the same config run both ways on this
machine, one after the other, seconds per round from each run's metrics.jsonl.

    python tools/flower_overhead.py --out runs/flower_overhead -- \
        --config configs/offline_rotten_tomatoes.py --max-examples 2000 --rounds 4

runs `python -m fedjax_split.train FLAGS --output-dir OUT/simulation` and then
`python -m fedjax_split.flower FLAGS --output-dir OUT/flower` (a SuperLink and one SuperNode per
client on 127.0.0.1, each node's messages answered by its warm worker), checks that both runs'
figures are the same (every metrics.jsonl value but the times), and writes OUT/overhead.json and
OUT/overhead.md: per round, train and eval seconds both ways and the difference; the steady
overhead is the median difference over the rounds after the first (which compiles or loads its
programs: reported apart). A Flower round's seconds hold the one exchange that carried its
training (and, where due, the previous round's evaluation: `deploy.evaluation.evaluate`); its last
round's evaluation goes alone. `--no-warm-worker` runs the federation with each message in its
own ClientApp process (Flower's default), for the comparison. Run it on a quiet machine: the
load average (1, 5, 15 minutes) at the start of each run and at the end is written beside the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TIMES = ("train_seconds", "eval_seconds")
FLOWER_ONLY = {"clients_failed", "eval_failed", "eval_bytes_down", "clients_rejected",
               "secagg_bytes_up"}  # fmt: skip


def _run(module: str, flags: list[str], out: Path, env: dict[str, str]) -> float:
    """Runs the command to its end; its wall seconds."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", module, *flags, "--output-dir", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return time.monotonic() - t0


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _same_figures(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def keep(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if not k.endswith("seconds") and k not in FLOWER_ONLY}

    return [keep(r) for r in a] == [keep(r) for r in b]


def compare(sim: list[dict[str, Any]], fl: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round: seconds both ways (train + eval) and the difference; the steady overhead."""
    rows = []
    for s, f in zip(sim, fl, strict=True):
        s_sec = sum(s.get(k) or 0.0 for k in TIMES)
        f_sec = sum(f.get(k) or 0.0 for k in TIMES)
        rows.append({"round": s["round"], "simulation_s": s_sec, "flower_s": f_sec,
                     "overhead_s": f_sec - s_sec,
                     **{f"simulation_{k}": s.get(k) for k in TIMES},
                     **{f"flower_{k}": f.get(k) for k in TIMES}})  # fmt: skip
    steady = [r["overhead_s"] for r in rows[1:]]
    return {"rounds": rows, "first_round_overhead_s": rows[0]["overhead_s"],
            "steady_overhead_s": statistics.median(steady) if steady else None}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = ["| round | simulation train / eval s | Flower train / eval s | Flower - simulation s "
             "|", "|---|---|---|---|"]  # fmt: skip
    for r in result["rounds"]:
        s = " / ".join(f"{r[f'simulation_{k}'] or 0:.2f}" for k in TIMES)
        f = " / ".join(f"{r[f'flower_{k}'] or 0:.2f}" for k in TIMES)
        lines.append(f"| {r['round']} | {s} | {f} | {r['overhead_s']:+.2f} |")
    lines.append("")
    lines.append(f"Steady overhead (median over rounds 2 on): {result['steady_overhead_s']:+.2f} s "
                 f"a round; whole commands {result['simulation_wall_s']:.0f} s (simulation) and "
                 f"{result['flower_wall_s']:.0f} s (Flower).")  # fmt: skip
    loads = result.get("load_averages")
    if loads:
        lines.append("Load average (1 / 5 / 15 min): " + "; ".join(
            f"{when} {' / '.join(f'{x:.1f}' for x in load)}" for when, load in loads.items()
        ) + ".")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for both runs and the results")
    p.add_argument("--no-warm-worker", action="store_true",
                   help="one ClientApp process per message, Flower's default (for comparison)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the run's flags")
    args = p.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; pass a new --out")
    env = dict(os.environ)
    if args.no_warm_worker:
        env["FEDJAX_SPLIT_WARM_WORKER"] = "0"
    loads = {"simulation start": os.getloadavg()}
    sim_wall = _run("fedjax_split.train", flags, out / "simulation", env)
    loads["Flower start"] = os.getloadavg()
    fl_wall = _run("fedjax_split.flower", flags, out / "flower", env)
    loads["end"] = os.getloadavg()
    sim, fl = _records(out / "simulation"), _records(out / "flower")
    result = {"flags": flags, "warm_worker": not args.no_warm_worker,
              "same_figures": _same_figures(sim, fl), "simulation_wall_s": sim_wall,
              "flower_wall_s": fl_wall, "load_averages": loads,
              **compare(sim, fl)}  # fmt: skip
    (out / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "overhead.md").write_text(markdown(result))
    print(markdown(result), end="")
    print(f"same figures both ways: {result['same_figures']}; results in {out}")
    return 0 if result["same_figures"] else 1


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
