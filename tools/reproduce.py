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
import functools
import json
import math
import os
import shlex
import shutil
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
sys.path.insert(0, str(ROOT / "tools"))
from plot import value  # noqa: E402

K10 = "configs/study_rotten_tomatoes.py:k10"
K3 = "configs/study_rotten_tomatoes.py:k3"
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
    *[("freeze", f"freeze_{row.replace('+', '_')}", FREEZE,
       FREEZE_SCALE + ([] if rx is None else [f"--freeze={rx}"])) for row, rx in FROZEN.items()],
    ("news", "news_fedprox", NEWS, [f"--critical-layer={L}", "--algorithm=fedprox"]),
    ("news", "news_fedadam", NEWS, [f"--critical-layer={L}", "--algorithm=fedadam"]),
]  # fmt: skip


def command(preset: str, overrides: Sequence[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "fedjax_split.train", f"--config={preset}", *overrides,
            f"--output-dir={out}"]  # fmt: skip


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit, then `+dirty:` and the top-level paths (joined by `+`) of the tracked
    files that differ from it, so a report can tell edits to its docs from edits to the training
    code; "unknown" outside git."""
    try:
        git = lambda *a: subprocess.run(["git", "-c", "core.quotePath=false", *a],  # noqa: E731
                                        cwd=root, check=True, capture_output=True,
                                        text=True).stdout  # fmt: skip
        sha = git("rev-parse", "--short=12", "HEAD").strip()
        # staged and unstaged changes to tracked files; a rename names both of its sides
        changed = git("diff", "--name-only", "--no-renames", "HEAD").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    tops = sorted({path.split("/")[0] for path in changed})
    return sha + (f"+dirty:{'+'.join(tops)}" if tops else "")


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


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run has a complete checkpoint for `--resume` to continue from, as the train
    command itself sees it (an unreadable checkpoint directory counts as none)."""
    from fedjax_split.errors import UserError
    from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

    if not checkpoint_dir(run_dir).is_dir():
        return False
    try:
        return RunCheckpointer(checkpoint_dir(run_dir)).latest_round() is not None
    except UserError:
        return False


def run_one(name: str, preset: str, overrides: Sequence[str], runs_dir: Path) -> str:
    out = runs_dir / name
    if (out / "summary.json").is_file():
        return f"{name}: done before"
    cmd = command(preset, overrides, out)
    resumed = has_checkpoint(out)
    if resumed:  # an interrupted run: continue it from its last complete checkpoint
        cmd.append("--resume")
    elif out.exists():  # stopped before its first checkpoint: nothing to continue, start again
        shutil.rmtree(out)
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

FEDNLP_FREEZING = {"none": 55.11, "E": 54.86, "E+L0": 52.91, "E+L0-1": 53.92, "E+L0-2": 52.01,
                   "E+L0-3": 30.68, "E+L0-4": 16.63, "E+L0-5": 12.97}  # fmt: skip
POOLED = "pooled.accuracy"  # the one global model on the union of the clients' test data
TRAINED = "trained_mean.accuracy"  # mean over the clients trained at least once


def load(runs_dir: Path, name: str) -> dict[str, Any] | None:
    d = runs_dir / name
    if not (d / "summary.json").is_file():
        return None
    config, summary = read_json(d / "config.json"), read_json(d / "summary.json")
    if config.get("critical_layer") == "half":  # the default, resolved for the run's model
        config["critical_layer"] = summary["critical_layer"]
    return {
        "name": name,
        "dir": d,
        "config": config,
        "summary": summary,
        "records": read_jsonl(d / "metrics.jsonl"),
        "commits": commits_of(runs_dir, name),
    }


def final_metric(run: dict[str, Any], metric: str = "accuracy") -> float | None:
    evaluated = [r for r in run["records"] if value(r, metric) is not None]
    return float(value(evaluated[-1], metric)) if evaluated else None


def best_metric(run: dict[str, Any], metric: str = "accuracy") -> float | None:
    vals = [value(r, metric) for r in run["records"] if value(r, metric) is not None]
    return float(max(vals)) if vals else None


def first_reaching(run: dict[str, Any], target: float,
                   metric: str = "accuracy") -> dict[str, Any] | None:  # fmt: skip
    """The first record whose `metric` is at least `target` (None: never)."""
    return next((r for r in run["records"]
                 if value(r, metric) is not None and value(r, metric) >= target), None)  # fmt: skip


def mb_to_reach(run: dict[str, Any], target: float, metric: str = "accuracy") -> float | None:
    first = first_reaching(run, target, metric)
    return None if first is None else first["cum_bytes"] / 1e6


def mb_per_round(run: dict[str, Any], direction: str = "both") -> float:
    """What the first round sent: uploads (`up`), or uploads and downloads (`both`)."""
    rec = run["records"][0]
    return (rec["bytes_up"] + (rec["bytes_down"] if direction == "both" else 0)) / 1e6


def show(path: Path) -> str:
    """A run directory as the report names it: relative to the repository when inside it."""
    return os.path.relpath(path, ROOT) if path.resolve().is_relative_to(ROOT) else str(path)


def cells(run: dict[str, Any]) -> str:
    """The last two cells of a row: the run directory and the commit(s) it ran at."""
    return f"`{show(run['dir'])}` | {', '.join(run['commits']) or 'not recorded'} |"


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def method_label(config: dict[str, Any]) -> str:
    """How a person names the run: "FedSplitBERT c=3 + fp16 wire", "FedAvg" (the run's own
    plot.png names it the same way)."""
    from fedjax_split.run.plots import method_label as label

    return label(config["algorithm"], config["critical_layer"], L, config["quantize"])


@functools.cache
def pool_labels(task: str, data_dir: str | None, max_examples: int | None, seed: int) -> Any:
    """The labels of a run's example pool, subsampled exactly as the run did (loaded once per
    report: every table and plot of a study asks for the same few pools)."""
    import numpy as np

    from fedjax_split.data.sources import load_examples
    from fedjax_split.run.client_data import subsample_indices
    from fedjax_split.tasks.registry import get_task

    labels = np.asarray(load_examples(get_task(task), data_dir=data_dir).labels)
    idx = subsample_indices(len(labels), max_examples, seed)
    return labels if idx is None else labels[idx]


PRIOR_ROW = "majority label (no model: each client's own; everyone's on the pooled set)"


def client_priors(run: dict[str, Any]) -> tuple[dict[int, float], float] | None:
    """What the label priors alone score, no model: by client, its majority training label on its
    own test split (clients with training and test data); and the majority training label of all
    clients on the pooled test set. Rebuilt from the run's partition.json and the task's labels,
    subsampled exactly as the run did; None when the run has no partition.json."""
    import numpy as np

    if not (run["dir"] / "partition.json").is_file():
        return None
    cfg = run["config"]
    labels = pool_labels(cfg["task"], cfg["data_dir"], cfg["max_examples"], cfg["seed"])
    part = read_json(run["dir"] / "partition.json")
    own, trains, tests = {}, [], []
    for j, client in enumerate(part["clients"]):
        train, test = labels[np.asarray(client["train"])], labels[np.asarray(client["test"])]
        trains.append(train)
        tests.append(test)
        if test.size and train.size:
            own[j] = float(np.mean(test == np.bincount(train).argmax()))
    everyone = np.bincount(np.concatenate(trains)).argmax()
    return own, float(np.mean(np.concatenate(tests) == everyone))


def majority_baseline(run: dict[str, Any]) -> tuple[float, float] | None:
    """The priors' two figures: the mean over clients of each one's own majority label, and
    everyone's majority label on the pooled test set (None without a partition.json)."""
    import numpy as np

    priors = client_priors(run)
    if priors is None:
        return None
    own, everyone = priors
    return float(np.mean(list(own.values()))), everyone


ONE_SEED = (
    "Every row is one run, seed 0, so a difference between rows is one seed's (K=10's FedAvg "
    "and FedSplitBERT c=3 over three seeds: 'Three seeds'). 'MB to reach' is whole rounds' "
    "bytes (the round that got there in brackets), so a gain is a ratio of rounds times bytes "
    "per round: reaching the target one round earlier or later moves it by a round's share."
)


def method_table(runs: list[dict[str, Any]], baseline: dict[str, Any] | None) -> list[str]:
    """Paper Table III/V/VI shape: accuracy, bytes per round, MB to reach the target, gain; and
    where there is one global model (nothing local), its accuracy on the pooled test set."""
    target = final_metric(baseline) if baseline else None
    goal = fmt(target, 3) if target else "target"
    head = ("| method | mean personalised accuracy (final) | best round | global model, pooled "
            "test set (final) | MB up per round | MB per round (up+down) "
            f"| MB to reach {goal} | gain vs FedAvg | run | commit |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    base_mb = mb_to_reach(baseline, target) if baseline else None
    prior = majority_baseline(baseline) if baseline is not None else None
    if prior is not None:
        own, everyone = prior
        lines.append(f"| {PRIOR_ROW} | {fmt(own, 4)} | | {fmt(everyone, 4)} | | | | | "
                     f"`{show(baseline['dir'])}` partition | |")  # fmt: skip
    for run in runs:
        reach = mb_to_reach(run, target) if target is not None else None
        gain = (base_mb / reach) if (base_mb and reach) else None
        gain_s = "n/a" if reach is None else ("local only" if reach == 0 else f"{gain:.1f}x")
        # the round it got there: a gain is whole rounds' bytes, one round more or less moves it
        first = first_reaching(run, target) if target is not None else None
        reach_s = "not reached" if first is None else fmt(reach, 1)
        if reach:  # (a run that sends nothing is at 0 MB whichever round)
            reach_s += f" (round {first['round']})"
        lines.append(
            f"| {method_label(run['config'])} | {fmt(final_metric(run), 4)} | "
            f"{fmt(best_metric(run), 4)} | {fmt(final_metric(run, POOLED), 4)} | "
            f"{fmt(mb_per_round(run, 'up'), 1)} | {fmt(mb_per_round(run), 1)} | "
            f"{reach_s} | {gain_s} | {cells(run)}"
        )
    return lines


def seeds_table(runs_dir: Path) -> list[str]:
    lines = [
        "| method | seed 0 | seed 1 | seed 2 | mean | std | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    prior = lambda r: None if (mb := majority_baseline(r)) is None else mb[0]  # noqa: E731
    rows = (("majority label of each client (no model)", "k10_fedavg", prior),
            ("FedAvg", "k10_fedavg", final_metric),
            ("FedSplitBERT c=3", "k10_fedsplit_c3", final_metric))  # fmt: skip
    for label, base, metric in rows:
        names = [base, f"{base}_seed1", f"{base}_seed2"]
        runs = [load(runs_dir, n) for n in names]
        vals = [metric(r) if r else None for r in runs]
        got = [v for v in vals if v is not None]
        mean = statistics.mean(got) if got else None
        std = statistics.stdev(got) if len(got) > 1 else None
        lines.append(f"| {label} | " + " | ".join(fmt(v, 4) for v in vals)
                     + f" | {fmt(mean, 4)} | {fmt(std, 4)} | "
                     + ", ".join(f"`{show(runs_dir / n)}`" for n in names) + " |")  # fmt: skip
    return lines


def sweep_table(runs_dir: Path) -> list[str]:
    lines = ["| critical layer c (of 6) | paper's c (of 12) | global params | mean accuracy "
             "| MB up per round | run | commit |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c, name in [(0, "k10_fedsplit_c0"), (2, "k10_fedsplit_c2"), (3, "k10_fedsplit_c3"),
                    (4, "k10_fedsplit_c4"), (5, "k10_fedsplit_c5"), (6, "k10_fedavg")]:  # fmt: skip
        run = load(runs_dir, name)
        if run is None:
            lines.append(f"| {c} | {2 * c} | n/a | not run | n/a | `{show(runs_dir / name)}` | |")
            continue
        params = run["records"][0]["bytes_up"] / 4 / run["config"]["clients"]
        lines.append(f"| {c} | {2 * c} | {params / 1e6:.2f}M | {fmt(final_metric(run), 4)} | "
                     f"{fmt(mb_per_round(run, 'up'), 1)} | {cells(run)}")  # fmt: skip
    return lines


def trained_clients(run: dict[str, Any]) -> set[int]:
    return {c for r in run["records"] for c in r["clients_sampled"]}


def news_table(runs: list[dict[str, Any]], baseline: dict[str, Any] | None) -> list[str]:
    """The three cross-device figures: every client's personalised model, the clients trained
    at least once, and FedNLP's: the global model on the pooled test set; beside them what the
    label priors alone score (a local head can learn its client's prior)."""
    lines = [
        "| method | mean over all clients | mean over clients trained at least once "
        "| global model on the pooled test set (best round) | MB up per round | run | commit |",
        "|---|---|---|---|---|---|---|",
        "| FedNLP's FedAvg, DistilBERT, round 22 (Lin et al. 2022) | | | 0.51 | | | |",
    ]
    priors = client_priors(baseline) if baseline is not None else None
    if priors is not None:
        import numpy as np

        own, everyone = priors
        trained = trained_clients(baseline)
        own_trained = np.mean([acc for j, acc in own.items() if j in trained])
        lines.append(f"| {PRIOR_ROW} | {fmt(float(np.mean(list(own.values()))), 4)} | "
                     f"{fmt(float(own_trained), 4)} (the {len(trained)} "
                     f"{method_label(baseline['config'])} trained) | {fmt(everyone, 4)} | | "
                     f"`{show(baseline['dir'])}` partition | |")  # fmt: skip
    for run in runs:
        pooled = final_metric(run, POOLED)
        pooled_s = ("n/a: no single global model (local parts)" if pooled is None
                    else f"{pooled:.4f} ({fmt(best_metric(run, POOLED), 4)})")  # fmt: skip
        n, k = len(trained_clients(run)), run["config"]["clients"]
        lines.append(f"| {method_label(run['config'])} | {fmt(final_metric(run), 4)} | "
                     f"{fmt(final_metric(run, TRAINED), 4)} ({n} of {k}) | {pooled_s} | "
                     f"{fmt(mb_per_round(run, 'up'), 1)} | {cells(run)}")  # fmt: skip
    return lines


def freeze_table(runs_dir: Path) -> list[str]:
    """FedNLP's Table 3 against ours, row by row."""
    lines = [
        "| frozen | FedNLP accuracy, round 28 | ours: global model on the pooled test set "
        "(best round) | mean over clients trained at least once | parameters trained and sent "
        "| MB up per round | run | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, theirs in FEDNLP_FREEZING.items():
        name = f"freeze_{row.replace('+', '_')}"
        run = load(runs_dir, name)
        if run is None:
            lines.append(f"| {row} | {theirs / 100:.4f} | not run | | | | "
                         f"`{show(runs_dir / name)}` | |")  # fmt: skip
            continue
        cfg = run["config"]
        sent = run["records"][0]["bytes_up"] / 4 / (cfg["clients_per_round"] or cfg["clients"])
        pooled = f"{fmt(final_metric(run, POOLED), 4)} ({fmt(best_metric(run, POOLED), 4)})"
        lines.append(f"| {row} | {theirs / 100:.4f} | {pooled} | "
                     f"{fmt(final_metric(run, TRAINED), 4)} | {sent / 1e6:.2f}M | "
                     f"{fmt(mb_per_round(run, 'up'), 1)} | {cells(run)}")  # fmt: skip
    return lines


def plots(runs_dir: Path, fig_dir: Path) -> list[str]:
    from plot import plot_runs  # noqa: PLC0415  (matplotlib only when plotting)

    fig_dir.mkdir(parents=True, exist_ok=True)
    # name: (runs, metric, the run whose partition gives the label-prior line, published lines)
    groups = {
        "k10_methods": (["k10_fedavg", "k10_fedprox", "k10_fedadam", "k10_fedsplit_c3",
                         "k10_fedsplit_c3_fp16", "k10_fedsplit_c3_bf16"], "accuracy",
                        "k10_fedavg", {}),
        "k10_critical_layer": (["k10_fedsplit_c0", "k10_fedsplit_c2", "k10_fedsplit_c3",
                                "k10_fedsplit_c4", "k10_fedsplit_c5", "k10_fedavg"], "accuracy",
                               "k10_fedavg", {}),
        "k3_methods": (["k3_fedavg", "k3_fedprox", "k3_fedadam", "k3_fedsplit_c3",
                        "k3_fedsplit_c3_fp16"], "accuracy", "k3_fedavg", {}),
        "news_methods": (["news_fedavg", "news_fedprox", "news_fedadam", "news_fedsplit_c3"],
                         "accuracy", "news_fedavg", {}),
        "news_pooled": (["news_fedavg", "news_fedprox", "news_fedadam"], POOLED, "news_fedavg",
                        {"FedNLP's FedAvg, DistilBERT, round 22": 0.51}),
        "freezing_pooled": ([f"freeze_{r.replace('+', '_')}" for r in FEDNLP_FREEZING], POOLED,
                            None, {"FedNLP, nothing frozen, round 28":
                                   FEDNLP_FREEZING["none"] / 100}),
    }  # fmt: skip
    ylabels = {"accuracy": "accuracy (mean over clients' own test splits)",
               POOLED: "accuracy of the global model, pooled test set"}  # fmt: skip
    lines = []
    for name, (members, metric, prior_run, published) in groups.items():
        runs = [r for r in (load(runs_dir, m) for m in members) if r]
        if not runs:
            continue
        base = load(runs_dir, prior_run) if prior_run else None
        refs = {}
        prior = majority_baseline(base) if base is not None else None
        if prior is not None:
            own, everyone = prior
            if metric == "accuracy":
                refs["majority label of each client (no model)"] = own
            else:
                refs["one label for everyone (no model)"] = everyone
        refs.update(published)
        labels = [f"frozen: {r['name'].removeprefix('freeze_').replace('_', '+')}"
                  if r["name"].startswith("freeze_") else method_label(r["config"])
                  for r in runs]  # fmt: skip
        for p in plot_runs([r["dir"] for r in runs], metric, fig_dir / name, labels,
                           ylabels[metric], refs):  # fmt: skip
            lines.append(f"![{p.stem}]({os.path.relpath(p, fig_dir.parent)})")
    return lines


def pending(runs_dir: Path) -> list[str]:
    """The study's runs without a summary yet: a report of a study run in parts says so."""
    todo = [n for _, n, _, _ in RUNS if load(runs_dir, n) is None]
    if not todo:
        return []
    return ["**Not finished yet** (`python tools/reproduce.py` continues them): "
            + ", ".join(f"`{n}`" for n in todo) + ".", ""]  # fmt: skip


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
        "`docs/results_discussion.md`). Every number names the run directory it comes from and "
        "the commit the run used (`runs/study/NAME.commits.jsonl`; two commits when a run was "
        "resumed at a newer one; `+dirty:docs+tools` when the checkout had uncommitted changes, "
        "under the paths named); each directory holds `config.json`, `partition.json`, "
        "`metrics.jsonl` and `summary.json`.",
        "",
        "Model: all-MiniLM-L6-v2 (real pretrained weights, 6 layers, hidden 384; c = 3/4/5 stand "
        "for the paper's 6/8/10 of 12). Metric: accuracy of each client's personalised model on "
        "its own test split (20% of its share), averaged over clients, after the last round. "
        "Mini-batches: plain random (Algorithm 1), packed. Partitions: exact shares (every "
        "client's realised label shares equal the table's; the surplus of a class is dropped). "
        "Bytes: the arrays actually sent; 'MB up' is the clients' uploads alone (the paper's "
        "Table VI counts uploads), 'up+down' adds what the server sends.",
        "",
        *pending(runs_dir),
        "## Rotten tomatoes, K=10, Table II label ramp (paper Tables III/V/VI shape)",
        "",
        f"Preset `{K10}`: 4,000 of the 12,808 snippets subsampled (the seed picks them), exact "
        "Table II shares (3,120 used: 250 train + 62 test per client), 10 rounds of 1 local "
        "epoch, all clients every round, AdamW lr 5e-5, batch 16, 64 tokens. The target for "
        f"'MB to reach' is FedAvg's final accuracy. {ONE_SEED}",
        "",
        *method_table(k10, base(k10)),
        "",
        "### Critical-layer sweep (paper Table IV shape)",
        "",
        *sweep_table(runs_dir),
        "",
        "### Three seeds (the seed changes the subsample, the partition, the head init, the "
        "batches and dropout)",
        "",
        *seeds_table(runs_dir),
        "",
        "## Rotten tomatoes, K=3, Table I 'other' row (80/20, 50/50, 20/80)",
        "",
        f"Preset `{K3}`: 4,000 snippets subsampled, exact shares (3,429 used: 914 train + 229 "
        f"test per client), 10 rounds of 1 local epoch. {ONE_SEED}",
        "",
        *method_table(k3, base(k3)),
        "",
        "## 20 Newsgroups, FedNLP's cross-device regime",
        "",
        f"Preset `{NEWS}`: the whole corpus (18,821 documents), 100 clients, Dirichlet label skew "
        "alpha = 1, 10 sampled per round, 22 rounds of 1 local epoch, 128 tokens, evaluated every "
        "4 rounds and after the last. Three figures: the mean over all 100 clients' personalised "
        "models on their own test splits (a client never sampled keeps the initial local part: "
        "the pretrained upper layers and a fresh head), the mean over the clients trained at "
        "least once, and FedNLP's: the global model on the pooled test set (only where nothing "
        "is local).",
        "",
        *news_table(news, base(news)),
        "",
        "## FedNLP's freezing table (Lin et al. 2022, Table 3)",
        "",
        f"Preset `{FREEZE}` with `{' '.join(FREEZE_SCALE)}`: 20 Newsgroups, 100 clients, 10 per "
        "round, Dirichlet alpha 1, FedAvgM, everything global, 28 rounds, the embeddings and the "
        "lowest layers frozen (neither trained nor sent), at a third of the corpus (6,000 "
        "documents, 60 a client) so that the eight runs fit a CPU; FedNLP trained DistilBERT on "
        "the whole corpus, so compare the shape of the column, not its level.",
        "",
        *freeze_table(runs_dir),
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
                    *(shlex.quote(x) for x in o),
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
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    main()
