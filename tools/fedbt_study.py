"""FedBT's fine-tuning against BERT-FL, in the shape of the FedBT journal's Table 3 (Journal of
Software 2025, 36(9), p. 4127): centralised, BERT-FL (FedAvg training the whole model), truncated
models of the first L/2 and L/3 layers (the analogue of its DistilBERT / TinyBERT-6 / TinyBERT-4
rows) and FedBT (`--layer-schedule fedbt`, c = L/2), on rotten tomatoes and 20 Newsgroups
(accuracy) and NERO and WNUT-16 (entity F1), MiniLM-L6, at the scale a 2-core CPU runs. Writes
docs/fedbt_study.md and its plot (with docs/fedbt_study_discussion.md, written by hand from the
tables, appended).

    nice -n 10 python tools/fedbt_study.py                  # every missing run, then the report
    nice -n 10 python tools/fedbt_study.py --datasets rt    # one dataset's runs
    nice -n 19 python tools/fedbt_study.py --plateau        # NERO at plateau (lib/fedbt_plateau.py)
    python tools/fedbt_study.py --report-only               # the report from the finished runs

The claim it tests (the journal's Table 3): FedBT 1.37 to 2.39 points below BERT-FL, at 48.26% of
its computation and 20.19% of its communication (measured on bert-base; the study checks its own
costs against bounds of 55% and 25%). The figure is the one global model's on the pooled test rows
(every method here trains one model: `pooled` in metrics.jsonl; centralised: its one client's
test split, 20% of the same subsample). FLOPs and bytes are exact counts (run.costs): shares of
the same seed's BERT-FL run, whose batches are the same; FedBT's own summary gives its share of
BERT-FL on its very batches too, and the report shows both.
Runs are `python -m fedjax_split.train ...` into runs/fedbt_study/<name> (tools/lib/study_runs.py).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fedbt_plateau  # noqa: E402
from study_runs import (  # noqa: E402
    ROOT,
    Runs,
    chosen,
    evaluated,
    fmt,
    mean_sd,
    pyplot,
    save_figure,
    write_report,
)

RUNS = Runs(ROOT / "runs" / "fedbt_study")
DOC = ROOT / "docs" / "fedbt_study.md"
DISCUSSION = ROOT / "docs" / "fedbt_study_discussion.md"  # appended to DOC
FIGURE_DIR = ROOT / "docs" / "figures"  # one figure a dataset: fedbt_study_<data>.png

# Sized for a 2-core CPU: six rounds (two of FedBT's cycles of 3 layers), evaluated every third
COMMON = ["--rounds=6", "--eval-every=3", "--checkpoint-every=3"]
DATASETS = {
    "rt": ("rotten tomatoes, K=3, Table I label shares", "accuracy",
           ["--config=configs/offline_rotten_tomatoes.py", "--max-examples=1500"]),
    "news": ("20 Newsgroups, K=10, Dirichlet 1.0", "accuracy",
             ["--config=configs/offline_20news.py", "--clients-per-round=all",
              "--max-examples=1500", "--max-length=64"]),
    "nero": ("NERO (biomedical NER), K=3, Dirichlet 1.0", "f1",
             ["--config=configs/offline_nero.py", "--max-examples=1500"]),
    "wnut16": ("WNUT-16 (Twitter NER), K=3, Dirichlet 1.0", "f1",
               ["--config=configs/offline_wnut16.py", "--max-examples=1500"]),
}  # fmt: skip
CENTRAL = ["--clients=1", "--clients-per-round=all", "--partition=iid"]
METHODS = {
    "central": ("centralised (one client, all data)", ["--critical-layer=L", *CENTRAL]),
    "bertfl": ("BERT-FL (FedAvg, whole model)", ["--critical-layer=L"]),
    "trunc3": ("truncated, first 3 of 6 layers (FedAvg)",
               ["--critical-layer=L", "--model-layers=3"]),
    "trunc2": ("truncated, first 2 of 6 layers (FedAvg)",
               ["--critical-layer=L", "--model-layers=2"]),
    "fedbt": ("FedBT, cycle of 3 of 6 layers", ["--critical-layer=L", "--layer-schedule=fedbt"]),
}  # fmt: skip
SEEDS = (0, 1, 2, 3, 4)


def name(data: str, method: str, seed: int) -> str:
    return f"{data}_{method}_s{seed}"


def runs(datasets: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Every run, seed by seed, so that an interrupted study has each method at the same seeds."""
    return [(name(d, m, s), [*DATASETS[d][2], *COMMON, *METHODS[m][1], f"--seed={s}"])
            for s in SEEDS for d in datasets for m in METHODS]  # fmt: skip


def figure(run: dict[str, Any], metric: str) -> float | None:
    """The final global model's figure: `pooled` (the whole model is shared in every method)."""
    scored = evaluated(run, metric)
    return scored[-1]["pooled"][metric] if scored else None


def _share(run: dict[str, Any], base: dict[str, Any] | None, key: str) -> float | None:
    if base is None:
        return None
    whole = base["records"][-1].get(key)
    part = run["records"][-1].get(key)
    return None if not whole or part is None else part / whole


def _shares(done: dict[int, Any], base: dict[int, Any], key: str) -> list[float]:
    """Each seed's share of the same seed's BERT-FL run (seeds without one left out)."""
    return [x for s, r in done.items() if (x := _share(r, base.get(s), key)) is not None]


def _paired(diffs: list[float]) -> str:
    """Mean ± sd of the per-seed differences and a paired t-test's two-sided p."""
    if len(diffs) < 2:
        return f"{fmt(diffs[0]) if diffs else '-'} (n={len(diffs)})"
    from scipy import stats

    p = stats.ttest_1samp(diffs, 0.0).pvalue
    spread = f"{statistics.mean(diffs):+.3f} ± {statistics.stdev(diffs):.3f}"
    return f"{spread} (n={len(diffs)}, paired t-test p = {p:.2g})"


def table(data: str) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """The dataset's rows: each method's final figure over the seeds, its shares of BERT-FL's
    FLOPs and upload (seed by seed against BERT-FL's run of the same seed), FedBT's paired
    difference with BERT-FL; seed 0's curves (round, figure)."""
    metric = DATASETS[data][1]
    lines = [f"| method | final {metric} (pooled test rows), mean ± sd | each seed | FLOPs share "
             "of BERT-FL | upload share | run seconds |", "|---|---|---|---|---|---|"]  # fmt: skip
    curves: dict[str, list[tuple[int, float]]] = {}
    loaded = {m: {s: r for s in SEEDS if (r := RUNS.load(name(data, m, s)))} for m in METHODS}
    base = loaded["bertfl"]
    for method, (label, _) in METHODS.items():
        done = loaded[method]
        if not done:
            continue
        values = [v for r in done.values() if (v := figure(r, metric)) is not None]
        flops, up = (_shares(done, base, key) for key in ("cum_flops", "cum_bytes_up"))
        secs = [r["summary"]["seconds"] for r in done.values()]
        lines.append(
            f"| {label} | {mean_sd(values)} | {', '.join(fmt(v) for v in values)} | "
            f"{_pct(flops)} | {'no communication' if method == 'central' else _pct(up)} | "
            f"{statistics.mean(secs):.0f} |"
        )
        if 0 in done:
            curves[label] = [(r["round"], r["pooled"][metric]) for r in evaluated(done[0], metric)]
    fedbt = loaded["fedbt"]
    diffs = [figure(r, metric) - figure(base[s], metric) for s, r in fedbt.items() if s in base]
    own = [x for r in fedbt.values()
           if (x := r["summary"].get("flops_share_of_bert_fl")) is not None]  # fmt: skip
    lines += ["", f"FedBT minus BERT-FL, seed by seed: {_paired(diffs)}. FedBT's own summary "
              f"puts its FLOPs at {_pct(own)} of BERT-FL's on its very batches."]  # fmt: skip
    return lines, curves


def _pct(values: Sequence[float]) -> str:
    if not values:
        return "-"
    lo, hi = f"{100 * min(values):.1f}", f"{100 * max(values):.1f}"
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"  # one figure where they print alike


def figure_path(data: str) -> Path:
    return FIGURE_DIR / f"fedbt_study_{data}.png"


def plot(data: str, curves: dict[str, list[tuple[int, float]]]) -> None:
    """One dataset's seed-0 curves: its own file, so that a section kept from an earlier report
    (its runs gone from this machine) keeps its figure too."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    for lab, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=lab)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{DATASETS[data][1]}, global model, pooled test rows")
    ax.set_title(f"{DATASETS[data][0]} (seed 0)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, figure_path(data))


def section(data: str) -> list[str] | None:
    """One dataset's section from the runs on this machine (its commits, command, table and
    figure); None when none of its runs is here."""
    title, _, base = DATASETS[data]
    names = [n for n, _ in runs([data])]
    commits = RUNS.commits(names)
    if not commits:
        return None
    lines, curves = table(data)
    if curves:
        plot(data, curves)
    figure_line = [f"![{title}: the global model's figure by round, seed 0]"
                   f"(figures/{figure_path(data).name})", ""] if curves else []  # fmt: skip
    return [f"## {title}", "", f"Runs at commit(s) {', '.join(commits)}.", "",
            "`python -m fedjax_split.train " + shlex.join([*base, *COMMON]) + "` with each "
            "method's flags (tools/fedbt_study.py's METHODS) and `--seed`.", "", *lines, "",
            *figure_line]  # fmt: skip


def earlier_sections() -> dict[str, list[str]]:
    """The dataset sections of the report already in docs/, by dataset: run directories are not
    committed, so a dataset whose runs are not on this machine keeps the section its runs wrote
    (with their commits) instead of vanishing from the report."""
    titles = {f"## {title}": data for data, (title, _, _) in DATASETS.items()}
    titles[f"## {fedbt_plateau.TITLE}"] = "plateau"
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in DOC.read_text().splitlines() if DOC.is_file() else []:
        if line.startswith("## "):
            current = found.setdefault(titles[line], []) if line in titles else None
        if current is not None:
            current.append(line)
    return {data: [*lines, ""] if lines[-1] else lines for data, lines in found.items()}


def report() -> None:
    text = ["# FedBT study (generated by tools/fedbt_study.py)", "",
            "MiniLM-L6 on a 2-core CPU; the figure is the final global model's on the pooled test "
            "rows, as mean ± sample standard deviation over the seeds that finished (n says how "
            "many); FLOPs and upload as shares of the same seed's BERT-FL run (exact counts, "
            "run.costs). Each section names the commits its runs ran at; a dataset whose runs are "
            "not on the machine that wrote this report keeps its earlier section. The discussion "
            "at the end says what the numbers allow.", ""]  # fmt: skip
    earlier = earlier_sections()
    for data in DATASETS:
        fresh = section(data)
        if fresh and data in earlier:  # say so: git diff then shows what the runs here replaced
            print(f"{data}: the earlier section is rewritten from the runs on this machine")
        text += fresh or earlier.get(data, [])
    text += fedbt_plateau.section() or earlier.get("plateau", [])
    write_report(DOC, text, DISCUSSION)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    p.add_argument("--datasets", default=",".join(DATASETS),
                   help=f"comma-separated, of {', '.join(DATASETS)}")  # fmt: skip
    p.add_argument("--seeds", type=int, default=len(SEEDS), help="run the first N seeds")
    p.add_argument(
        "--plateau",
        action="store_true",
        help="run the NERO plateau study's queue (tools/lib/fedbt_plateau.py) instead",
    )
    args = p.parse_args(argv)
    datasets = chosen(args.datasets, list(DATASETS), "dataset")
    if datasets is None:
        return 2
    if args.plateau and not args.report_only:
        fedbt_plateau.run_queue(fedbt_plateau.SEEDS[: args.seeds], after=report)
    elif not args.report_only:
        wanted = {name(d, m, s) for s in SEEDS[: args.seeds] for d in datasets for m in METHODS}
        for run_name, cmd in runs(datasets):
            if run_name in wanted:
                print(RUNS.run(run_name, cmd), flush=True)
    report()
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
