"""Client-level DP and robust aggregation on real data, offline, at the scale a 2-core CPU runs:
accuracy against epsilon for FedAvg and FedSplitBERT, and one attacking client in ten against the
mean, the trimmed mean, the median and a norm bound. Writes docs/privacy_study.md and its plots.

    nice -n 10 python tools/privacy_study.py          # every missing run, then the report
    python tools/privacy_study.py --report-only       # the report from the finished runs
    python tools/privacy_study.py --only attack       # one part: dp | attack

Runs are `python -m fedjax_split.train ...` into runs/privacy_study/<name>; a finished run
(summary.json) is not run again, an interrupted one is continued with --resume. One at a time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedjax_split.run.outputs import read_json, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "privacy_study"
DOC = ROOT / "docs" / "privacy_study.md"
FIGURES = ROOT / "docs" / "figures"
PY = sys.executable

# DP: 100 clients holding 30 rotten-tomatoes snippets each (label skew: Dirichlet 1.0), 20 a
# round in expectation (Poisson with DP), delta 1e-3 (< 1/K), adaptive clipping from 0.1.
DP_BASE = [
    "--config=configs/offline_rotten_tomatoes.py", "--max-examples=3000", "--clients=100",
    "--clients-per-round=20", "--partition=dirichlet", "--alpha=1.0", "--rounds=4",
    "--local-epochs=1", "--eval-every=4", "--dp-delta=1e-3", "--seed=0",
]  # fmt: skip
DP_CLIP = ["--dp-clip=0.1", "--dp-clip-quantile=0.5"]
METHODS = {"fedavg": ("FedAvg", "--critical-layer=L"),
           "fedsplit": ("FedSplitBERT c=3", "--critical-layer=3")}  # fmt: skip
NOISE = (None, 0.5, 1.0)  # None: no DP

# Attack: 10 clients, all every round; client(s) chosen by the seed send x100 or -1 x their update.
ATTACK_BASE = [
    "--config=configs/offline_rotten_tomatoes.py", "--max-examples=1000", "--clients=10",
    "--partition=dirichlet", "--alpha=1.0", "--rounds=3", "--local-epochs=1",
    "--critical-layer=L", "--seed=0",
]  # fmt: skip
DEFENCES = {
    "mean": ("mean", []),
    "trimmed": ("trimmed mean (0.1 each end)",
                ["--aggregator=trimmed-mean", "--trim-fraction=0.1"]),
    "median": ("median", ["--aggregator=median"]),
    "norm": ("mean, updates clipped to 2x the clean median norm", None),  # bound from the clean run
}  # fmt: skip
ATTACKS = {"scale": "x100 update", "sign-flip": "sign-flipped update"}


def dp_runs() -> list[tuple[str, list[str]]]:
    out = []
    for m, (_, flag) in METHODS.items():
        for z in NOISE:
            dp = [] if z is None else [f"--dp-noise-multiplier={z}", *DP_CLIP]
            out.append((f"dp_{m}_z{z}", [*DP_BASE, flag, *dp]))
    return out


def clean_norm() -> float | None:
    """Twice the median update norm of the clean run's first round (it records the norms)."""
    run = load("attack_none_measured")
    if run is None:
        return None
    return 2 * statistics.median(run["records"][0]["update_norms"])


def attack_runs() -> list[tuple[str, list[str]]]:
    # the clean run measures the norms (a bound no update reaches: the mean, norms recorded)
    out = [("attack_none_measured", [*ATTACK_BASE, "--max-update-norm=1e9"])]
    bound = clean_norm()
    for a in ATTACKS:
        for d, (_, flags) in DEFENCES.items():
            if a == "sign-flip" and d == "norm":
                continue  # a sign flip keeps the norm: the bound is the mean's run
            if flags is None:
                if bound is None:
                    continue  # after the clean run
                flags = [f"--max-update-norm={bound:.6g}"]
            out.append((f"attack_{a}_{d}", [*ATTACK_BASE, f"--attack={a}", *flags]))
    return out


def run_one(name: str, args: list[str]) -> str:
    out = RUNS / name
    if (out / "summary.json").is_file():
        return f"{name}: done before"
    cmd = [PY, "-m", "fedjax_split.train", *args, f"--output-dir={out}"]
    if out.exists():
        cmd.append("--resume")
    RUNS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(RUNS / f"{name}.log", "a") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    return f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.time() - t0:.0f}s"


def load(name: str) -> dict[str, Any] | None:
    d = RUNS / name
    if not (d / "summary.json").is_file():
        return None
    return {"summary": read_json(d / "summary.json"), "records": read_jsonl(d / "metrics.jsonl"),
            "config": read_json(d / "config.json")}  # fmt: skip


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def final(run: dict[str, Any], key: str = "accuracy") -> float | None:
    scored = [r for r in run["records"] if r.get(key) is not None]
    return scored[-1][key] if scored else None


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def dp_table() -> tuple[list[str], dict[str, list[tuple[float, float]]]]:
    lines = ["| method | noise multiplier z | epsilon (delta 1e-3) | accuracy | majority label |",
             "|---|---|---|---|---|"]  # fmt: skip
    curves: dict[str, list[tuple[float, float]]] = {}
    for m, (label, _) in METHODS.items():
        for z in NOISE:
            run = load(f"dp_{m}_z{z}")
            if run is None:
                continue
            eps = run["records"][-1].get("epsilon")
            acc = final(run)
            lines.append(f"| {label} | {'no DP' if z is None else z} | "
                         f"{'inf' if eps is None else fmt(eps, 2)} | {fmt(acc)} | "
                         f"{fmt(run['summary'].get('majority_label'))} |")  # fmt: skip
            if eps is not None and acc is not None:
                curves.setdefault(label, []).append((eps, acc))
    return lines, curves


def attack_table() -> tuple[list[str], dict[str, list[float]]]:
    lines = ["| attack | server's rule | accuracy after each round | final |", "|---|---|---|---|"]
    series: dict[str, list[float]] = {}
    clean = load("attack_none_measured")
    if clean is not None:
        accs = [r["accuracy"] for r in clean["records"]]
        lines.append(f"| none | mean | {', '.join(fmt(a) for a in accs)} | {fmt(accs[-1])} |")
        series["no attack, mean"] = accs
    for a, a_label in ATTACKS.items():
        for d, (d_label, _) in DEFENCES.items():
            run = load(f"attack_{a}_{d}")  # (sign-flip x norm bound is not run)
            if run is None:
                continue
            accs = [r["accuracy"] for r in run["records"]]
            lines.append(f"| {a_label} | {d_label} | {', '.join(fmt(x) for x in accs)} | "
                         f"{fmt(accs[-1])} |")  # fmt: skip
            series[f"{a_label}, {d_label}"] = accs
    return lines, series


def plots(curves: dict[str, list[tuple[float, float]]], series: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, pts in curves.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set_xlabel("epsilon after the run (delta = 1e-3)")
    ax.set_ylabel("personalised accuracy")
    ax.set_title("Client-level DP, 100 clients, ~20 a round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(FIGURES / "privacy_epsilon.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, accs in series.items():
        ax.plot(range(1, len(accs) + 1), accs, "o-", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (FedAvg's global model)")
    ax.set_title("One client in ten attacking, 10 clients")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURES / "privacy_attack.png", dpi=120)
    plt.close(fig)


def report() -> None:
    dp_lines, curves = dp_table()
    attack_lines, series = attack_table()
    plots(curves, series)
    bound = clean_norm()
    text = [
        "# Privacy and robustness study (generated by tools/privacy_study.py)",
        "",
        f"Commit {commit()}; one seed (0) per setting: the figures show what happens at this "
        "scale, not differences of a few points (see docs/privacy.md for what the study can and "
        "cannot say). MiniLM-L6 on rotten-tomatoes snippets (configs/offline_rotten_tomatoes.py).",
        "",
        "## Accuracy against epsilon",
        "",
        "`" + shlex.join(["python -m fedjax_split.train", *DP_BASE]) + "` with "
        "`--critical-layer L` (FedAvg) or `3` (FedSplitBERT), and "
        f"`--dp-noise-multiplier Z {shlex.join(DP_CLIP)}`.",
        "",
        *dp_lines,
        "",
        "![accuracy against epsilon](figures/privacy_epsilon.png)",
        "",
        "## One attacking client in ten",
        "",
        "`" + shlex.join(["python -m fedjax_split.train", *ATTACK_BASE]) + "` with "
        "`--attack scale|sign-flip` and the server's rule; the norm bound is twice the clean "
        f"run's median first-round update norm ({fmt(bound, 4)}).",
        "",
        *attack_lines,
        "",
        "![attack](figures/privacy_attack.png)",
        "",
    ]
    DOC.write_text("\n".join(text))
    print(f"wrote {DOC}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    p.add_argument("--only", choices=("dp", "attack"), help="run one part only")
    args = p.parse_args(argv)
    if not args.report_only:
        parts = ([] if args.only == "dp" else ["attack"]) + ([] if args.only == "attack" else
                                                              ["dp"])  # fmt: skip
        for part in parts:
            for _ in range(2):  # the attack's norm bound comes from its first run
                for name, cmd in (attack_runs() if part == "attack" else dp_runs()):
                    print(run_one(name, cmd), flush=True)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
