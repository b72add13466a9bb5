"""Client-level DP and robust aggregation on real data, offline, at the scale a 2-core CPU runs:
accuracy against epsilon for FedAvg and FedSplitBERT, and one attacking client in ten against the
mean, the trimmed mean, the median and a norm bound. Writes docs/privacy_study.md and its plots
(with docs/privacy_study_discussion.md, written by hand from the tables, appended).

    nice -n 10 python tools/privacy_study.py          # every missing run, then the report
    python tools/privacy_study.py --report-only       # the report from the finished runs
    python tools/privacy_study.py --only attack       # one part: dp | attack

Runs are `python -m fedjax_split.train ...` into runs/privacy_study/<name>
(tools/lib/study_runs.py): a finished run (summary.json) is not run again, an interrupted one is
continued with --resume. One at a time.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

from study_runs import ROOT, Runs, final, fmt, mean_sd, pyplot, save_figure, write_report  # noqa: E402

STUDY = Runs(ROOT / "runs" / "privacy_study")
load = STUDY.load
DOC = ROOT / "docs" / "privacy_study.md"
DISCUSSION = ROOT / "docs" / "privacy_study_discussion.md"  # appended to DOC
FIGURES = ROOT / "docs" / "figures"

# DP: 100 clients holding 30 rotten-tomatoes snippets each (label skew: Dirichlet 1.0), 20 a
# round in expectation (Poisson with DP), 6 rounds of 2 local epochs (each client takes part
# about 1.2 times), delta 1e-3 (< 1/K), adaptive clipping from 0.1.
DP_BASE = [
    "--config=configs/offline_rotten_tomatoes.py", "--max-examples=3000", "--clients=100",
    "--clients-per-round=20", "--partition=dirichlet", "--alpha=1.0", "--rounds=6",
    "--local-epochs=2", "--eval-every=6", "--dp-delta=1e-3",
]  # fmt: skip
DP_SEEDS = (0, 1)  # each seed: its own partition, sampling, initial head and noise
DP_CLIP = ["--dp-clip=0.1", "--dp-clip-quantile=0.5"]
METHODS = {"fedavg": ("FedAvg", "--critical-layer=L"),
           "fedsplit": ("FedSplitBERT c=3", "--critical-layer=3")}  # fmt: skip
NOISE = (None, 0.5, 1.0)  # None: no DP

# Attack: 10 clients, all every round; client(s) chosen by the seed send x100 or -1 x their update.
# FedAvg (the whole model shared) at lr 1e-4 with 2 local epochs, so that the clean global model
# learns more than the majority class in 3 rounds (at the preset's 5e-5 and 1 epoch it did not).
ATTACK_BASE = [
    "--config=configs/offline_rotten_tomatoes.py", "--max-examples=1000", "--clients=10",
    "--partition=dirichlet", "--alpha=1.0", "--rounds=3", "--local-epochs=2", "--lr=1e-4",
    "--critical-layer=L",
]  # fmt: skip
ATTACK_SEEDS = (0, 1)  # each seed: its own partition and attacker
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
    for seed in DP_SEEDS:
        for m, (_, flag) in METHODS.items():
            for z in NOISE:
                dp = [] if z is None else [f"--dp-noise-multiplier={z}", *DP_CLIP]
                out.append((f"dp_{m}_z{z}_s{seed}", [*DP_BASE, f"--seed={seed}", flag, *dp]))
    return out


def clean_norm(seed: int) -> float | None:
    """Twice the median update norm of the clean run's first round (it records the norms)."""
    run = load(f"attack_none_measured_s{seed}")
    if run is None:
        return None
    return 2 * statistics.median(run["records"][0]["update_norms"])


def attack_runs() -> list[tuple[str, list[str]]]:
    out = []
    for seed in ATTACK_SEEDS:
        base = [*ATTACK_BASE, f"--seed={seed}"]
        # the clean run measures the norms (a bound no update reaches: the mean, norms recorded)
        out.append((f"attack_none_measured_s{seed}", [*base, "--max-update-norm=1e9"]))
        bound = clean_norm(seed)
        for a in ATTACKS:
            for d, (_, flags) in DEFENCES.items():
                if a == "sign-flip" and d == "norm":
                    continue  # a sign flip keeps the norm: the bound is the mean's run
                if flags is None:
                    if bound is None:
                        continue  # after the clean run
                    flags = [f"--max-update-norm={bound:.6g}"]
                out.append((f"attack_{a}_{d}_s{seed}", [*base, f"--attack={a}", *flags]))
    return out


def dp_table() -> tuple[list[str], dict[str, list[tuple[float, float, float]]]]:
    lines = ["| method | noise multiplier z | epsilon (delta 1e-3) | accuracy, mean ± sd over "
             "seeds | each seed | clients that trained: accuracy | majority label |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    curves: dict[str, list[tuple[float, float, float]]] = {}
    for m, (label, _) in METHODS.items():
        for z in NOISE:
            runs = [r for s in DP_SEEDS if (r := load(f"dp_{m}_z{z}_s{s}")) is not None]
            if not runs:
                continue
            eps = runs[0]["records"][-1].get("epsilon")  # the same for every seed
            accs = [a for r in runs if (a := final(r)) is not None]
            majority = [r["summary"].get("majority_label") for r in runs]
            trained = [t["accuracy"] for r in runs if (t := final(r, "trained_mean"))]
            lines.append(f"| {label} | {'no DP' if z is None else z} | "
                         f"{'inf' if eps is None else fmt(eps, 2)} | {mean_sd(accs)} | "
                         f"{', '.join(fmt(a) for a in accs)} | {mean_sd(trained)} | "
                         f"{fmt(statistics.mean(majority))} |")  # fmt: skip
            if accs:  # no DP: epsilon infinite, drawn as a level
                sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
                point = (math.inf if eps is None else eps, statistics.mean(accs), sd)
                curves.setdefault(label, []).append(point)
    return lines, curves


def attack_table() -> tuple[list[str], dict[str, list[float]]]:
    lines = ["| attack | server's rule | final accuracy, mean ± sd over seeds | each seed, "
             "accuracy after rounds 1-2-3 |", "|---|---|---|---|"]  # fmt: skip
    series: dict[str, list[float]] = {}
    rows = [("none", "no attack", "mean", "attack_none_measured")]
    rows += [(a, a_label, d_label, f"attack_{a}_{d}") for a, a_label in ATTACKS.items()
             for d, (d_label, _) in DEFENCES.items()]  # fmt: skip
    for _, a_label, d_label, stem in rows:
        runs = [r for s in ATTACK_SEEDS if (r := load(f"{stem}_s{s}")) is not None]
        if not runs:  # (sign-flip x norm bound is not run)
            continue
        accs = [[r["accuracy"] for r in run["records"]] for run in runs]
        each = "; ".join("-".join(fmt(x) for x in a) for a in accs)
        lines.append(f"| {a_label} | {d_label} | {mean_sd([a[-1] for a in accs])} | {each} |")
        rounds = min(len(a) for a in accs)
        series[f"{a_label}, {d_label}"] = [statistics.mean(a[i] for a in accs)
                                           for i in range(rounds)]  # fmt: skip
    return lines, series


def plots(
    curves: dict[str, list[tuple[float, float, float]]], series: dict[str, list[float]]
) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, (label, pts) in enumerate(curves.items()):
        color = f"C{i}"
        dp = sorted(p for p in pts if math.isfinite(p[0]))
        ax.errorbar([p[0] for p in dp], [p[1] for p in dp], yerr=[p[2] for p in dp],
                    fmt="o-", capsize=3, color=color, label=f"{label}, DP")  # fmt: skip
        for _, level, _ in (p for p in pts if not math.isfinite(p[0])):
            ax.axhline(level, ls="--", color=color, label=f"{label}, no DP")
    majority = [m for r in (load(n) for n, _ in dp_runs()) if r is not None
                and (m := r["summary"].get("majority_label")) is not None]  # fmt: skip
    if majority:
        ax.axhline(statistics.mean(majority), ls=":", color="gray",
                   label="each client's majority label alone")  # fmt: skip
    ax.set_xlabel("epsilon after the run (delta = 1e-3)")
    ax.set_ylabel("personalised accuracy")
    ax.set_title("Client-level DP, 100 clients, ~20 a round")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, FIGURES / "privacy_epsilon.png")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for label, accs in series.items():
        ax.plot(range(1, len(accs) + 1), accs, "o-", label=label)
    ax.set_xticks(range(1, max((len(a) for a in series.values()), default=0) + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (FedAvg's global model)")
    ax.set_title(f"One client in ten attacking, 10 clients (mean of {len(ATTACK_SEEDS)} seeds)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    save_figure(fig, FIGURES / "privacy_attack.png")


def report() -> None:
    names = [n for n, _ in [*dp_runs(), *attack_runs()]]
    dp_lines, curves = dp_table()
    attack_lines, series = attack_table()
    plots(curves, series)
    bounds = [b for s in ATTACK_SEEDS if (b := clean_norm(s)) is not None]
    text = [
        "# Privacy and robustness study (generated by tools/privacy_study.py)",
        "",
        f"Runs at commit(s) {', '.join(STUDY.commits(names)) or '-'}; {len(DP_SEEDS)} seeds per DP "
        f"setting and {len(ATTACK_SEEDS)} per attack setting (mean ± sample standard deviation, "
        "each seed's value beside it). MiniLM-L6 on rotten-tomatoes snippets "
        "(configs/offline_rotten_tomatoes.py), on a 2-core CPU: what this machine runs, not the "
        "thousands of clients DP is usually deployed with. The discussion at the end says what the "
        "figures support.",
        "",
        "## Accuracy against epsilon",
        "",
        "`python -m fedjax_split.train " + shlex.join(DP_BASE) + "` with `--seed S`, "
        "`--critical-layer L` (FedAvg) or `3` (FedSplitBERT), and "
        f"`--dp-noise-multiplier Z {shlex.join(DP_CLIP)}`.",
        "",
        *dp_lines,
        "",
        "![accuracy against epsilon](figures/privacy_epsilon.png)",
        "",
        "## One attacking client in ten",
        "",
        "`python -m fedjax_split.train " + shlex.join(ATTACK_BASE) + "` with "
        "`--seed S --attack scale|sign-flip` and the server's rule; the norm bound is twice the "
        "clean run's median first-round update norm (per seed: "
        f"{', '.join(fmt(b, 4) for b in bounds) or '-'}).",
        "",
        *attack_lines,
        "",
        "![attack](figures/privacy_attack.png)",
        "",
    ]
    write_report(DOC, text, DISCUSSION)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    p.add_argument("--only", choices=("dp", "attack"), help="run one part only")
    args = p.parse_args(argv)
    if not args.report_only:
        parts = [x for x in ("dp", "attack") if args.only in (None, x)]
        # seed by seed, so that an interrupted study has every setting at the same seeds
        for seed in sorted({*DP_SEEDS, *ATTACK_SEEDS}):
            for part in parts:
                for _ in range(2):  # the attack's norm bound comes from its first run
                    for name, cmd in (attack_runs() if part == "attack" else dp_runs()):
                        if name.endswith(f"_s{seed}"):
                            print(STUDY.run(name, cmd), flush=True)
    report()
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
