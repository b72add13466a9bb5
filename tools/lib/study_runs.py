"""What a study under tools/ does with its runs: start one (resumable, its commit logged), load a
finished one, and put numbers in tables (mean ± sd over seeds).

Runs are `python -m fedjax_split.train ARGS --output-dir=DIR/<name>`, their output in
DIR/<name>.log after a line "commit <hash>": a finished run (summary.json) is not run again (its
checkpoints are deleted once it finishes: the reports read its figures), an interrupted one
continues with --resume.

A study that runs for days keeps a ledger in git (`Runs(..., ledger=docs/data/<study>.jsonl)`):
each finished run's figures (summary, commits, and per round its costs and its pooled scores,
without the per-client lists), one line a run. A report reads the ledger for a run whose
directory is gone: runs/ is never committed, and a new machine had lost ten finished runs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedjax_split.run.outputs import read_json, read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


# what a ledger keeps of each round's record: its costs and the global model's pooled scores
LEDGER_KEYS = ("round", "flops", "cum_flops", "cum_bytes", "pooled")


class Runs:
    """The runs of one study, in `directory`; with `ledger`, each finished run's figures also
    there (a JSONL file in git), read back when its directory is gone."""

    def __init__(self, directory: Path, ledger: Path | None = None) -> None:
        self.directory = Path(directory)
        self.ledger = None if ledger is None else Path(ledger)

    def run(self, name: str, args: Sequence[str], module: str = "fedjax_split.train") -> str:
        """`python -m module ARGS` into DIR/<name> (fedjax_split.pretrain writes the same files)."""
        out = self.directory / name
        if (out / "summary.json").is_file():
            self.record(name)  # a run finished before the study kept a ledger
            return f"{name}: done before"
        if not out.exists() and self._entry(name) is not None:
            return f"{name}: in the ledger, done before"
        cmd = [sys.executable, "-m", module, *args, f"--output-dir={out}"]
        if out.exists():
            cmd.append("--resume")
        self.directory.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        log = self.directory / f"{name}.log"
        with open(log, "a") as f:
            f.write(f"commit {commit()}\n{shlex.join(cmd)}\n")
            f.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc == 0 and (out / "summary.json").is_file():
            drop_checkpoints(out)
            self.record(name)
        status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {log})"
        return f"{name}: {status} in {time.time() - t0:.0f}s"

    def load(self, name: str) -> dict[str, Any] | None:
        """A finished run's summary, records, config and commits (from the ledger, records slim
        and config empty, when its directory is gone); None if it has not finished."""
        d = self.directory / name
        if not (d / "summary.json").is_file():
            return None if d.exists() else self._entry(name)
        log = self.directory / f"{name}.log"
        lines = log.read_text().splitlines() if log.is_file() else []
        return {
            "summary": read_json(d / "summary.json"),
            "records": read_jsonl(d / "metrics.jsonl"),
            "config": read_json(d / "config.json"),
            "commits": [x.split()[1] for x in lines if x.startswith("commit ")],
        }

    def record(self, name: str) -> None:
        """The finished run `name`'s line in the ledger (replacing an older line of that name)."""
        run = self.load(name) if self.ledger is not None else None
        if run is None:
            return
        entry = {"name": name, "commits": run["commits"], "summary": run["summary"],
                 "records": [{k: r[k] for k in LEDGER_KEYS if k in r} for r in run["records"]]}
        lines = [x for x in self._lines() if x["name"] != name]
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(x, sort_keys=True) + "\n" for x in [*lines, entry])
        self.ledger.write_text(text)

    def _lines(self) -> list[dict[str, Any]]:
        if self.ledger is None or not self.ledger.is_file():
            return []
        return [json.loads(x) for x in self.ledger.read_text().splitlines() if x.strip()]

    def _entry(self, name: str) -> dict[str, Any] | None:
        entry = next((x for x in self._lines() if x["name"] == name), None)
        return None if entry is None else {**entry, "config": {}}

    def commits(self, names: Sequence[str]) -> list[str]:
        """The commits the finished runs among `names` ran at (a resumed run lists each)."""
        found: list[str] = []
        for name in names:
            run = self.load(name)
            for c in [] if run is None else run["commits"]:
                if c not in found:
                    found.append(c)
        return found


def chosen(text: str, known: Sequence[str], what: str) -> list[str] | None:
    """The comma-separated names of a tool's flag, each one of `known`; None (after a one-line
    error naming `what` and the choices) if one is not."""
    names = [x.strip() for x in text.split(",")]
    if unknown := [x for x in names if x not in known]:
        print(f"error: unknown {what} {unknown[0]!r}; use {', '.join(known)}", file=sys.stderr)
        return None
    return names


def drop_checkpoints(run_dir: Path) -> None:
    """A finished study run's checkpoints and personal parts, which no report reads (a few
    hundred MB a run: a study's dozens of runs would fill a disk); its figures stay."""
    for part in ("checkpoints", "clients"):
        shutil.rmtree(run_dir / part, ignore_errors=True)


def final(run: dict[str, Any], key: str = "accuracy") -> float | None:
    """The last evaluated value of `key` in a run's records."""
    scored = [r for r in run["records"] if r.get(key) is not None]
    return scored[-1][key] if scored else None


def evaluated(run: dict[str, Any], metric: str = "accuracy") -> list[dict[str, Any]]:
    """A run's records that scored the one global model on `metric`: `pooled` (every client's
    test split together; a centralised run's one client is its whole test split)."""
    return [r for r in run["records"] if (r.get("pooled") or {}).get(metric) is not None]


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def mean_sd(values: Sequence[float]) -> str:
    """'mean ± sd (n)' over seeds; one value as it is."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f} (n=1)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} (n={len(values)})"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: a study writes figure files and opens no window
    (and imports matplotlib only when it plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Writes a study's figure at the studies' one resolution (its folder made) and frees it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def write_report(doc: Path, lines: list[str], discussion: Path) -> None:
    """Writes a study's generated report with its hand-written discussion (if any) appended."""
    if discussion.is_file():  # written by hand from the tables the study generated
        lines = [*lines, discussion.read_text().rstrip(), ""]
    doc.write_text("\n".join(lines))
    print(f"wrote {doc}")
