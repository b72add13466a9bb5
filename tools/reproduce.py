"""FedSplitBERT's findings on real data, offline: every run of the study, then docs/results.md.

    python tools/reproduce.py                 # all runs (skips finished ones), tables, plots
    python tools/reproduce.py --report-only   # rebuild docs/results.md from finished runs
    python tools/reproduce.py --only k10      # one group: k10, seeds, k3, news, freeze

Each run is `python -m fedjax_split.train --config <preset> <overrides> --output-dir
runs/study/<name>`; a finished run (summary.json present) is not run again, so the study can be
interrupted and continued. The report names the directory behind every number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fedjax_split.run.outputs import read_json, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
K10 = "configs/study_rotten_tomatoes_k10.py"
K3 = "configs/study_rotten_tomatoes_k3.py"
NEWS = "configs/study_20news.py"
L = 6  # MiniLM-L6

FREEZE = "configs/fednlp_freezing.py"
# FedNLP's freezing table at a third of the corpus (60 documents a client): eight 28-round runs of
# the whole corpus would take some 7 hours of a 2-core CPU
FREEZE_SCALE = ["--max-examples=6000", "--eval-every=4", "--checkpoint-every=2"]
FROZEN = {"none": None, "E": r"embeddings\.", **{
    f"E+L0-{k}" if k else "E+L0": rf"embeddings\.|encoder\.layer\.[0-{k}]\." for k in range(L)}}

# (group, name, preset, overrides), in the order they run: the headline rows first, so that a
# study run in parts has its most important numbers soonest
RUNS: list[tuple[str, str, str, list[str]]] = [
    ("k10", "k10_fedavg", K10, [f"--critical-layer={L}"]),
    ("k10", "k10_fedsplit_c3", K10, ["--critical-layer=3"]),
    ("k3", "k3_fedavg", K3, [f"--critical-layer={L}"]),
    ("k3", "k3_fedsplit_c3", K3, ["--critical-layer=3"]),
    ("seeds", "k10_fedavg_seed1", K10, [f"--critical-layer={L}", "--seed=1"]),
    ("seeds", "k10_fedsplit_c3_seed1", K10, ["--critical-layer=3", "--seed=1"]),
    ("seeds", "k10_fedavg_seed2", K10, [f"--critical-layer={L}", "--seed=2"]),
    ("seeds", "k10_fedsplit_c3_seed2", K10, ["--critical-layer=3", "--seed=2"]),
    ("k10", "k10_fedsplit_c3_fp16", K10, ["--critical-layer=3", "--quantize=fp16"]),
    ("k10", "k10_fedsplit_c3_bf16", K10, ["--critical-layer=3", "--quantize=bf16"]),
    ("k10", "k10_fedprox", K10, [f"--critical-layer={L}", "--algorithm=fedprox"]),
    ("k10", "k10_fedadam", K10, [f"--critical-layer={L}", "--algorithm=fedadam"]),
    ("k10", "k10_fedsplit_c0", K10, ["--critical-layer=0"]),
    ("k10", "k10_fedsplit_c2", K10, ["--critical-layer=2"]),
    ("k10", "k10_fedsplit_c4", K10, ["--critical-layer=4"]),
    ("k10", "k10_fedsplit_c5", K10, ["--critical-layer=5"]),
    ("k3", "k3_fedsplit_c3_fp16", K3, ["--critical-layer=3", "--quantize=fp16"]),
    ("k3", "k3_fedprox", K3, [f"--critical-layer={L}", "--algorithm=fedprox"]),
    ("k3", "k3_fedadam", K3, [f"--critical-layer={L}", "--algorithm=fedadam"]),
    ("news", "news_fedavg", NEWS, [f"--critical-layer={L}"]),
    ("news", "news_fedsplit_c3", NEWS, ["--critical-layer=3"]),
    ("news", "news_fedprox", NEWS, [f"--critical-layer={L}", "--algorithm=fedprox"]),
    ("news", "news_fedadam", NEWS, [f"--critical-layer={L}", "--algorithm=fedadam"]),
    *[("freeze", f"freeze_{row.replace('+', '_')}", FREEZE,
       FREEZE_SCALE + ([] if rx is None else [f"--freeze={rx}"])) for row, rx in FROZEN.items()],
]  # fmt: skip


def command(preset: str, overrides: Sequence[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "fedjax_split.train", f"--config={preset}", *overrides,
            f"--output-dir={out}"]  # fmt: skip


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit, `+dirty` when tracked files differ from it ("unknown" outside git)."""
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True,  # noqa: E731
                                        text=True).stdout.strip()  # fmt: skip
        sha, dirty = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def provenance_path(runs_dir: Path, name: str) -> Path:
    return runs_dir / f"{name}.commits.jsonl"


def commits_of(runs_dir: Path, name: str) -> list[str]:
    """The commits a run's parts ran at, in order, each once (a run resumed in a later session at
    a newer commit lists both)."""
    path = provenance_path(runs_dir, name)
    seen: list[str] = []
    for rec in read_jsonl(path) if path.is_file() else []:
        if rec["commit"] not in seen:
            seen.append(rec["commit"])
    return seen


def note(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def run_one(name: str, preset: str, overrides: Sequence[str], runs_dir: Path) -> str:
    out = runs_dir / name
    if (out / "summary.json").is_file():
        return f"{name}: done before"
    cmd = command(preset, overrides, out)
    resumed = out.exists()
    if resumed:  # an interrupted run: continue it from its last checkpoint, or start again
        cmd.append("--resume")
    t0 = time.time()
    log = runs_dir / f"{name}.log"
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    part = {"commit": git_commit(), "started": started, "resumed": resumed}
    # noted before the run too: a part killed with the session still names its commit
    note(provenance_path(runs_dir, name), part)
    with open(log, "a") as f:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    note(provenance_path(runs_dir, name), {**part, "exit": rc, "seconds": round(time.time() - t0)})
    status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {log})"
    return f"{name}: {status} in {time.time() - t0:.0f}s"


# ---------------------------------------------------------------------------------------------
# report


def load(runs_dir: Path, name: str) -> dict[str, Any] | None:
    d = runs_dir / name
    if not (d / "summary.json").is_file():
        return None
    return {
        "dir": d,
        "config": read_json(d / "config.json"),
        "summary": read_json(d / "summary.json"),
        "records": read_jsonl(d / "metrics.jsonl"),
    }


def final_metric(run: dict[str, Any], metric: str = "accuracy") -> float:
    evaluated = [r for r in run["records"] if r.get(metric) is not None]
    return float(evaluated[-1][metric])


def mb_to_reach(run: dict[str, Any], target: float, metric: str = "accuracy") -> float | None:
    for r in run["records"]:
        if r.get(metric) is not None and r[metric] >= target:
            return r["cum_bytes"] / 1e6
    return None


def show(path: Path) -> str:
    """A run directory as the report names it: relative to the repository when inside it."""
    return os.path.relpath(path, ROOT) if path.resolve().is_relative_to(ROOT) else str(path)


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def method_label(config: dict[str, Any]) -> str:
    c = config.get("critical_layer")
    q = {"none": "", "fp16": " + fp16 wire", "bf16": " + bf16 wire"}[config.get("quantize", "none")]
    if c is None or c == L:
        return {"fedavg": "FedAvg", "fedprox": "FedProx", "fedadam": "FedAdam"}.get(
            config["algorithm"], config["algorithm"]) + q  # fmt: skip
    if c == 0:
        return "local only (c=0)" + q
    return f"FedSplitBERT c={c}" + q


def majority_baseline(run: dict[str, Any]) -> float:
    """Mean over clients of the accuracy of predicting the client's majority training label on
    its own test split: what a model learns from the local label prior alone. Rebuilt from the
    run's partition.json and the task's labels, subsampled exactly as the run did."""
    import numpy as np

    from fedjax_split.data.sources import load_examples
    from fedjax_split.data.tasks import get_task
    from fedjax_split.run.experiment import subsample_indices

    cfg = run["config"]
    labels = np.asarray(load_examples(get_task(cfg["task"])).labels)
    idx = subsample_indices(len(labels), cfg.get("max_examples"), cfg["seed"])
    labels = labels if idx is None else labels[idx]
    part = read_json(run["dir"] / "partition.json")
    accs = []
    for client in part["clients"]:
        train, test = labels[np.asarray(client["train"])], labels[np.asarray(client["test"])]
        if test.size:
            accs.append(float(np.mean(test == np.bincount(train).argmax())))
    return float(np.mean(accs))


def method_table(runs: list[dict[str, Any]], baseline: dict[str, Any] | None) -> list[str]:
    """Paper Table III/V/VI shape: accuracy, bytes per round, MB to reach the target, gain."""
    target = final_metric(baseline) if baseline else None
    goal = fmt(target, 3) if target else "target"
    head = ("| method | mean personalised accuracy (final) | best round | MB per round (up+down) "
            f"| MB to reach {goal} | gain vs FedAvg | run |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|"]
    base_mb = mb_to_reach(baseline, target) if baseline else None
    if baseline is not None and (baseline["dir"] / "partition.json").is_file():
        lines.append(f"| majority label of each client (no model) | "
                     f"{fmt(majority_baseline(baseline), 4)} | | | | | "
                     f"`{show(baseline['dir'])}` partition |")  # fmt: skip
    for run in runs:
        recs = run["records"]
        per_round = (recs[0]["bytes_up"] + recs[0]["bytes_down"]) / 1e6
        best = max(r["accuracy"] for r in recs if r.get("accuracy") is not None)
        reach = mb_to_reach(run, target) if target is not None else None
        gain = (base_mb / reach) if (base_mb and reach) else None
        gain_s = "n/a" if reach is None else ("local only" if reach == 0 else f"{gain:.1f}x")
        lines.append(
            f"| {method_label(run['config'])} | {fmt(final_metric(run), 4)} | {fmt(best, 4)} | "
            f"{fmt(per_round, 1)} | {fmt(reach, 1) if reach is not None else 'not reached'} | "
            f"{gain_s} | `{show(run['dir'])}` |"
        )
    return lines


def seeds_table(runs_dir: Path) -> list[str]:
    lines = [
        "| method | seed 0 | seed 1 | seed 2 | mean | std | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, base in (("FedAvg", "k10_fedavg"), ("FedSplitBERT c=3", "k10_fedsplit_c3")):
        names = [base, f"{base}_seed1", f"{base}_seed2"]
        runs = [load(runs_dir, n) for n in names]
        vals = [final_metric(r) if r else None for r in runs]
        got = [v for v in vals if v is not None]
        mean = statistics.mean(got) if got else None
        std = statistics.stdev(got) if len(got) > 1 else None
        lines.append(f"| {label} | " + " | ".join(fmt(v, 4) for v in vals)
                     + f" | {fmt(mean, 4)} | {fmt(std, 4)} | "
                     + ", ".join(f"`{show(runs_dir / n)}`" for n in names) + " |")  # fmt: skip
    return lines


def sweep_table(runs_dir: Path) -> list[str]:
    lines = ["| critical layer c (of 6) | paper's c (of 12) | global params | mean accuracy "
             "| MB per round | run |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c, name in [(0, "k10_fedsplit_c0"), (2, "k10_fedsplit_c2"), (3, "k10_fedsplit_c3"),
                    (4, "k10_fedsplit_c4"), (5, "k10_fedsplit_c5"), (6, "k10_fedavg")]:  # fmt: skip
        run = load(runs_dir, name)
        if run is None:
            lines.append(f"| {c} | {2 * c} | n/a | not run | n/a | `{show(runs_dir / name)}` |")
            continue
        rec = run["records"][0]
        per_round = (rec["bytes_up"] + rec["bytes_down"]) / 1e6
        params = rec["bytes_up"] / 4 / run["config"]["clients"]
        lines.append(f"| {c} | {2 * c} | {params / 1e6:.2f}M | {fmt(final_metric(run), 4)} | "
                     f"{fmt(per_round, 1)} | `{show(runs_dir / name)}` |")  # fmt: skip
    return lines


def plots(runs_dir: Path, fig_dir: Path) -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    from plot import plot_runs  # noqa: PLC0415

    fig_dir.mkdir(parents=True, exist_ok=True)
    groups = {
        "k10_methods": ["k10_fedavg", "k10_fedprox", "k10_fedadam", "k10_fedsplit_c3",
                        "k10_fedsplit_c3_fp16", "k10_fedsplit_c3_bf16"],
        "k10_critical_layer": ["k10_fedsplit_c0", "k10_fedsplit_c2", "k10_fedsplit_c3",
                               "k10_fedsplit_c4", "k10_fedsplit_c5", "k10_fedavg"],
        "k3_methods": ["k3_fedavg", "k3_fedprox", "k3_fedadam", "k3_fedsplit_c3",
                       "k3_fedsplit_c3_fp16"],
        "news_methods": ["news_fedavg", "news_fedprox", "news_fedadam", "news_fedsplit_c3"],
    }  # fmt: skip
    lines = []
    for name, members in groups.items():
        dirs = [runs_dir / m for m in members if (runs_dir / m / "summary.json").is_file()]
        if not dirs:
            continue
        for p in plot_runs(dirs, "accuracy", fig_dir / name):
            lines.append(f"![{p.stem}]({os.path.relpath(p, fig_dir.parent)})")
    return lines


def report(runs_dir: Path, out: Path) -> None:
    get = lambda names: [r for r in (load(runs_dir, n) for n in names) if r]  # noqa: E731
    k10 = get(["k10_fedavg", "k10_fedprox", "k10_fedadam", "k10_fedsplit_c3",
               "k10_fedsplit_c3_fp16", "k10_fedsplit_c3_bf16", "k10_fedsplit_c0"])  # fmt: skip
    k3 = get(["k3_fedavg", "k3_fedprox", "k3_fedadam", "k3_fedsplit_c3", "k3_fedsplit_c3_fp16"])
    news = get(["news_fedavg", "news_fedprox", "news_fedadam", "news_fedsplit_c3"])
    base = lambda runs: next((r for r in runs if method_label(r["config"]) == "FedAvg"), None)  # noqa: E731
    discussion = ROOT / "docs" / "results_discussion.md"
    parts = [
        "# Results: FedSplitBERT on real data, offline",
        "",
        "Generated by `python tools/reproduce.py` (tables and plots; the discussion comes from "
        "`docs/results_discussion.md`). Every number names the run directory it comes from; each "
        "holds `config.json`, `partition.json`, `metrics.jsonl` and `summary.json`.",
        "",
        "Model: all-MiniLM-L6-v2 (real pretrained weights, 6 layers, hidden 384; c = 3/4/5 stand "
        "for the paper's 6/8/10 of 12). Metric: accuracy of each client's personalised model on "
        "its own test split (20% of its share), averaged over clients, after the last round. "
        "Bytes: the arrays actually sent, both directions, all participating clients.",
        "",
        "## Rotten tomatoes, K=10, Table II label ramp (paper Tables III/V/VI shape)",
        "",
        f"Preset `{K10}`: 1,000 of 12,808 snippets subsampled (seed 0), 100 per client "
        "(80 train / 20 test), 4 rounds of 2 local epochs, all clients every round, AdamW lr 5e-5, "
        "batch 16. The target for 'MB to reach' is FedAvg's final accuracy.",
        "",
        *method_table(k10, base(k10)),
        "",
        "### Critical-layer sweep (paper Table IV shape)",
        "",
        *sweep_table(runs_dir),
        "",
        "### Three seeds (seed changes the subsample, the partition, the head init and dropout)",
        "",
        *seeds_table(runs_dir),
        "",
        "## Rotten tomatoes, K=3, Table I 'other' row (80/20, 50/50, 20/80)",
        "",
        f"Preset `{K3}`: 600 snippets, 200 per client (160 train / 40 test), 4 rounds of 2 local "
        "epochs.",
        "",
        *method_table(k3, base(k3)),
        "",
        "## 20 Newsgroups, FedNLP cross-device regime",
        "",
        f"Preset `{NEWS}`: 100 clients, Dirichlet label skew alpha = 1, 10 sampled per round, "
        "2,000 of 18,821 documents (about 20 per client), 4 rounds of 2 local epochs, 128 tokens. "
        "Accuracy is the mean over all 100 clients' personalised models on their own test splits.",
        "",
        *method_table(news, base(news)),
        "",
        "## Plots",
        "",
        *plots(runs_dir, out.parent / "figures"),
        "",
        "## Commands",
        "",
        "```bash",
        *[
            " ".join(
                [
                    "python -m fedjax_split.train",
                    f"--config={p}",
                    *o,
                    f"--output-dir=runs/study/{n}",
                ]
            )
            for _, n, p, o in RUNS
        ],  # fmt: skip
        "```",
        "",
    ]
    if discussion.is_file():
        parts += [discussion.read_text().rstrip(), ""]
    out.write_text("\n".join(parts))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "study"), help="where runs go")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (2 overlaps compilation)")
    p.add_argument("--only", nargs="*", default=None, help="groups: k10 seeds k3 news freeze")
    p.add_argument("--report-only", action="store_true", help="only rebuild docs/results.md")
    p.add_argument("--out", default=str(ROOT / "docs" / "results.md"), help="the report")
    args = p.parse_args(argv)
    runs_dir = Path(args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        todo = [r for r in RUNS if args.only is None or r[0] in args.only]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_one, n, pre, o, runs_dir) for _, n, pre, o in todo]
            for i, f in enumerate(futures, 1):
                print(f"[{i}/{len(futures)}] {f.result()}", flush=True)
    report(runs_dir, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
