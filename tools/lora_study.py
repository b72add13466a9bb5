"""LoRA against full fine-tuning, federated: accuracy against the megabytes sent, with FedAvg and
FedSplitBERT c=3, on rotten tomatoes (K=10, Table II's label ramp) and 20 Newsgroups (Dirichlet
label skew), at the scale a 2-core CPU runs. Writes docs/lora_study.md and its plot (with
docs/lora_study_discussion.md, written by hand from the tables, appended).

    nice -n 10 python tools/lora_study.py          # every missing run, then the report
    python tools/lora_study.py --report-only       # the report from the finished runs

Runs are `python -m fedjax_split.train ...` into runs/lora_study/<name> (tools/lib/study_runs.py).
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

from study_runs import ROOT, Runs, final, fmt, mean_sd, pyplot, save_figure, write_report  # noqa: E402

RUNS = Runs(ROOT / "runs" / "lora_study")
DOC = ROOT / "docs" / "lora_study.md"
DISCUSSION = ROOT / "docs" / "lora_study_discussion.md"  # appended to DOC
FIGURE = ROOT / "docs" / "figures" / "lora_accuracy_mb.png"
MB = 1e6

# Both sized to run in minutes on 2 cores: rotten tomatoes' K=10 preset at 2,400 snippets (150
# training examples a client, 64 tokens, 8 rounds), 20 Newsgroups at 1,200 documents over 10
# clients (about 96 training documents a client, cut to 64 tokens, 6 rounds); 1 local epoch,
# every client every round, evaluated every round.
DATASETS = {
    "rt": ("rotten tomatoes, K=10 label ramp",
           ["--config=configs/study_rotten_tomatoes.py:k10", "--max-examples=2400", "--rounds=8"]),
    "news": ("20 Newsgroups, K=10 Dirichlet 1.0",
             ["--config=configs/study_20news.py", "--clients=10", "--clients-per-round=10",
              "--max-examples=1200", "--max-length=64", "--rounds=6", "--eval-every=1",
              "--checkpoint-every=2"]),
}  # fmt: skip
METHODS = {"fedavg": ("FedAvg", "--critical-layer=L"),
           "fedsplit": ("FedSplitBERT c=3", "--critical-layer=3")}  # fmt: skip
RANKS = (None, 4, 8, 16)  # None: full fine-tuning at the preset's lr 5e-5
# LoRA's learning rate: Hu et al. (2021) fine-tune RoBERTa-base's adapters at 4e-4 to 5e-4 (their
# Table 9), ten times full fine-tuning's, over many epochs; here a client takes about 80 steps in
# all, and at 5e-4 FedAvg's adapters learned nothing in 8 rounds (the check below), so the grid
# runs at 2e-3 and the check keeps r = 8 at 5e-4 beside it (rotten tomatoes, seed 0).
LORA_LR = "2e-3"
LR_CHECK = "5e-4"
# Two seeds where the time allowed (each: its own partition, head and adapter draws, batches)
SEEDS = {"rt": (0, 1), "news": (0,)}


def name(data: str, method: str, rank: int | None, seed: int, lr: str = LORA_LR) -> str:
    kind = "full" if rank is None else f"r{rank}_lr{lr}"
    return f"{data}_{method}_{kind}_s{seed}"


def label(method: str, rank: int | None, lr: str = LORA_LR) -> str:
    what = "full model" if rank is None else f"LoRA r={rank}"
    return f"{METHODS[method][0]}, {what}" + ("" if lr == LORA_LR else f", lr {lr}")


def _args(data: str, method: str, rank: int | None, seed: int, lr: str = LORA_LR) -> list[str]:
    lora = [] if rank is None else [f"--lora-rank={rank}", f"--lr={lr}"]
    return [*DATASETS[data][1], METHODS[method][1], *lora, f"--seed={seed}"]


def runs() -> list[tuple[str, list[str]]]:
    """Every run, seed by seed, so that an interrupted study has each setting at the same seeds;
    the learning-rate check after seed 0's grid."""
    out = []
    for seed in sorted({s for seeds in SEEDS.values() for s in seeds}):
        for data in DATASETS:
            if seed not in SEEDS[data]:
                continue
            for rank in RANKS:
                for method in METHODS:
                    out.append((name(data, method, rank, seed), _args(data, method, rank, seed)))
        if seed == 0:
            for method in METHODS:
                check = (name("rt", method, 8, 0, LR_CHECK), _args("rt", method, 8, 0, LR_CHECK))
                out.append(check)
    return out


def mb_to_reach(run: dict[str, Any], target: float | None) -> float | None:
    """Megabytes sent (up and down, all clients) when the accuracy first reached `target`."""
    if target is None:
        return None
    for r in run["records"]:
        if r.get("accuracy") is not None and r["accuracy"] >= target - 1e-12:
            return r["cum_bytes"] / MB
    return None


def client_seconds(run: dict[str, Any]) -> float | None:
    """A client's training seconds in a round after the first (which compiles): the round's
    training time over the clients it trained, one after another on this CPU."""
    rounds = [r for r in run["records"][1:] if r.get("train_seconds") is not None]
    if not rounds:
        return None
    return statistics.mean(r["train_seconds"] / max(1, len(r["clients_sampled"])) for r in rounds)


Row = tuple[str, int | None, str]  # (method, rank or None for the full model, LoRA's lr)


def table(
    data: str, rows: Sequence[Row] | None = None, seeds: Sequence[int] | None = None
) -> tuple[list[str], dict[str, list[tuple[float, float]]], float | None]:
    """The dataset's table of `rows` (default: the grid) over `seeds` (default: the dataset's):
    each figure a mean ± sd over the seeds, each seed's beside it where there are several; seed
    0's accuracy-against-MB curves, and the label prior's figure."""
    lines = ["| method | trained / shared parameters a client | upload a round, MB (all clients) "
             "| final accuracy | total MB sent | MB to reach FedAvg's final accuracy (each seed) "
             "| client seconds a round |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    curves: dict[str, list[tuple[float, float]]] = {}
    seeds = SEEDS[data] if seeds is None else seeds
    rows = [(m, r, LORA_LR) for r in RANKS for m in METHODS] if rows is None else rows
    bases = {s: RUNS.load(name(data, "fedavg", None, s)) for s in seeds}
    targets = {s: None if b is None else final(b) for s, b in bases.items()}
    for method, rank, lr in rows:
        done = {s: r for s in seeds if (r := RUNS.load(name(data, method, rank, s, lr)))}
        if not done:
            continue
        run = next(iter(done.values()))
        s, recs = run["summary"], run["records"]
        shared = s["global_params"]
        params = f"{shared + s['local_params_per_client']:,} / {shared:,}"
        up = recs[-1]["bytes_up"] / MB
        accs = [a for r in done.values() if (a := final(r)) is not None]
        each = f" ({', '.join(fmt(a) for a in accs)})" if len(accs) > 1 else ""
        reach = [mb_to_reach(r, targets[k]) for k, r in done.items()]
        reached = ", ".join("not reached" if m is None else f"{m:,.2f}" for m in reach)
        secs = [c for r in done.values() if (c := client_seconds(r)) is not None]
        lines.append(
            f"| {label(method, rank, lr)} | {params} | {up:.2f} | {mean_sd(accs)}{each} | "
            f"{recs[-1]['cum_bytes'] / MB:,.2f} | {reached} | "
            f"{fmt(statistics.mean(secs) if secs else None, 2)} |"
        )
        if seeds[0] in done:
            curves[label(method, rank, lr)] = [(r["cum_bytes"] / MB, r["accuracy"])
                                               for r in done[seeds[0]]["records"]
                                               if r.get("accuracy") is not None]  # fmt: skip
    priors = [p for r in bases.values() if r and (p := r["summary"].get("majority_label"))]
    prior = statistics.mean(priors) if priors else None
    if prior is not None:
        lines += ["", f"Each client's majority label alone (the label prior, no model) scores "
                      f"{prior:.3f} on this partition (mean over clients).",
                  ]  # fmt: skip
    return lines, curves, prior


def plot(
    all_curves: dict[str, dict[str, list[tuple[float, float]]]], priors: dict[str, float | None]
) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(all_curves), figsize=(6 * len(all_curves), 4.2), squeeze=False)
    for ax, (data, curves) in zip(axes[0], all_curves.items(), strict=True):
        for i, (lab, pts) in enumerate(curves.items()):
            style = "-" if "FedAvg" in lab else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                    color=f"C{i // 2}", label=lab)  # fmt: skip
        if priors.get(data) is not None:
            ax.axhline(priors[data], ls=":", color="gray", label="each client's majority label")
        ax.set_xscale("log")
        ax.set_xlabel("megabytes sent, up and down, all clients (log scale)")
        ax.set_ylabel("personalised accuracy, mean over clients")
        ax.set_title(DATASETS[data][0])
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def report() -> None:
    text = [
        "# LoRA study (generated by tools/lora_study.py)",
        "",
        f"Runs at commit(s) {', '.join(RUNS.commits([n for n, _ in runs()])) or '-'}; "
        f"seeds a setting: rotten tomatoes {len(SEEDS['rt'])}, 20 Newsgroups {len(SEEDS['news'])} "
        "(accuracy as mean ± sample standard "
        "deviation, each seed's in brackets; the bytes are exact). The curves are seed 0's. The "
        "discussion at the end says what the numbers allow. MiniLM-L6 on a 2-core CPU. Full "
        "fine-tuning at the preset's lr 5e-5, LoRA (on the attention's query and value, alpha = "
        f"2r, PEFT's defaults) at {LORA_LR} (the learning-rate check at the end says why).",
        "",
    ]
    all_curves, priors = {}, {}
    for data, (title, base) in DATASETS.items():
        lines, curves, priors[data] = table(data)
        all_curves[data] = curves
        text += [
            f"## {title}",
            "",
            "`python -m fedjax_split.train " + shlex.join(base) + "` with `--critical-layer L` "
            f"(FedAvg) or `3` (FedSplitBERT), and for LoRA `--lora-rank R --lr {LORA_LR}`.",
            "",
            *lines,
            "",
        ]
    plot(all_curves, priors)
    text += ["![accuracy against megabytes](figures/lora_accuracy_mb.png)", ""]
    check = [(m, 8, lr) for lr in (LR_CHECK, LORA_LR) for m in METHODS]
    lines, _, _ = table("rt", check, seeds=(0,))
    text += ["## The learning-rate check (rotten tomatoes, seed 0)", "",
             f"LoRA r = 8 at lr {LR_CHECK} (ten times the full model's, Hu et al.'s RoBERTa-base "
             f"setting) and at {LORA_LR}, the grid's.", "",
             *(x for x in lines if x.startswith("|")), ""]  # fmt: skip
    write_report(DOC, text, DISCUSSION)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    args = p.parse_args(argv)
    if not args.report_only:
        for run_name, cmd in runs():
            print(RUNS.run(run_name, cmd), flush=True)
    report()
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
