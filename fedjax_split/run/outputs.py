"""Run outputs: atomic JSON files, the per-round metrics log, and progress (`Progress`).

Files in a run directory: `config.json` (resolved config), `partition.json`, `metrics.jsonl` (one
JSON object per round, exact), `summary.json` (at the end, rounded for reading), `checkpoints/`;
a fine-tuning run's `plot.png` (run.plots); with client-level DP, `private/` (the server's alone:
the per-client figures a DP run does not publish, docs/privacy.md). JSON files are written to a
temporary name and renamed, so a killed run never leaves half a file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from fedjax_split import atomic
from fedjax_split.errors import UserError

RESULT_FILES = ("config.json", "partition.json", "metrics.jsonl", "summary.json", "checkpoints",
                "private")
PRIVATE_DIR = "private"  # the server's own: what a DP run does not publish (docs/privacy.md)
PRIVATE_RECORDS = "clients.jsonl"  # in PRIVATE_DIR: a DP run's whole round records


def private_dir(run_dir: str | Path) -> Path:
    """The run's server-private folder, created readable by its owner alone."""
    path = Path(run_dir) / PRIVATE_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _clean(value: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON atomically (temp file + rename)."""
    return atomic.write_text(path, json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")


def _figure(value: float) -> float:
    """A float to 4 decimals (0.8347), or to 4 significant digits where that keeps more."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, max(4, 3 - math.floor(math.log10(abs(value)))))


def readable(summary: Any, key: str = "") -> Any:
    """`summary` as a person reads it: figures to 4 decimals (4 significant digits when small),
    seconds to 0.1 s, and beside every byte count (kept exact) its megabytes to 0.1 MB
    (`cum_bytes` -> `cum_mb`). Bit-exact figures are metrics.jsonl's (the last evaluated record
    is summary's `final`) and the in-process summary's; nothing reads the rounded ones back."""
    if isinstance(summary, bool) or not isinstance(summary, (float, dict, list, tuple)):
        return summary
    if isinstance(summary, float):
        return round(summary, 1) if "seconds" in key else _figure(summary)
    if isinstance(summary, (list, tuple)):
        return [readable(v, key) for v in summary]
    out: dict[str, Any] = {}
    for k, v in summary.items():
        out[k] = readable(v, str(k))
        if "bytes" in str(k) and isinstance(v, int) and not isinstance(v, bool):
            out[str(k).replace("bytes", "mb")] = round(v / 1e6, 1)
    return out


def write_summary(path: str | Path, summary: dict[str, Any]) -> Path:
    """summary.json, `readable`: the file a person opens first after a run. Figures are rounded
    there only (metrics.jsonl, the machine-readable record, stays exact), and byte counts stay
    exact beside their megabytes, so that every sum and ratio can still be recomputed."""
    return write_json(path, readable(summary))


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """Replace a JSONL file with `records` atomically (--resume truncates the log with it)."""

    def write(f: TextIO) -> None:
        for r in records:
            f.write(json.dumps(_clean(r)) + "\n")

    return atomic.atomic_write_text(path, write)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record and flush it to disk, so a crash loses at most the current round."""
    with Path(path).open("a") as f:
        f.write(json.dumps(_clean(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a process killed mid-append) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise
    return records


def existing_results(run_dir: str | Path) -> list[str]:
    """Names of result files already present in `run_dir` (what a fresh run would overwrite)."""
    run_dir = Path(run_dir)
    return [name for name in RESULT_FILES if (run_dir / name).exists()]


def check_run_dir(
    run_dir: Path,
    resume: bool,
    present: list[str],
    mismatch: Callable[[dict[str, Any]], list[str]],
) -> None:
    """The run directory's rules, shared by train and pretrain: a fresh run never overwrites
    results (`present`), and `--resume` needs a readable config.json whose trajectory settings
    `mismatch` finds equal. UserError (the CLI's one line, exit 2) otherwise."""
    if not resume and present:
        raise UserError(
            f"{str(run_dir)!r} already holds a run ({', '.join(present)}); pass --resume to "
            "continue it or choose another --output-dir"
        )
    if not resume:
        return
    saved_path = run_dir / "config.json"
    if not saved_path.is_file():
        raise UserError(f"nothing to resume in {str(run_dir)!r} (no config.json); drop --resume")
    try:
        saved = read_json(saved_path)
    except (OSError, ValueError):
        raise UserError(
            f"{str(saved_path)!r} is unreadable; restore that file to --resume this run, or start "
            "a fresh run in another --output-dir"
        ) from None
    diff = mismatch(saved)
    if diff:
        raise UserError(
            f"--resume with settings that differ from the saved run ({', '.join(diff)}); "
            "use the saved settings or another --output-dir"
        )


def format_round(record: dict[str, Any], metric: str | None,
                 epsilon_budget: float | None = None) -> str:  # fmt: skip
    """One short human line for a round's record; with client-level DP (the record has
    `epsilon`) the privacy spent so far, and what is left of `epsilon_budget` (--dp-max-epsilon)."""
    parts = [f"round {record['round']}"]
    if record.get("train_loss") is not None:
        parts.append(f"loss {record['train_loss']:.4f}")
    if metric and record.get(metric) is not None:
        parts.append(f"{metric} {record[metric]:.4f}")
    if "epsilon" in record:
        parts.append(privacy_words(record["epsilon"], epsilon_budget))
    parts.append(f"sent {record['cum_bytes'] / 1e6:.1f} MB")  # cumulative, up + down
    evaluated = record["eval_seconds"]
    took = f"{record['seconds']:.1f}s"
    parts.append(f"{took} (eval {evaluated:.1f}s)" if evaluated else took)
    return " | ".join(parts)


def privacy_words(epsilon: float | None, budget: float | None = None,
                  delta: float | None = None) -> str:  # fmt: skip
    """DP's spend as a round line and the done line say it: "epsilon 2.49 of 2.8 (0.308 left)";
    None: clipping without noise, so no guarantee."""
    if epsilon is None:
        return "no privacy guarantee (z = 0)"
    words = f"epsilon {epsilon:.3g}"
    if budget is not None:
        words += f" of {budget:g} ({max(budget - epsilon, 0.0):.3g} left)"
    return words + (f" at delta {delta:g}" if delta is not None else "")


def summary_privacy(summary: dict[str, Any]) -> str | None:
    """A DP run's spend for its done line (`privacy_words` of summary.json's `privacy`); None
    without DP."""
    privacy = summary.get("privacy")
    if not privacy:
        return None
    return privacy_words(privacy.get("epsilon"), privacy.get("max_epsilon"), privacy.get("delta"))


def spread_words(final: dict[str, Any], metric: str) -> str:
    """What the final evaluation says beyond the mean over clients, as the done line says it:
    "worst client 0.6000, 10th percentile 0.6400, personalisation gain +0.2500" (the figures the
    final record has: under DP without --dp-publish-clients the per-client ones are private;
    the gain only where a split leaves a personal part); "" without any."""
    parts = []
    for key, words, form in (("worst_client", "worst client", ".4f"),
                             ("p10_client", "10th percentile", ".4f"),
                             ("personalization_gain", "personalisation gain", "+.4f")):  # fmt: skip
        value = (final.get(key) or {}).get(metric)
        if value is not None and math.isfinite(value):
            parts.append(f"{words} {value:{form}}")
    return ", ".join(parts)


def below_majority(summary: dict[str, Any]) -> str | None:
    """The warning line for a run whose final primary metric is at or below what each client's
    majority label alone scores (compared as the done line shows them, to 4 decimals): such a
    run learned nothing the label priors do not give. None otherwise, or without the figures."""
    metric, majority = summary.get("primary_metric"), summary.get("majority_label")
    value = summary.get("final", {}).get(metric) if metric else None
    if value is None or majority is None or round(value, 4) > round(majority, 4):
        return None
    return (f"warning: the final {metric} {value:.4f} is at or below the majority label's "
            f"{majority:.4f}: the model does no better than each client always predicting its "
            "most common training label")  # fmt: skip


LINE_SECONDS = 10.0  # not a terminal: at most one line inside a round this often
BAR_SECONDS = 0.5  # a terminal: the bar's text inside a round changes at most this often


class Progress:
    """What a run says while it runs, on `stream` (stderr): a tqdm bar over rounds on a terminal,
    plain lines otherwise (a log, a pipe, a notebook), so that a log stays short.

    - `note`: a line (the run's set-up, the compile line of `compiling`);
    - inside a round (`round_hook`, fed by `sim.rounds.run_round`'s progress): clients done,
      local steps done of the round's, examples per second since the first program finished (so
      that compiling does not count); on a terminal in the bar's text, else a line at most every
      LINE_SECONDS;
    - after each round (`round_done`): its line (on a terminal written above the bar, so that
      every round's line stays on screen), with DP's epsilon and what is left of
      `epsilon_budget`, and the time left from the first round on: rounds left times a round's
      seconds less the seconds XLA spent compiling in it (the record's `compile_seconds`), the
      first round's until a later one is measured, then the later rounds' mean (the first also
      traces and loads what later rounds reuse).
    `clock`: the time source (tests pass a fake one).
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        epsilon_budget: float | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.total, self.done = total, initial
        self.clock = clock
        self.epsilon_budget = epsilon_budget
        self._bar = None
        self._round: int | None = None
        self._started = 0.0  # the round's start
        self._first: tuple[float, int] | None = None  # its first report: time, examples
        self._rounds_here = 0  # rounds done in this process
        self._last_line = -math.inf  # when the last line (or bar text) was written
        self._first_round: float | None = None  # the first round's seconds less compiling
        self._later: list[float] = []  # the same of the later rounds in this process
        if enabled and hasattr(self.stream, "isatty") and self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="round", file=self.stream,
                # tqdm's own time left would count the first round's compiling: ours is shown
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )  # fmt: skip

    def note(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)  # above the bar, kept on screen
        else:
            print(message, file=self.stream, flush=True)
        self._last_line = self.clock()

    def compiling(self, round_: int, what: str = "the client program (the first round only)"
                  ) -> None:  # fmt: skip
        """Says that the round about to run compiles first (a silent wait otherwise)."""
        self.note(f"round {round_}: compiling {what} ...")

    def round_start(self, round_: int) -> None:
        self._round, self._started, self._first = round_, self.clock(), None

    def training(self, what: str = "the client program (the first round only)"
                 ) -> Callable[[Any], None] | None:  # fmt: skip
        """For the round `round_start` began, about to train: the first round of this progress
        says that it compiles `what` first; the round's `round_hook`."""
        if self._rounds_here == 0 and self._round is not None:
            self.compiling(self._round, what)
        return self.round_hook()

    def round_hook(self) -> Callable[[Any], None] | None:
        """The callback for a round's progress (`sim.round_progress.RoundProgress`); None when
        disabled, so that the round waits for nothing."""
        return self.inside if self.enabled else None

    def inside(self, progress: Any) -> None:
        """A round's progress: clients_done, clients, steps_done, steps, examples_done."""
        now = self.clock()
        if self._first is None:
            self._first = (now, progress.examples_done)
        elif now - self._last_line < (LINE_SECONDS if self._bar is None else BAR_SECONDS):
            return
        text = (
            f"round {self._round}: {progress.clients_done}/{progress.clients} clients done, "
            f"{progress.steps_done}/{progress.steps} steps"
        )
        t_first, examples_first = self._first
        if now > t_first and progress.examples_done > examples_first:
            rate = (progress.examples_done - examples_first) / (now - t_first)
            text += f", {rate:,.0f} examples/s"
        if self._bar is not None:
            self._bar.set_postfix_str(text)
            self._last_line = now
        elif now - self._last_line >= LINE_SECONDS:
            self.note(text)

    def _time_left(self, record: dict[str, Any]) -> str | None:
        """Records this round's seconds less its compiling; the time left, when rounds are."""
        seconds = record.get("seconds") if self._round is None else self.clock() - self._started
        self._rounds_here += 1
        if seconds is not None:
            steady = max(0.0, seconds - (record.get("compile_seconds") or 0.0))
            if self._rounds_here == 1:
                self._first_round = steady
            else:
                self._later.append(steady)
        per_round = sum(self._later) / len(self._later) if self._later else self._first_round
        left = self.total - self.done
        if per_round is None or left <= 0:
            return None
        return time_left(per_round * left)

    def round_done(self, record: dict[str, Any], metric: str | None) -> None:
        if not self.enabled:
            return
        self.done += 1
        left = self._time_left(record)
        line = format_round(record, metric, self.epsilon_budget) + (f" | {left}" if left else "")
        if self._bar is not None:
            self._bar.write(line, file=self.stream)  # above the bar: every round's line stays
            self._bar.set_postfix_str(left or "")
            self._bar.update(1)
        else:
            print(line, file=self.stream, flush=True)
        self._last_line = self.clock()
        self._round = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def time_left(seconds: float) -> str:
    """A person's reading of a time left: "about 12 min left"."""
    if seconds < 60:
        return "under a minute left"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60)} min left"
    return f"about {seconds / 3600:.1f} h left"
