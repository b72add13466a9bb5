"""FedOpt's server settings tuned, then checked at their defaults: FedAdam, FedYogi and FedAdagrad's
server learning rate eta and tau over Reddi et al.'s grid (ICLR 2021, Appendix D: eta and tau
in powers of ten, eta in half decades, tau in 10^{-5..-1}). FedAdam's decade grid, cut to a
band of eta / tau, runs on a small tuning preset; its best cells, a half decade between them,
and FedYogi's and FedAdagrad's cells run on the full K=10 label ramp, where the defaults are
chosen; then every algorithm at its registry defaults (no --server-lr, no --server-tau) against
FedAvg on the K=10 ramp and on a second preset, K=3. Writes docs/fedopt_tuning.md and its plot
(with docs/fedopt_tuning_discussion.md, written by hand from the tables, appended).

    nice -n 10 python tools/fedopt_tuning.py                 # every missing run, then the report
    nice -n 10 python tools/fedopt_tuning.py --stage grid    # one stage: grid | full | check
    python tools/fedopt_tuning.py --report-only              # the report from the finished runs

The tuning preset is the K=10 label ramp (configs/study_rotten_tomatoes.py:k10) at 2,000 snippets
(130 training examples a client) and 5 rounds, everything shared (c = L); the full presets run
10 rounds. The figure is the accuracy after the last round (with c = L every client's model is
the global one).
Runs are `python -m fedjax_split.train ...` into runs/fedopt_tuning/<name>
(tools/lib/study_runs.py).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

from study_runs import ROOT, Runs, chosen, final, fmt, mean_sd, pyplot, save_figure, write_report  # noqa: E402

from fedjax_split.fed.algorithms import ALGORITHMS  # noqa: E402

RUNS = Runs(ROOT / "runs" / "fedopt_tuning")
DOC = ROOT / "docs" / "fedopt_tuning.md"
DISCUSSION = ROOT / "docs" / "fedopt_tuning_discussion.md"  # appended to DOC
FIGURE = ROOT / "docs" / "figures" / "fedopt_tuning.png"

TUNE = ["--config=configs/study_rotten_tomatoes.py:k10", "--max-examples=2000", "--rounds=5",
        "--eval-every=5", "--checkpoint-every=5", "--critical-layer=L"]  # fmt: skip
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
# Reddi et al.'s decades (eta 10^{-3..0} here), cut to the band where a server step is of the
# order of one round of client change (eta / tau between 0.1 and 100): outside it a step is either
# far below FedAvg's or a sign step of eta on every weight. FedAdam's cells run in this order
# (the likeliest first, so that a grid stopped early has them); FedYogi's and FedAdagrad's are
# FedAdam's best and its neighbours (docs/fedopt_tuning.md says which ran).
BAND = [(10.0**e, 10.0**t) for e in (-3, -2, -1, 0) for t in (-5, -4, -3, -2, -1)
        if -1 <= e - t <= 2]  # fmt: skip
FIRST = [(1e-2, 1e-2), (1e-1, 1e-1), (1e-2, 1e-3), (1e-1, 1e-2), (1.0, 1e-1), (1e-3, 1e-3)]
GRID = {"fedadam": FIRST + [c for c in BAND if c not in FIRST]}
# The tuning preset's five rounds on 130 examples a client turned out too short to rank the cells
# (docs/fedopt_tuning.md): FedAdam's best cells there run again on the full K=10 preset (10
# rounds) with a half decade between them (Reddi et al.'s grid steps by half decades, 10^{-1.5}
# = 0.0316), and the defaults are chosen there. FedYogi and FedAdagrad run only there, at the
# cells the FedAdam grid points to: where Delta^2 is small beside v's start tau^2, as here,
# sqrt(v) stays near tau in all three rules and a step is about (eta / tau) / 2 times the moment.
# FedYogi's two best K=10 cells, one test example apart there, run on K=3 too: the first default,
# 10^{-1.5}, overfit on K=3 at its check run; 1e-2 held there and is the default now.
FULL = {
    "k10": {
        "fedadam": [(1e-1, 1e-3), (10**-1.5, 1e-3), (1e-2, 1e-4), (1e-2, 1e-3)],
        "fedyogi": [(10**-1.5, 1e-3), (1e-2, 1e-3)],
        "fedadagrad": [(10**-2.5, 1e-3), (1e-2, 1e-3)],
    },
    "k3": {"fedyogi": [(10**-1.5, 1e-3), (1e-2, 1e-3)]},
}
PRESETS = {
    "k10": ("rotten tomatoes, K=10, Table II's label ramp (the full preset, 10 rounds)",
            ["--config=configs/study_rotten_tomatoes.py:k10", "--critical-layer=L"]),
    "k3": ("rotten tomatoes, K=3, Table I's 'other' row (the full preset, 10 rounds)",
           ["--config=configs/study_rotten_tomatoes.py:k3", "--critical-layer=L"]),
}  # fmt: skip
CHECKS = ("fedavg", *ADAPTIVE)
SEEDS = (0, 1, 2)


def exponent(x: float) -> str:
    """1e-2, or 1e-1.5 for Reddi et al.'s half decades."""
    e = math.log10(x)
    return f"1e{round(e)}" if abs(e - round(e)) < 1e-9 else f"1e{e:.1f}"


def grid_name(alg: str, eta: float | None = None, tau: float | None = None) -> str:
    return f"tune_{alg}" if eta is None else f"tune_{alg}_lr{exponent(eta)}_tau{exponent(tau)}"


def full_name(preset: str, alg: str, eta: float, tau: float) -> str:
    return f"{preset}grid_{alg}_lr{exponent(eta)}_tau{exponent(tau)}"


def full_runs() -> list[tuple[str, list[str]]]:
    """The best cells again on the full presets (seed 0)."""
    return [(full_name(preset, alg, eta, tau), [*PRESETS[preset][1], f"--algorithm={alg}",
             f"--server-lr={eta:g}", f"--server-tau={tau:g}"])
            for preset, algs in FULL.items() for alg, cells in algs.items()
            for eta, tau in cells]  # fmt: skip


def check_name(preset: str, alg: str, seed: int) -> str:
    return f"{preset}_{alg}_s{seed}"


def grid_runs() -> list[tuple[str, list[str]]]:
    """FedAvg on the tuning preset, then each algorithm's cells."""
    out = [(grid_name("fedavg"), [*TUNE, "--algorithm=fedavg"])]
    for alg, cells in GRID.items():
        out += [(grid_name(alg, eta, tau), [*TUNE, f"--algorithm={alg}", f"--server-lr={eta:g}",
                 f"--server-tau={tau:g}"]) for eta, tau in cells]  # fmt: skip
    return out


def check_runs(seeds: Sequence[int]) -> list[tuple[str, list[str]]]:
    """Each algorithm at its registry defaults on each full preset, seed by seed: FedAdam and
    FedAvg on both presets first (the claim), then FedYogi and FedAdagrad."""
    order = [(p, alg) for p in PRESETS for alg in ("fedadam", "fedavg")]
    order += [(p, alg) for p in PRESETS for alg in CHECKS if (p, alg) not in order]
    return [(check_name(p, alg, s), [*PRESETS[p][1], f"--algorithm={alg}", f"--seed={s}"])
            for s in seeds for p, alg in order]  # fmt: skip


def _grid_table(alg: str) -> tuple[list[str], dict[tuple[float, float], float]]:
    etas = sorted({e for e, _ in GRID[alg]})
    taus = sorted({t for _, t in GRID[alg]})
    scores: dict[tuple[float, float], float] = {}
    lines = ["| eta \\ tau | " + " | ".join(exponent(t) for t in taus) + " |",
             "|---|" + "---|" * len(taus)]  # fmt: skip
    for eta in etas:
        cells = []
        for tau in taus:
            run = RUNS.load(grid_name(alg, eta, tau)) if (eta, tau) in GRID[alg] else None
            value = final(run) if run else None
            if value is not None:
                scores[(eta, tau)] = value
            cells.append("not in the grid" if (eta, tau) not in GRID[alg] else _cell(run))
        lines.append(f"| {exponent(eta)} | " + " | ".join(cells) + " |")
    return lines, scores


def _cell(run: dict | None) -> str:
    """'accuracy (training loss)' after the last round; '-' for a run not finished."""
    if run is None:
        return "-"
    return f"{fmt(final(run))} ({fmt(final(run, 'train_loss'))})"


def _defaults_line(alg: str, scores: dict[tuple[float, float], float]) -> str:
    a = ALGORITHMS[alg]
    best = max(scores, key=scores.get) if scores else None
    chosen = (f"The best cell on this preset: eta {best[0]:g}, tau {best[1]:g} "
              f"({fmt(scores[best])}). " if best else "")  # fmt: skip
    return f"{chosen}{a.title}'s registry defaults: eta {a.server_lr:g}, tau {a.tau:g}."


def _full_table(preset: str = "k10") -> list[str]:
    lines = ["| algorithm | eta | tau | final accuracy | best round's | final training loss "
             "| run |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for alg, cells in FULL[preset].items():
        for eta, tau in cells:
            run = RUNS.load(full_name(preset, alg, eta, tau))
            best = max((r["accuracy"] for r in run["records"] if r.get("accuracy") is not None),
                       default=None) if run else None  # fmt: skip
            loss = fmt(final(run, "train_loss")) if run else "-"
            a = ALGORITHMS[alg]
            default = " (the default)" if is_default(alg, eta, tau) else ""
            lines.append(f"| {a.title}{default} | {eta:.3g} | {tau:g} | "
                         f"{fmt(final(run)) if run else '-'} | {fmt(best)} | {loss} | "
                         f"`{full_name(preset, alg, eta, tau)}` |")  # fmt: skip
    return lines


def is_default(alg: str, eta: float, tau: float) -> bool:
    """Whether (eta, tau) is `alg`'s registry default."""
    a = ALGORITHMS[alg]
    return math.isclose(eta, a.server_lr) and a.tau is not None and math.isclose(tau, a.tau)


def at_defaults(alg: str, run: dict[str, Any]) -> bool:
    """Whether a check run ran the registry's present defaults: a run from before a default
    changed is left out of its table. Runs saved before config.json recorded the resolved server
    settings (bfdd2cc) ran the defaults of their commit, the present ones for every check run."""
    ran = run["config"].get("server_settings")
    a = ALGORITHMS[alg]
    return ran is None or (math.isclose(ran["server_lr"], a.server_lr)
                           and (a.tau is None or math.isclose(ran["server_tau"], a.tau)))


def _check_table(preset: str) -> list[str]:
    lines = ["| algorithm (registry defaults) | final accuracy, mean ± sd | each seed | runs |",
             "|---|---|---|---|"]  # fmt: skip
    for alg in CHECKS:
        done = [(s, r, name) for s in SEEDS if (r := RUNS.load(name := check_name(preset, alg, s)))
                and at_defaults(alg, r)]  # fmt: skip
        if not any(s == 0 for s, _, _ in done) and (cell := default_cell(preset, alg)):
            done.insert(0, (0, cell[1], cell[0]))  # seed 0 at these very flags, run as a cell
        values = [v for _, r, _ in done if (v := final(r)) is not None]
        a = ALGORITHMS[alg]
        setting = f"eta {a.server_lr:g}" + ("" if a.tau is None else f", tau {a.tau:g}")
        seeds = ", ".join(f"s{s}: {fmt(final(r))}" for s, r, _ in done) or "-"
        names = ", ".join(f"`{name}`" for _, _, name in done)
        lines.append(f"| {a.title} ({setting}) | {mean_sd(values)} | {seeds} | {names} |")
    return lines


def set_aside_if_stale(name: str, alg: str) -> None:
    """A check run that ran an older default is renamed (with its log) to `<name>_at_lr<eta>`,
    so that the check runs again at the present defaults and nothing run is lost."""
    run = RUNS.load(name)
    if run is None or at_defaults(alg, run):
        return
    base = f"{name}_at_lr{exponent(run['config']['server_settings']['server_lr'])}"
    aside, n = base, 1
    while any((RUNS.directory / f"{aside}{s}").exists() for s in ("", ".log")):
        n += 1  # one set aside at this lr already: a second one is not renamed over it
        aside = f"{base}_{n}"
    for suffix in ("", ".log"):
        if (RUNS.directory / f"{name}{suffix}").exists():
            (RUNS.directory / f"{name}{suffix}").rename(RUNS.directory / f"{aside}{suffix}")
    print(f"{name}: ran older defaults; set aside as {aside}", flush=True)


def default_cell(preset: str, alg: str) -> tuple[str, dict[str, Any]] | None:
    """(name, run) of the full-preset cell at `alg`'s registry defaults, if it ran: seed 0 with
    the server flags set to what leaving them unset resolves to, so the same run."""
    for eta, tau in FULL.get(preset, {}).get(alg, []):
        if is_default(alg, eta, tau):
            name = full_name(preset, alg, eta, tau)
            run = RUNS.load(name)
            return (name, run) if run else None
    return None


def plot(all_scores: dict[str, dict[tuple[float, float], float]], fedavg: float | None) -> None:
    """Left: the tuning preset's accuracy against eta / tau; right: the full K=10 preset's
    accuracy by round, FedAvg's (the check run at seed 0) beside each cell's."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for alg, scores in all_scores.items():
        pts = sorted(scores.items(), key=lambda kv: kv[0][0] / kv[0][1])
        left.plot([e / t for (e, t), _ in pts], [v for _, v in pts], "o",
                  label=f"{ALGORITHMS[alg].title} (one point per eta, tau)")  # fmt: skip
    if fedavg is not None:
        left.axhline(fedavg, color="k", ls="--", lw=1, label="FedAvg (server lr 1)")
    left.set_xscale("log")
    left.set_xlabel("eta / tau (server learning rate over tau)")
    left.set_ylabel("accuracy after 5 rounds")
    left.set_title("Tuning preset: K=10 ramp, 2,000 snippets, 5 rounds")
    left.legend(fontsize=7)
    curves = [(f"{ALGORITHMS[alg].title} eta {eta:.3g}, tau {tau:g}",
               RUNS.load(full_name("k10", alg, eta, tau)))
              for alg, cells in FULL["k10"].items() for eta, tau in cells]  # fmt: skip
    curves.append(("FedAvg (server lr 1)", RUNS.load(check_name("k10", "fedavg", 0))))
    for label, run in curves:
        if run is None:
            continue
        pts = [(r["round"], r["accuracy"]) for r in run["records"] if r.get("accuracy") is not None]
        style = {"color": "k", "ls": "--"} if label.startswith("FedAvg") else {}
        right.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                   **style)  # fmt: skip
    right.set_xlabel("round")
    right.set_ylabel("accuracy (the global model, each client's test split)")
    right.set_title("Full K=10 preset, 10 rounds, seed 0")
    right.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def report() -> None:
    names = [n for n, _ in [*grid_runs(), *full_runs(), *check_runs(SEEDS)]]
    fedavg_run = RUNS.load(grid_name("fedavg"))
    fedavg = final(fedavg_run) if fedavg_run else None
    text = ["# FedOpt's server settings, tuned (generated by tools/fedopt_tuning.py)", "",
            f"Runs at commit(s) {', '.join(RUNS.commits(names)) or '-'}. MiniLM-L6 on a 2-core "
            "CPU, everything shared (c = L). Figures: accuracy after the last round.", "",
            "## The grid, on the tuning preset", "",
            "`python -m fedjax_split.train " + shlex.join(TUNE) + " --algorithm=ALG "
            "--server-lr=ETA --server-tau=TAU`; each cell: accuracy (the clients' mean training "
            "loss in the last round). FedAvg (server lr 1) on the same preset: "
            f"{_cell(fedavg_run)}.", ""]  # fmt: skip
    all_scores = {}
    for alg in GRID:
        lines, scores = _grid_table(alg)
        all_scores[alg] = scores
        text += [f"### {ALGORITHMS[alg].title}", "", *lines, "", _defaults_line(alg, scores), ""]
    if any(all_scores.values()):
        plot(all_scores, fedavg)
        text += ["![accuracy against eta / tau, and by round on the full preset]"
                 "(figures/fedopt_tuning.png)", ""]  # fmt: skip
    for preset in FULL:
        text += [f"## Cells on {PRESETS[preset][0]}, seed 0", "",
                 f"`python -m fedjax_split.train {shlex.join(PRESETS[preset][1])} --algorithm=ALG "
                 "--server-lr=ETA --server-tau=TAU`", "", *_full_table(preset), ""]  # fmt: skip
    for preset, (title, flags) in PRESETS.items():
        command = f"`python -m fedjax_split.train {shlex.join(flags)} --algorithm=ALG --seed=S`"
        text += [f"## At the defaults: {title}", "", command, "", *_check_table(preset), ""]
    write_report(DOC, text, DISCUSSION)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
    p.add_argument("--stage", choices=("grid", "full", "check", "all"), default="all")
    p.add_argument("--seeds", type=int, default=1, help="check runs: the first N seeds")
    p.add_argument("--presets", default=",".join(PRESETS),
                   help="full and check runs: which presets")  # fmt: skip
    p.add_argument("--algorithms", default=",".join(ADAPTIVE),
                   help="which algorithms' runs (FedAvg's always)")  # fmt: skip
    args = p.parse_args(argv)
    presets = chosen(args.presets, list(PRESETS), "preset")
    if presets is None:
        return 2
    if not args.report_only:
        algs = {"fedavg", *(x.strip() for x in args.algorithms.split(","))}
        stages = {"grid": grid_runs(),
                  "full": [(n, c) for n, c in full_runs()
                           if n.split("_")[0].removesuffix("grid") in presets],
                  "check": [(n, c) for n, c in check_runs(SEEDS[: args.seeds])
                            if n.split("_")[0] in presets]}  # fmt: skip
        todo = [(n, c) for stage, planned in stages.items() if args.stage in (stage, "all")
                for n, c in planned if n.split("_")[1] in algs]  # fmt: skip
        checks = {n for n, _ in check_runs(SEEDS)}
        for run_name, cmd in todo:
            if run_name in checks:
                set_aside_if_stale(run_name, run_name.split("_")[1])
            print(RUNS.run(run_name, cmd), flush=True)
    report()
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
