"""FedBT at plateau (issue 48): NERO, K=3 Dirichlet 1.0, 5 seeds, long enough for BERT-FL to stop
gaining, evaluated every 3 rounds (one of FedBT's cycles of 3 layers). FedBT runs 12 rounds
more than BERT-FL, so that its cumulative FLOPs reach BERT-FL's at a plateau as late as round 24
(at 54% of BERT-FL's FLOPs a round: the equal-FLOPs reading). Arms: BERT-FL and FedBT
from MiniLM-L6, the centralised run, and BERT-FL and FedBT again from a MiniLM-L6 warmed by
masked LM on NERO text that no run of the study holds (the MLM-adapted start: it separates
the base model's part of FedBT's gap from the method's).

Run through tools/fedbt_study.py (`--plateau`), on the shared runner tools/lib/study_runs.py,
into runs/fedbt_study/plateau/<name>: every run resumable, each log naming its commits. The
queue puts the most informative first: BERT-FL and FedBT seed by seed (pairs), then the
centralised runs, then the warm-up and the MLM-start pairs.

The reading (`section`): the curve by round (mean and sample sd over seeds); BERT-FL's plateau,
the first evaluated round after which its mean never gains `PLATEAU_GAIN` or more; FedBT minus
BERT-FL paired by seed at that round and at equal cumulative FLOPs (FedBT at its first evaluated
round whose cumulative FLOPs reach the same seed's BERT-FL's at the plateau), each with a paired
t-test and a 95% CI; the same for the MLM start, and the MLM start minus MiniLM's.
"""

from __future__ import annotations

import math
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from anywhere: study_runs beside it

from study_runs import ROOT, Runs, evaluated, pyplot, save_figure  # noqa: E402

# each finished run's figures also in git (study_runs' ledger): runs/ is lost with a machine
LEDGER = ROOT / "docs" / "data" / "fedbt_plateau.jsonl"
RUNS = Runs(ROOT / "runs" / "fedbt_study" / "plateau", ledger=LEDGER)
FIGURE = ROOT / "docs" / "figures" / "fedbt_study_nero_plateau.png"
TITLE = "NERO at plateau: BERT-FL 36 rounds, FedBT 48, K=3, Dirichlet 1.0"
METRIC = "f1"
SEEDS = (0, 1, 2, 3, 4)
ROUNDS = 36  # 12 of FedBT's cycles of 3 layers (a multiple of 3: evaluations end cycles)
# BERT-FL's seed 0 (at ffb313d) gains under a point after round 18, where its cumulative FLOPs
# are those of FedBT's round 33.3: 36 rounds would leave a later plateau no equal-FLOPs round
FEDBT_ROUNDS = 48
# The budget: 2,000 of NERO's 24,002 sentences, 1,600 of them train. A BERT-FL round on them is
# about 35 s alone on the 2-core CPU (the 6-round study's 46 sentences a second; 67-85 s measured
# at 631a6e7 beside the test suite), so 36 rounds are about 22 min alone: near the 25 min a run
# was given. All 19,200 training sentences would be about 4 hours a run.
EXAMPLES = 2000
PLATEAU_GAIN = 0.01  # one point of F1
NERO_SENTENCES = 24002  # the offline NERO pool (ner_corpora.load_nero); checked when written
BASE = ["--config=configs/offline_nero.py", f"--max-examples={EXAMPLES}", "--eval-every=3",
        "--checkpoint-every=3", "--critical-layer=L"]  # fmt: skip
CENTRAL = ["--clients=1", "--clients-per-round=all", "--partition=iid", f"--rounds={ROUNDS}"]
FEDBT = ["--layer-schedule=fedbt", f"--rounds={FEDBT_ROUNDS}"]
TEXT = RUNS.directory / "warmup_text"  # NERO sentences outside every run (`warmup_rows`)
START = RUNS.directory / "warmup" / "model"
FREEZE_DECODER = r"--freeze=embeddings\.word_embeddings"  # the MLM decoder (tied)
_WARMUP = ["--corpus=local", f"--data-dir={TEXT}", "--method=centralised", "--clients=1",
           "--max-documents=8000", "--batch-size=16", "--max-length=128", "--seed=0"]  # fmt: skip
WARMUP_HEAD = [*_WARMUP, "--model=minilm-l6", r"--freeze=embeddings\.|encoder\.", "--rounds=3",
               "--lr=2e-3"]  # fmt: skip
WARMUP = [*_WARMUP, f"--model={RUNS.directory / 'warmup_head' / 'model'}", FREEZE_DECODER,
          "--rounds=3", "--lr=1e-4"]  # fmt: skip
ARMS = {  # name -> (label, flags)
    "bertfl": ("BERT-FL", [f"--rounds={ROUNDS}"]),
    "fedbt": ("FedBT", FEDBT),
    "central": ("centralised", CENTRAL),
    "mlm_bertfl": ("BERT-FL, MLM start", [f"--model={START}", f"--rounds={ROUNDS}"]),
    "mlm_fedbt": ("FedBT, MLM start", [f"--model={START}", *FEDBT]),
}  # fmt: skip


def name(arm: str, seed: int) -> str:
    return f"{arm}_s{seed}"


def queue(seeds: Sequence[int] = SEEDS) -> list[tuple[str, list[str], str]]:
    """(name, args, module) in the order they run: the pairs seed by seed, the centralised runs,
    the warm-up (head alone, then the model), the MLM-start pairs."""
    fine = [(name(a, s), [*BASE, *ARMS[a][1], f"--seed={s}"], "fedjax_split.train")
            for s in seeds for a in ("bertfl", "fedbt")]  # fmt: skip
    central = [(name("central", s), [*BASE, *CENTRAL, f"--seed={s}"], "fedjax_split.train")
               for s in seeds]  # fmt: skip
    warm = [("warmup_head", WARMUP_HEAD, "fedjax_split.pretrain"),
            ("warmup", WARMUP, "fedjax_split.pretrain")]  # fmt: skip
    mlm = [(name(a, s), [*BASE, *ARMS[a][1], f"--seed={s}"], "fedjax_split.train")
           for s in seeds for a in ("mlm_bertfl", "mlm_fedbt")]  # fmt: skip
    return [*fine, *central, *warm, *mlm]


def warmup_rows(n: int, examples: int, seeds: Sequence[int]) -> list[int]:
    """The pool rows in none of the seeds' subsamples (client_data.subsample_indices): text that no
    run of the study trains or tests on."""
    from fedjax_split.run.client_data import subsample_indices

    used: set[int] = set()
    for seed in seeds:
        idx = subsample_indices(n, examples, seed)
        used.update(range(n) if idx is None else idx.tolist())
    return [i for i in range(n) if i not in used]


def write_warmup_text() -> None:
    """TEXT/nero.txt: the warm-up's sentences, one document each (blank lines between)."""
    if (TEXT / "nero.txt").is_file():
        return
    from fedjax_split.data import sources
    from fedjax_split.tasks import registry

    task = registry.get_task("nero")
    pool = sources.load_examples(task, entity_types=task.entity_types)
    if len(pool.tokens) != NERO_SENTENCES:
        raise SystemExit(f"NERO has {len(pool.tokens)} sentences, not {NERO_SENTENCES}")
    rows = warmup_rows(len(pool.tokens), EXAMPLES, SEEDS)
    TEXT.mkdir(parents=True, exist_ok=True)
    (TEXT / "nero.txt").write_text("\n\n".join(" ".join(pool.tokens[i]) for i in rows) + "\n")


def run_queue(seeds: Sequence[int], after: Callable[[], None] = lambda: None) -> None:
    """Every missing run in queue order; `after` each one that ran (the report: the queue runs
    for hours, and the page then shows every run finished so far)."""
    for run_name, args, module in queue(seeds):
        if run_name == "warmup_head":
            write_warmup_text()
        status = RUNS.run(run_name, args, module)
        print(status, flush=True)
        if not status.endswith("done before"):
            after()


# ---------------------------------------------------------------------------------------------
# the reading


def curve(run: dict[str, Any]) -> dict[int, float]:
    """A run's figure at each evaluated round (the global model on the pooled test rows)."""
    return {r["round"]: r["pooled"][METRIC] for r in evaluated(run, METRIC)}


def mean_curve(runs: Sequence[dict[str, Any]]) -> list[tuple[int, float, float, int]]:
    """(round, mean, sample sd (0 for one run), n) over the runs, at each round any evaluated."""
    values: dict[int, list[float]] = {}
    for run in runs:
        for r, v in curve(run).items():
            values.setdefault(r, []).append(v)
    return [(r, statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v))
            for r, v in sorted(values.items())]  # fmt: skip


def plateau(points: Sequence[tuple[int, float]], gain: float = PLATEAU_GAIN) -> int | None:
    """The first round after which the mean never rises by `gain` or more (every later mean
    < its mean + gain); None when only the last round qualifies (no later round confirms it)."""
    for i, (r, v) in enumerate(points[:-1]):
        if all(later < v + gain for _, later in points[i + 1 :]):
            return r
    return None


def cum_flops(run: dict[str, Any], r: int) -> float | None:
    return next((x["cum_flops"] for x in run["records"] if x["round"] == r), None)


def flops_round(run: dict[str, Any], target: float) -> int | None:
    """The run's first evaluated round whose cumulative FLOPs reach `target`; None if none."""
    return next((r for r in curve(run) if cum_flops(run, r) >= target), None)


@dataclass(frozen=True)
class Paired:
    """A paired comparison: mean difference, sample sd, n, two-sided t-test p, 95% CI."""

    n: int
    mean: float
    sd: float
    p: float
    lo: float
    hi: float


def paired(diffs: Sequence[float]) -> Paired | None:
    """The one-sample t-test of the per-seed differences against 0 (the paired t-test) and the
    95% CI mean ± t(0.975, n-1) sd/sqrt(n); None under two differences. p is nan, and the CI the
    point, when every difference is the same."""
    if len(diffs) < 2:
        return None
    from scipy import stats

    n, m, sd = len(diffs), statistics.mean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return Paired(n, m, 0.0, math.nan, m, m)
    se = sd / math.sqrt(n)
    p = 2 * stats.t.sf(abs(m / se), n - 1)
    half = stats.t.ppf(0.975, n - 1) * se
    return Paired(n, m, sd, float(p), m - half, m + half)


def gaps(
    arm: dict[int, Any], base: dict[int, Any], at: int, equal_flops: bool = False
) -> tuple[list[float], list[int]]:
    """Per seed with both runs: arm minus base, base at round `at`; arm at `at` too, or with
    `equal_flops` at its first evaluated round whose cumulative FLOPs reach base's at `at`
    (seeds where it never does are left out). Returns (differences, the arm's rounds)."""
    diffs, rounds = [], []
    for s in sorted(arm.keys() & base.keys()):
        r = flops_round(arm[s], cum_flops(base[s], at)) if equal_flops else at
        if r is not None and r in curve(arm[s]) and at in curve(base[s]):
            diffs.append(curve(arm[s])[r] - curve(base[s])[at])
            rounds.append(r)
    return diffs, rounds


# ---------------------------------------------------------------------------------------------
# the report


def load_all(seeds: Sequence[int] = SEEDS) -> dict[str, dict[int, Any]]:
    """Each arm's finished runs by seed."""
    return {a: {s: r for s in seeds if (r := RUNS.load(name(a, s)))} for a in ARMS}


def _cell(mean: float, sd: float, n: int) -> str:
    return f"{mean:.3f} ± {sd:.3f}" if n > 1 else f"{mean:.3f}"


def round_table(runs: dict[str, dict[int, Any]]) -> list[str]:
    """The figure by round: mean ± sample sd over the arm's finished seeds (n in the header)."""
    arms = [a for a in ARMS if runs[a]]
    curves = {a: {r: (m, sd, n) for r, m, sd, n in mean_curve(list(runs[a].values()))}
              for a in arms}  # fmt: skip
    rounds = sorted({r for c in curves.values() for r in c})
    lines = ["| round | " + " | ".join(f"{ARMS[a][0]} (n={len(runs[a])})" for a in arms) + " |",
             "|---" * (len(arms) + 1) + "|"]  # fmt: skip
    for r in rounds:
        cells = [_cell(*curves[a][r]) if r in curves[a] else "-" for a in arms]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines


def _row(label: str, diffs: list[float], rounds: list[int], pairs: int) -> str:
    """One comparison's table row; `pairs`: the seeds with both runs (some may be left out)."""
    test = paired(diffs)
    where = ", ".join(str(r) for r in sorted(set(rounds))) or "-"
    left = f" ({pairs - len(diffs)} of {pairs} never reached it)" if len(diffs) < pairs else ""
    if test is None:
        one = f"{diffs[0]:+.3f}" if diffs else "-"
        return f"| {label} | {where} | {len(diffs)}{left} | {one} | - | - | - |"
    return (f"| {label} | {where} | {test.n}{left} | {test.mean:+.3f} | {test.sd:.3f} | "
            f"[{test.lo:+.3f}, {test.hi:+.3f}] | {test.p:.2g} |")  # fmt: skip


def _plateau_of(runs: dict[int, Any]) -> tuple[int | None, int | None]:
    """(the plateau round of the runs' mean curve or None, the round the comparison uses: the
    plateau, else the last evaluated round)."""
    points = [(r, m) for r, m, _, _ in mean_curve(list(runs.values()))]
    found = plateau(points)
    return found, found if found is not None else (points[-1][0] if points else None)


def comparisons(runs: dict[str, dict[int, Any]]) -> list[str]:
    """The paired readings: FedBT minus BERT-FL at BERT-FL's plateau and at equal FLOPs, for
    each start; the MLM start minus MiniLM's; BERT-FL minus centralised."""
    lines = ["| comparison, paired by seed | arm's round(s) | n | mean difference | sd | 95% CI "
             "| paired t-test p |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    notes = []
    for prefix, label in (("", "MiniLM start"), ("mlm_", "MLM start")):
        base, arm = runs[f"{prefix}bertfl"], runs[f"{prefix}fedbt"]
        if not base:
            continue
        found, at = _plateau_of(base)
        notes.append(f"- {label}: BERT-FL's plateau is " + (f"round {found}." if found else
                     f"not reached in {at} rounds; the readings are at round {at}."))  # fmt: skip
        pairs = len(arm.keys() & base.keys())
        lines.append(_row(f"{label}: FedBT - BERT-FL, both at round {at}", *gaps(arm, base, at),
                          pairs))  # fmt: skip
        lines.append(_row(f"{label}: FedBT at equal cumulative FLOPs - BERT-FL at round {at}",
                          *gaps(arm, base, at, equal_flops=True), pairs))  # fmt: skip
        if prefix == "" and runs["central"]:
            central = runs["central"]
            lines.append(
                _row(
                    f"BERT-FL - centralised, both at round {at}",
                    *gaps(base, central, at),
                    len(base.keys() & central.keys()),
                )
            )
    for arm in ("bertfl", "fedbt"):
        new, old = runs[f"mlm_{arm}"], runs[arm]
        if new and old:
            last = max(curve(next(iter(old.values()))))
            lines.append(
                _row(
                    f"{ARMS[arm][0]}: MLM start - MiniLM start, both at round {last}",
                    *gaps(new, old, last),
                    len(new.keys() & old.keys()),
                )
            )
    return [*notes, "", *lines]


def plot(runs: dict[str, dict[int, Any]]) -> None:
    """The mean curve of each arm with a band of ± one sample sd over seeds, by round and by
    cumulative FLOPs (the mean over seeds at each evaluated round)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.0), sharey=True)
    for arm, (label, _) in ARMS.items():
        if not runs[arm]:
            continue
        points = mean_curve(list(runs[arm].values()))
        mean = [m for _, m, _, _ in points]
        lo, hi = [m - sd for _, m, sd, _ in points], [m + sd for _, m, sd, _ in points]
        tflops = [statistics.mean(cum_flops(x, r) for x in runs[arm].values()) / 1e12
                  for r, *_ in points]  # fmt: skip
        for ax, x in zip(axes, ([r for r, *_ in points], tflops), strict=True):
            (line,) = ax.plot(x, mean, marker="o", ms=3, label=f"{label} (n={len(runs[arm])})")
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("round")
    axes[1].set_xlabel("cumulative training TFLOP (all clients)")
    axes[0].set_ylabel("entity F1, global model, pooled test rows")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{TITLE}: mean ± sd over seeds", fontsize=9)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def _warmup_lines() -> list[str]:
    """The warm-up's recipe and what it reached on its held-out NERO text."""
    lines = [f"The MLM start: MiniLM-L6 warmed centrally on NERO sentences in none of the "
             f"study's subsamples (seeds {SEEDS[0]}-{SEEDS[-1]}, {EXAMPLES} examples each), "
             "one document a sentence, 5% of them held out: the MLM head alone, then the model "
             "but the word embeddings (the tied decoder). "
             "`python -m fedjax_split.pretrain` with:", ""]  # fmt: skip
    for run_name, args in (("warmup_head", WARMUP_HEAD), ("warmup", WARMUP)):
        lines.append(f"- {run_name}: `{_shell(args)}`")
        run = RUNS.load(run_name)
        if run is not None:
            s = run["summary"]
            lines[-1] += (f": {s['train_sequences']} sequences; held-out MLM loss "
                          f"{s['initial']['mlm_loss']:.3f} -> {s['final']['mlm_loss']:.3f}, "
                          f"masked-token accuracy {s['initial']['mlm_accuracy']:.3f} -> "
                          f"{s['final']['mlm_accuracy']:.3f} (the unigram level: loss "
                          f"{s['unigram']['mlm_loss']:.3f}, accuracy "
                          f"{s['unigram']['mlm_accuracy']:.3f}); {s['seconds']:.0f} s")  # fmt: skip
    return lines


def _seconds(runs: dict[int, Any]) -> float:
    return statistics.mean(r["summary"]["seconds"] for r in runs.values())


def _shell(args: Sequence[str]) -> str:
    return shlex.join(str(a).replace(str(ROOT) + "/", "") for a in args)


def section() -> list[str] | None:
    """The plateau section from the runs on this machine; None when none has finished."""
    runs = load_all()
    names = [n for n, _, _ in queue()]
    commits = RUNS.commits(names)
    if not commits:
        return None
    counts = ", ".join(f"{ARMS[a][0]} {len(runs[a])}" for a in ARMS)
    secs = ", ".join(f"{ARMS[a][0]} {_seconds(runs[a]):.0f}" for a in ARMS if runs[a])
    figure = []
    if any(runs.values()):
        plot(runs)
        figure = [f"![{TITLE}: mean and sd band over seeds, by round and by FLOPs]"
                  f"(figures/{FIGURE.name})", ""]  # fmt: skip
    return [f"## {TITLE}", "", f"Runs at commit(s) {', '.join(commits)}. Finished seeds per arm "
            f"(of {len(SEEDS)}): {counts}. Mean run seconds (2-core CPU, shared): {secs}.", "",
            "`python -m fedjax_split.train " + _shell(BASE) + "` with each arm's flags "
            "and rounds (tools/lib/fedbt_plateau.py's ARMS) and `--seed`; "
            "`python tools/fedbt_study.py --plateau` runs the queue. Each finished run's "
            f"figures are also in {LEDGER.relative_to(ROOT)} (what this page reads when a run's "
            "directory is gone).", "",
            "The figure by round, mean ± sample sd over the finished seeds:", "",
            *round_table(runs), "", *figure,
            f"BERT-FL's plateau: the first evaluated round after which its mean F1 never gains "
            f"{PLATEAU_GAIN:.2f} (one point) or more. Equal FLOPs: FedBT at its first evaluated "
            "round whose cumulative training FLOPs (run.costs, exact) reach the same seed's "
            "BERT-FL's at that round. Differences are paired by seed; the CI is the t "
            "interval.", "", *comparisons(runs), "", *_warmup_lines(), ""]  # fmt: skip
