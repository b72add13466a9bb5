"""The one run loop: resume, the run directory and its files, progress, checkpoint cadence,
Ctrl-C, summary. Fine-tuning in simulation (`run.experiment`), further pre-training
(`run.pretraining`) and the Flower server (`deploy.server`) each supply a `Run`: their round step
and their metadata, nothing of the loop.

The rules every run keeps: a fresh run never overwrites results; `--resume` needs the saved
config's trajectory settings, a readable checkpoint (or a run that finished no round) and the
same model and data as the checkpoint's; nothing is written before every check has passed; each
round's record is on disk (metrics.jsonl, flushed) before the next round starts; a checkpoint
holds the run's arrays and its metadata with the records so far, so that a resumed run continues
to exactly the result of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from fedjax_split import compilation
from fedjax_split.errors import UserError
from fedjax_split.run import outputs
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

RoundHook = Callable[[int, dict[str, Any]], None]
STOP_ENV = "FEDJAX_SPLIT_STOP_AFTER_ROUND"  # tests: act like Ctrl-C after this round's checkpoint


class Run(Protocol):
    """What a kind of run supplies to `drive`. The driver calls, in order: `arrays` and `resume`
    (only when continuing from a checkpoint), `start`, then `step` per round with `checkpointed`
    after each checkpoint, and `summary` at the end. A run whose rounds can tell their progress
    has a `watch(progress)` method too (`outputs.Progress`), called before `start`: its steps say
    when they compile and pass `progress.training()`'s hook to their rounds."""

    run_dir: Path
    rounds: int  # the round the run ends after
    metric: str | None  # the metric the progress line shows
    # Optional `writes` (default True): False for the processes of a multi-process simulation
    # other than process 0 (`sim.processes`), which run every step but write none of the
    # driver's files and show no progress.
    # Optional `publish` (default None): record -> what metrics.jsonl may publish of it (client-
    # level DP withholds the per-client figures: `run.safeguards.public_record`); the whole
    # record then goes to the server-private private/clients.jsonl (`outputs.PRIVATE_DIR`).
    # Optional `per_run` (default ()): keys of `arrays()` that never change during the run (the
    # frozen part), which checkpoints store once per run instead of in every checkpoint.

    def arrays(self) -> dict[str, Any]:
        """What a checkpoint holds as arrays (the restore target's structure too)."""

    def meta(self) -> dict[str, Any]:
        """A checkpoint's metadata: `model_config` (checked on resume) and what the run's own
        `resume` checks; the driver adds `history`."""

    def resume(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Checks a checkpoint's metadata against this run (UserError) and takes its state."""

    def start(self, start_round: int, note: Callable[[str], None]) -> None:
        """Writes the run's own files and says how the run starts (`note`: a progress line)."""

    def step(self, round_: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Round `round_`'s work; its record (metrics.jsonl's row). `history`: the records of the
        rounds before it."""

    def checkpointed(self, round_: int, kept: Sequence[int]) -> None:
        """Called after the checkpoint of `round_`; `kept`: the rounds whose checkpoints remain."""

    def summary(self, history: Sequence[dict[str, Any]], stats: Stats) -> dict[str, Any]:
        """summary.json's content, after the last round."""


@dataclasses.dataclass
class Stats:
    """What the driver measured in this process."""

    checkpoint_seconds: float = 0.0  # saving checkpoints and the run's `checkpointed` work


def check_run_dir(
    run_dir: Path,
    resume: bool,
    mismatch: Callable[[dict[str, Any]], list[str]],
    output_names: Sequence[str] = (),
) -> None:
    """The run directory's rules, before anything is built: a fresh run never overwrites results
    (the driver's files and the run's `output_names`), and `--resume` needs a readable
    config.json whose trajectory settings `mismatch` finds equal. UserError otherwise."""
    present = outputs.existing_results(run_dir) + [
        name for name in output_names if (run_dir / name).exists()
    ]
    outputs.check_run_dir(run_dir, resume, present, mismatch)


def _restore(run: Run, checkpointer: Any, resume: bool) -> tuple[int, list[dict[str, Any]]]:
    """(rounds done, their records): from the latest checkpoint with --resume, else (0, [])."""
    latest = checkpointer.latest_round() if resume else None
    if latest is None:
        ck_dir = checkpoint_dir(run.run_dir)
        if resume and (
            (ck_dir.is_dir() and any(ck_dir.iterdir()))
            or outputs.read_jsonl(run.run_dir / "metrics.jsonl")
        ):  # without a checkpoint, --resume may only restart a run that finished no round
            raise UserError(
                f"no readable checkpoint in {str(ck_dir)!r} to resume from; delete the run to "
                "start over, or use another --output-dir"
            )
        return 0, []
    arrays, meta = checkpointer.restore(run.arrays())
    if _computing(meta["model_config"]) != _computing(run.meta()["model_config"]):
        raise UserError(
            "--resume: the model's config differs from the checkpoint's; use the saved "
            "--model or another --output-dir"
        )
    run.resume(arrays, meta)
    return int(meta["round"]), list(meta["history"])


def _computing(model_config: dict[str, Any]) -> dict[str, Any]:
    """A model config without its label names: they name the head's outputs and change nothing
    the model computes, so a checkpoint whose head says LABEL_0 resumes as one that says a name."""
    return {k: v for k, v in model_config.items() if k not in ("id2label", "label2id")}


def stop_if_nothing_counted(r: int, record: dict[str, Any]) -> None:
    """A UserError when every upload of fine-tuning's round r that arrived was rejected (not
    finite, or on Flower malformed): the model did not move, so the run stops with the rounds
    before it on disk instead of going on unmoved. A round where nobody was sampled is not this
    case; pre-training's records (no `clients_sampled`) check their own (`pretraining.counted`)."""
    if "clients_sampled" not in record:
        return
    rejected = set(record.get("clients_rejected") or [])
    answered = set(record["clients_sampled"]) - set(record.get("clients_failed") or [])
    if rejected and rejected >= answered:
        raise UserError(
            f"round {r}: every upload was rejected (not finite, or malformed); the rounds "
            "before it are on disk. Clients that diverged: start again with a lower --lr (a "
            "--resume would repeat the round); nodes that sent bad uploads: fix them, then --resume"
        )


def drive(
    run: Run,
    config: dict[str, Any],
    *,
    resume: bool,
    checkpoint_every: int,
    keep_checkpoints: int = 2,
    progress: bool = True,
    on_round_end: RoundHook | None = None,
) -> dict[str, Any]:
    """Runs (or with `resume`, continues) `run` to its last round; returns its summary. `config`:
    the resolved settings, saved as config.json. `keep_checkpoints`: how many of the
    latest checkpoints stay on disk (the run's `checkpointed` hears which). `on_round_end(round,
    record)` is called after each round's record and checkpoint are on disk (a KeyboardInterrupt
    raised there stops the run as Ctrl-C does)."""
    writes = getattr(run, "writes", True)
    checkpointer = RunCheckpointer(checkpoint_dir(run.run_dir), max_to_keep=keep_checkpoints)
    stats = Stats()
    compiled = compilation.watch()
    first = compiled.mark()
    try:
        start_round, history = _restore(run, checkpointer, resume)
        # From here on we write.
        log = _RecordLog(run, writes)
        log.open(config, history, start_round)
        budget = config.get("dp_max_epsilon")  # DP's, if any: the round lines say what is left
        bar = outputs.Progress(run.rounds, start_round, enabled=progress and writes,
                               epsilon_budget=budget)  # fmt: skip
        try:
            watch = getattr(run, "watch", None)  # optional: see Run
            if watch is not None:
                watch(bar)
            run.start(start_round, bar.note)
            bar.note(cache_line())
            for r in range(start_round + 1, run.rounds + 1):
                bar.round_start(r)
                mark = compiled.mark()
                record = run.step(r, history)
                stop_if_nothing_counted(r, record)
                record.update(compile_fields(compiled.since(mark)))
                history.append(record)
                log.append(record)
                if writes and due(r, checkpoint_every, run.rounds):
                    t0 = time.perf_counter()
                    checkpointer.save(r, run.arrays(), {**run.meta(), "history": history},
                                      per_run=getattr(run, "per_run", ()))  # fmt: skip
                    run.checkpointed(r, checkpointer.all_rounds())
                    stats.checkpoint_seconds += time.perf_counter() - t0
                bar.round_done(record, run.metric)
                if on_round_end is not None:
                    on_round_end(r, record)
        finally:
            bar.close()
    finally:
        checkpointer.close()
    summary = {**run.summary(history, stats),
               "compilation": compilation.report(compiled.since(first))}  # fmt: skip
    if writes:
        outputs.write_summary(run.run_dir / "summary.json", summary)
    return summary


class _RecordLog:
    """A run's record files: metrics.jsonl (each record as the run publishes it: see Run) and,
    when the run publishes less than it records, the whole records in the owner-only private
    file. Nothing is written by a run that does not write (a process other than the first)."""

    def __init__(self, run: Run, writes: bool) -> None:
        self.run_dir, self.rounds, self.writes = run.run_dir, run.rounds, writes
        self.publish = getattr(run, "publish", None)  # optional: see Run
        private = run.run_dir / outputs.PRIVATE_DIR / outputs.PRIVATE_RECORDS
        self.private = None if self.publish is None else private

    def _public(self, record: dict[str, Any]) -> dict[str, Any]:
        return record if self.publish is None else self.publish(record)

    def open(self, config: dict[str, Any], history: list[dict[str, Any]], start_round: int
             ) -> None:  # fmt: skip
        """config.json, and the record files rewritten to the history restored (on resume: to
        the checkpoint's); a summary.json left by an earlier end goes, stale until this run
        ends."""
        if not self.writes:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        outputs.write_json(self.run_dir / "config.json", config)
        outputs.write_jsonl(self.run_dir / "metrics.jsonl", [self._public(h) for h in history])
        if self.private is not None:
            outputs.private_dir(self.run_dir)  # readable by the server's owner alone
            outputs.write_jsonl(self.private, history)
        if start_round < self.rounds:
            (self.run_dir / "summary.json").unlink(missing_ok=True)  # stale until this run ends

    def append(self, record: dict[str, Any]) -> None:
        if not self.writes:
            return
        outputs.append_jsonl(self.run_dir / "metrics.jsonl", self._public(record))
        if self.private is not None:
            outputs.append_jsonl(self.private, record)


def compile_fields(events: Sequence[compilation.Compiled]) -> dict[str, Any]:
    """A round's record of its compiling: the seconds (summary.json's `compilation` names the
    programs and what the cache served)."""
    return {"compile_seconds": compilation.report(events)["compile_seconds"]}


def cache_line() -> str:
    """Where compiled programs are kept between runs, and how much is there."""
    import jax

    where = jax.config.jax_compilation_cache_dir
    if not where:
        return ("compilation cache: off (every run compiles its programs; "
                "unset FEDJAX_SPLIT_XLA_CACHE=off to keep them)")  # fmt: skip
    size = sum(f.stat().st_size for f in Path(where).rglob("*") if f.is_file())
    return f"compilation cache: {where} ({size / 1e6:.0f} MB; a second identical run loads from it)"


def due(r: int, every: int, rounds: int) -> bool:
    """Whether round r ends with work done every `every` rounds and after the last one
    (evaluation, checkpoints); `every` 0: never."""
    return bool(every) and (r % every == 0 or r == rounds)


def stop_hook_from_env() -> RoundHook | None:
    """FEDJAX_SPLIT_STOP_AFTER_ROUND=N acts like Ctrl-C right after round N's checkpoint, so that
    tests can interrupt a command's run at a known place."""
    value = os.environ.get(STOP_ENV)
    if not value:
        return None
    stop = int(value)

    def hook(round_: int, record: dict[str, Any]) -> None:
        if round_ == stop:
            raise KeyboardInterrupt

    return hook


def interrupted(run_dir: str | Path | None) -> int:
    """Ctrl-C's one line (which checkpoint `--resume` continues from, if any); exit status 130.
    Every command prints it."""
    where = "no checkpoint yet"
    if run_dir is not None:
        try:
            latest = RunCheckpointer(checkpoint_dir(run_dir)).latest_round()
        except UserError:
            latest = None
        if latest is not None:
            where = (
                f"last checkpoint: round {latest}; continue with the same flags plus "
                f"--resume --output-dir {run_dir}"
            )
    print(f"interrupted ({where})", file=sys.stderr)
    return 130
