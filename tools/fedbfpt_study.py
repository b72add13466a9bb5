"""FedBFPT's claim on real data, offline, tested fairly: further pre-train MiniLM-L6 on PubMed
abstracts with FedBFPT and its baselines, fine-tune each result on NERO's biomedical NER as the
paper fine-tunes (centrally, to convergence) over 5 seeds, and report F1 against the further
pre-training's computation and communication (the IJCAI paper's 46.70% and 7.04%, its Figure 8;
the journal version's Table 1: 34.31% and 7.04%) in docs/fedbfpt.md with its plots.

What makes it fair (issue 29; the first study, at commit 04a79d2, had none of it):
- A real contextual masked LM to start from: MiniLM-L6 ships without an MLM head, so a fresh
  head is trained alone (`warmup_head`), then the whole model but the word embeddings (the
  decoder, tied to them) briefly (`warmup`), centrally, on movie-review snippets that no client
  holds. The report gives where every method starts on PubMed's held-out text beside the
  unigram level (what a model that ignores the context reaches at best).
- The word embeddings, which are the MLM decoder, frozen in every method, as FedBFPT freezes
  them; BERT-FL and centralised training with the decoder trained are extra rows.
- All of PubMed's abstracts, at least 100 steps per client and round (the report says how many).
- Small models of 3 and 4 layers (the journal's local-depth ablation); the deeper layers drawn
  with replacement and sorted, as the journal describes (`--layer-draw replacement`).
- NERO fine-tuned centrally for 10 epochs at 5 seeds; paired t-tests (by seed) of each method
  against BERT-FL and against no further pre-training, as the journal reports t-tests.

    nice -n 10 python tools/fedbfpt_study.py                # every missing run, then the report
    python tools/fedbfpt_study.py --report-only             # the report from the finished runs
    python tools/fedbfpt_study.py --only pretrain           # one stage: pretrain | finetune

Runs are `python -m fedjax_split.pretrain ...` and `python -m fedjax_split.train ...` into
runs/fedbfpt_study/<name> through tools/lib/study_runs.py: each log opens with the commit the run
ran at, a finished run (summary.json) is not run again and loses its checkpoints, an interrupted
one is continued with --resume, so the study can run in parts. One run at a time (2 cores).
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

from study_runs import Runs, pyplot, save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "fedbfpt_study"
DOC = ROOT / "docs" / "fedbfpt.md"
FIGURES = ROOT / "docs" / "figures"

FREEZE_DECODER = r"--freeze=embeddings\.word_embeddings"  # the MLM decoder (tied)
WARMUP_HEAD = [
    "--corpus=rotten_tomatoes", "--model=minilm-l6", "--method=centralised", "--clients=1",
    r"--freeze=embeddings\.|encoder\.", "--rounds=6", "--batch-size=16", "--lr=2e-3",
    "--max-length=128", "--seed=0",
]  # fmt: skip
WARMUP = [
    "--corpus=rotten_tomatoes", f"--model={RUNS / 'warmup_head' / 'model'}",
    "--method=centralised", "--clients=1", FREEZE_DECODER, "--rounds=3", "--batch-size=16",
    "--lr=1e-4", "--max-length=128", "--seed=0",
]  # fmt: skip
START = RUNS / "warmup" / "model"
# Further pre-training: the released setting (6 clients, 5 rounds of 1 epoch, length 128, 15%
# masking, the halving schedule) on all of the offline PubMed abstracts
PRETRAIN = [
    "--corpus=pubmed", f"--model={START}", "--clients=6", "--split=iid", "--rounds=5",
    "--local-epochs=1", "--batch-size=32", "--lr=1e-4", "--max-length=128", "--seed=0",
]  # fmt: skip
METHODS = {  # name -> (label, extra flags)
    "fedbfpt3": ("FedBFPT, 3-layer small models", ["--method=fedbfpt", "--small-layers=3"]),
    "fedbfpt4": ("FedBFPT, 4-layer small models", ["--method=fedbfpt", "--small-layers=4"]),
    "bert-fl": ("BERT-FL (FedAvg of the whole model)", ["--method=bert-fl", FREEZE_DECODER]),
    "centralised": ("BERT-C (centralised, all the text)", ["--method=centralised",
                                                           FREEZE_DECODER]),
    "truncated": ("Truncated (first 3 layers, trained whole)", ["--method=truncated",
                                                                FREEZE_DECODER]),
    "none": ("No further pre-training", ["--method=none"]),
    "bert-fl-decoder": ("BERT-FL, decoder trained too", ["--method=bert-fl"]),
    "centralised-decoder": ("BERT-C, decoder trained too", ["--method=centralised"]),
}  # fmt: skip
MIN_STEPS = 100  # per client and round
# Fine-tuning as the paper fine-tunes: centrally (one client, every example), 10 epochs
FINETUNE = [
    "--config=configs/offline_nero.py", "--critical-layer=L", "--clients=1", "--partition=iid",
    "--clients-per-round=all", "--rounds=10", "--local-epochs=1", "--batch-size=16",
    "--lr=5e-5", "--eval-every=1", "--checkpoint-every=2",
]  # fmt: skip
SEEDS = (0, 1, 2, 3, 4)


def pretrain_runs() -> list[tuple[str, list[str]]]:
    """The warm-ups, then each method's further pre-training: `python -m fedjax_split.pretrain`."""
    warmups = [("warmup_head", WARMUP_HEAD), ("warmup", WARMUP)]
    return warmups + [(f"pretrain_{m}", [*PRETRAIN, *extra]) for m, (_, extra) in METHODS.items()]


def finetune_runs() -> list[tuple[str, list[str]]]:
    """Each pre-trained model fine-tuned on NERO at each seed: `python -m fedjax_split.train`."""
    return [(f"nero_{m}_s{seed}", [*FINETUNE, f"--model={RUNS / f'pretrain_{m}' / 'model'}",
                                   f"--seed={seed}"])
            for seed in SEEDS for m in METHODS]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# report


def load(name: str) -> dict[str, Any] | None:
    """A finished run (study_runs.Runs.load), from RUNS as it is now (tests point it elsewhere)."""
    return Runs(RUNS).load(name)


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def per_round_client(run: dict[str, Any], key: str, first: int = 1) -> float:
    """Mean over rounds (from `first`) and clients of a per-client cost."""
    values = [c[key] for r in run["records"] if r["round"] >= first for c in r["clients"]]
    return sum(values) / len(values) if values else 0.0


def shell(args: Sequence[str]) -> str:
    return shlex.join(str(a).replace(str(ROOT) + "/", "") for a in args)


def pretrain_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    bert = runs.get("bert-fl")
    rows = [
        "| method | model layers | steps per client and round (fewest) | GFLOP per round and "
        "client | share of BERT-FL | CPU s per round"
        " and client | share | wall s | MB up per round and client | share | MB down, rounds 2+"
        " (client keeps a copy) | MB down (keeps nothing) | held-out MLM loss | masked-token "
        "accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, run in runs.items():
        s = run["summary"]
        label = METHODS[m][0]
        if not run["records"]:
            rows.append(
                f"| {label} | {s['layers']} | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | "
                f"{fmt(s['final']['mlm_loss'], 3)} | {fmt(s['final']['mlm_accuracy'], 3)} |"
            )
            continue
        flops = per_round_client(run, "flops") / 1e9
        cpu = per_round_client(run, "cpu_seconds")
        wall = per_round_client(run, "seconds")
        up = per_round_client(run, "bytes_up") / 1e6
        down = per_round_client(run, "bytes_down", first=2) / 1e6
        full = per_round_client(run, "bytes_down_full") / 1e6
        if bert:
            b_flops = per_round_client(bert, "flops") / 1e9
            b_cpu = per_round_client(bert, "cpu_seconds")
            b_up = per_round_client(bert, "bytes_up") / 1e6
        steps = min(c["steps"] for r in run["records"] for c in r["clients"])
        short = "" if steps >= MIN_STEPS else f" (under {MIN_STEPS})"
        rows.append(
            f"| {label} | {s['layers']} | {steps}{short} | {flops:,.0f} | "
            f"{pct(flops / b_flops) if bert else 'n/a'}"
            f" | {cpu:,.1f} | {pct(cpu / b_cpu) if bert else 'n/a'} | {wall:,.1f} | {up:,.1f} | "
            f"{pct(up / b_up) if bert and b_up else 'n/a'} | {down:,.1f} | {full:,.1f} | "
            f"{fmt(s['initial']['mlm_loss'], 3)} -> {fmt(s['final']['mlm_loss'], 3)} | "
            f"{fmt(s['initial']['mlm_accuracy'], 3)} -> {fmt(s['final']['mlm_accuracy'], 3)} |"
        )
    return rows


def finetune_scores(m: str) -> list[dict[str, Any]]:
    """Each seed's final scores: its last evaluated record, exact (summary.json's `final` is the
    same record rounded for reading; a mean over seeds is taken of the exact figures)."""
    out = []
    for seed in SEEDS:
        run = load(f"nero_{m}_s{seed}")
        if run is not None:
            evaluated = [r for r in run["records"]
                         if r.get("f1") is not None and math.isfinite(r["f1"])]  # fmt: skip
            out.append({**(evaluated[-1] if evaluated else run["summary"]["final"]), "seed": seed})
    return out


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def paired(m: str, base: str) -> str:
    """Method `m` minus `base` in F1, seed by seed: mean ± sd and a paired t-test's p."""
    a = {int(x["seed"]): x["f1"] for x in finetune_scores(m)}
    b = {int(x["seed"]): x["f1"] for x in finetune_scores(base)}
    diffs = [a[k] - b[k] for k in sorted(a.keys() & b.keys())]
    if len(diffs) < 2:
        return "n/a"
    from scipy import stats

    sd = statistics.stdev(diffs)
    p = stats.ttest_1samp(diffs, 0.0).pvalue if sd > 0 else float("nan")
    return f"{statistics.mean(diffs):+.4f} ± {sd:.4f} (n={len(diffs)}, p = {p:.2g})"


def finetune_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        "| further pre-training | NERO F1, mean ± sd | per seed | precision | recall | minus "
        "BERT-FL, paired by seed (t-test p) | minus no further pre-training (p) | pre-training "
        "TFLOP (all clients, all rounds) | pre-training MB sent (up + down) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, run in runs.items():
        scores = finetune_scores(m)
        if not scores:
            continue
        s = run["summary"]
        f1 = [x["f1"] for x in scores]
        spread = f" ± {statistics.stdev(f1):.4f}" if len(f1) > 1 else ""
        rows.append(
            f"| {METHODS[m][0]} | {fmt(mean(f1), 4)}{spread} (n={len(f1)}) | "
            f"{', '.join(fmt(x, 4) for x in f1)} | "
            f"{fmt(mean([x['precision'] for x in scores]), 4)} | "
            f"{fmt(mean([x['recall'] for x in scores]), 4)} | "
            f"{'' if m == 'bert-fl' else paired(m, 'bert-fl')} | "
            f"{'' if m == 'none' else paired(m, 'none')} | {s['cum_flops'] / 1e12:,.1f} | "
            f"{s['cum_bytes'] / 1e6:,.0f} |"
        )
    return rows


def bert_base_accounting() -> list[str]:
    """The paper's communication share, and our FLOP shares, for BERT-base (shapes only)."""
    import jax

    from fedjax_split.fed import layerwise
    from fedjax_split.fed.roles import select
    from fedjax_split.fed.wire import param_count
    from fedjax_split.models.bert import BertConfig, init_params
    from fedjax_split.models.flops import mlm_train_flops

    config = BertConfig(head="mlm")
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    total = param_count(params)
    sent = param_count(select(params, layerwise.trained_paths(params, [0]))[0])
    b, t = 1, 128
    rows = []
    for label, p in (("at the 20 predicted positions (ours)", 20), ("at all 128 positions (as "
                     "transformers' BertForMaskedLM computes them)", 128)):  # fmt: skip
        full = mlm_train_flops(config, b, t, p, layers=12, trained_layers=range(12),
                               embeddings_trained=True)  # fmt: skip
        ours = mlm_train_flops(config, b, t, p, layers=6, trained_layers=[0],
                               embeddings_trained=False)  # fmt: skip
        rows.append((label, ours / full))
    return [
        f"- Parameters: BertForMaskedLM (bert-base-uncased) holds {total:,}; a FedBFPT client "
        f"sends one layer and the head's transform and bias, {sent:,}: "
        f"**{100 * sent / total:.2f}%**, the paper's 7.04% (upload, fp32, per client and round).",
        *(
            f"- Matmul FLOPs of a FedBFPT step (6-layer small model, layer 0 and the head trained)"
            f" against a BERT-FL step (12 layers, everything trained), decoder logits {label}: "
            f"**{100 * r:.1f}%**."
            for label, r in rows
        ),
    ]


def plots(runs: dict[str, dict[str, Any]]) -> list[str]:
    """PNG figures; returns their markdown lines."""
    plt = pyplot()
    lines = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for m, run in runs.items():
        s = run["summary"]
        xs_f, xs_b, ys = [0.0], [0.0], [s["initial"]["mlm_loss"]]
        for r in run["records"]:
            if r.get("mlm_loss") is not None:
                xs_f.append(r["cum_flops"] / 1e12)
                xs_b.append(r["cum_bytes"] / 1e6)
                ys.append(r["mlm_loss"])
        label = METHODS[m][0]
        axes[0].plot(xs_f, ys, marker="o", label=label)
        axes[1].plot(xs_b, ys, marker="o", label=label)
        axes[2].plot(range(len(ys)), ys, marker="o", label=label)
    axes[0].set_xlabel("client computation, all clients so far (TFLOP of matmuls)")
    axes[1].set_xlabel("communication so far, up + down (MB)")
    axes[2].set_xlabel("round (0: the common start)")
    for ax in axes:
        ax.set_ylabel("held-out MLM loss (PubMed)")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("symlog", linthresh=10)
    axes[2].legend(fontsize=7)
    fig.suptitle("Further pre-training of MiniLM-L6 on PubMed, 6 clients, 5 rounds "
                 "(word embeddings frozen unless the label says otherwise)")
    fig.tight_layout()
    path = FIGURES / "fedbfpt_mlm.png"
    save_figure(fig, path)
    lines.append(f"![held-out MLM loss against computation and communication]({path.name})")

    points = []
    for m, run in runs.items():
        scores = finetune_scores(m)
        if scores:
            f1 = mean([x["f1"] for x in scores])
            s = run["summary"]
            points.append((METHODS[m][0], s["cum_flops"] / 1e12, s["cum_bytes"] / 1e6, f1))
    if points:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for label, flops, mb, f1 in points:
            axes[0].scatter(flops, f1, s=50, label=label)
            axes[1].scatter(mb, f1, s=50, label=label)
        axes[0].set_xlabel("further pre-training computation (TFLOP, all clients)")
        axes[1].set_xlabel("further pre-training communication (MB, up + down)")
        axes[1].set_xscale("symlog", linthresh=10)
        for ax in axes:
            ax.set_ylabel("NERO entity F1 after federated fine-tuning")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle("Downstream NER against the cost of further pre-training")
        fig.tight_layout()
        path = FIGURES / "fedbfpt_f1_cost.png"
        save_figure(fig, path)
        lines.append(f"![NERO F1 against pre-training cost]({path.name})")
    return [f"{x.replace('](', '](figures/')}" for x in lines]


def fedbfpt_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    run = runs.get("fedbfpt")
    if run is None:
        return []
    lines = ["FedBFPT's rounds (trained layer; each client's small model as global layers):", ""]
    for r in run["records"]:
        models = " ".join("(" + ",".join(map(str, c["layers"])) + ")" for c in r["clients"])
        lines.append(f"- round {r['round']}: layer {r['layer']}; clients {models}")
    return lines


def warmup_lines() -> list[str]:
    """Each warm-up stage's cost and its held-out movie-review figures, then where the methods
    start on PubMed (the 'none' run) beside PubMed's unigram level."""
    lines = []
    for name, what in (("warmup_head", "the head alone"),
                       ("warmup", "the whole model but the word embeddings")):  # fmt: skip
        run = load(name)
        if run is None:
            continue
        s = run["summary"]
        lines.append(
            f"- Warm-up of {what} (`{name}`): {sum(s['train_sequences'])} sequences, "
            f"{s['rounds']} epochs, {s['cum_flops'] / 1e12:,.1f} TFLOP, "
            f"{s['train_seconds'] / 60:.0f} min; held-out movie-review MLM loss "
            f"{fmt(s['initial']['mlm_loss'], 3)} -> {fmt(s['final']['mlm_loss'], 3)}, "
            f"masked-token accuracy {fmt(s['initial']['mlm_accuracy'], 3)} -> "
            f"{fmt(s['final']['mlm_accuracy'], 3)}."
        )
    start = load("pretrain_none")
    level = start and start["summary"].get("unigram")
    if start and level:
        s = start["summary"]
        lines.append(
            f"- Where every method starts, on PubMed's held-out abstracts: MLM loss "
            f"{fmt(s['initial']['mlm_loss'], 3)}, masked-token accuracy "
            f"{fmt(s['initial']['mlm_accuracy'], 3)}; the unigram level (always the commonest "
            f"target: accuracy {fmt(level['unigram_accuracy'], 3)}; the targets' own frequencies: "
            f"loss {fmt(level['unigram_loss'], 3)})."
        )
    return lines + (["- The warm-ups' cost is the same for every method and left out below."]
                    if lines else [])  # fmt: skip


def report() -> None:
    runs = {m: run for m in METHODS if (run := load(f"pretrain_{m}")) is not None}
    if not runs:
        print("no finished pre-training runs yet")
        return
    discussion = ROOT / "docs" / "fedbfpt_discussion.md"
    text = [
        "# FedBFPT on PubMed: further pre-training one layer at a time",
        "",
        "Generated by `python tools/fedbfpt_study.py` from the runs in `runs/fedbfpt_study/` "
        "(the numbers); the text between the tables is `docs/fedbfpt_discussion.md`.",
        "",
        "The common start: MiniLM-L6 with a fresh MLM head trained alone, then the whole model "
        "but its word embeddings (the tied decoder), on movie-review snippets no client holds:",
        "",
        f"    python -m fedjax_split.pretrain {shell(WARMUP_HEAD)}",
        f"    python -m fedjax_split.pretrain {shell(WARMUP)}",
        "",
        *warmup_lines(),
        "",
        "Pre-training command (each method adds `--method M`):",
        "",
        f"    python -m fedjax_split.pretrain {shell(PRETRAIN)}",
        "",
        "Fine-tuning command (each pre-trained model, seeds " + ", ".join(map(str, SEEDS)) + "):",
        "",
        f"    python -m fedjax_split.train {shell(FINETUNE)} --model DIR/model --seed S",
        "",
        "## Further pre-training: cost per round and client, and the held-out MLM task",
        "",
        *pretrain_table(runs),
        "",
        *fedbfpt_lines(runs),
        "",
        *plots(runs),
        "",
        "## Fine-tuned on NERO (federated NER): F1 against the pre-training's cost",
        "",
        *finetune_table(runs),
        "",
        "## The paper's accounting for BERT-base, with our counting",
        "",
        *bert_base_accounting(),
        "",
    ]
    if discussion.is_file():
        text += ["", discussion.read_text().rstrip(), ""]
    DOC.write_text("\n".join(text) + "\n")
    print(f"wrote {DOC}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report-only", action="store_true", help="only rebuild docs/fedbfpt.md")
    p.add_argument("--only", choices=("pretrain", "finetune"), help="run one stage only")
    args = p.parse_args(argv)
    if not args.report_only:
        stages = []
        if args.only in (None, "pretrain"):
            stages += [(n, a, "fedjax_split.pretrain") for n, a in pretrain_runs()]
        if args.only in (None, "finetune"):
            stages += [(n, a, "fedjax_split.train") for n, a in finetune_runs()]
        for name, run_args, module in stages:
            if name.startswith("nero_"):
                m = name.split("_")[1]
                if not (RUNS / f"pretrain_{m}" / "summary.json").is_file():
                    print(f"{name}: waiting for pretrain_{m}", flush=True)
                    continue
            print(Runs(RUNS).run(name, run_args, module), flush=True)
    report()
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    sys.exit(main())
