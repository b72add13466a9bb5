"""The runtime and outputs sections, `train`'s and `pretrain`'s: how a run uses the machine
(devices, processes, compute dtype, batch shapes, kernels) and where it writes and how often;
settings that change what a run computes by rounding at most, most of which a `--resume` may
change. Each setting's own checks stand beside it (`check`); what both commands share is written
once (`compute_dtype`, `Outputs`), each command's section saying only what differs.

The dtypes and kernels are copies of `models.bert_config`'s, kept here so that parsing the flags
imports no JAX; tests/test_config.py holds them equal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.run.settings import DEPLOYMENT, OUTPUTS, PERFORMANCE, Section
from fedjax_split.run.settings import setting as _setting
from fedjax_split.run.value_checks import at_least_one, require

DTYPES = ("float32", "bfloat16")  # model compute dtypes; parameters stay fp32
ATTENTIONS = ("xla", "cudnn")  # model.ATTENTION_IMPLEMENTATIONS


def compute_dtype() -> Any:
    """--dtype, both commands' setting."""
    return _setting(
        "float32",
        "Compute dtype of the model (parameters stay float32).",
        choices=DTYPES,
        group=PERFORMANCE,
    )


@dataclasses.dataclass(frozen=True)
class RuntimeSettings(Section):
    """How the run uses the machine: devices, processes, compute dtype, batch shapes, kernels;
    none of it changes what a run computes beyond rounding."""

    chunk_size: int | None = _setting(
        None,
        "Clients trained at once, which picks how a round runs. 1: one at a time, each with its "
        "own programs, as a Flower client trains (a CPU's default; --cpu-devices deals them "
        "over devices). N > 1: the accelerator path: the clients' steps stacked and N clients "
        "vmapped at once on one device (N at least the round's clients: all at once, an "
        "accelerator's default); memory grows with N.",
        group=PERFORMANCE,
        metavar="N",
    )
    cpu_devices: int | None = _setting(
        None,
        "CPU devices that clients trained one at a time are dealt to, each running its clients "
        "while the others run theirs (default 1): two streams of small ops keep the cores "
        "busier, but every program compiles once per device, so it pays in long runs with many "
        "clients (docs/benchmarks.md measures it). Results do not depend on it.",
        metavar="N",
        group=PERFORMANCE,
    )
    dtype: str = compute_dtype()
    packing: bool = _setting(
        True,
        "Pack each batch's examples end to end into one token stream instead of padding each to "
        "the longest: no padding is computed whatever the mix of lengths (docs/benchmarks.md). "
        "--no-packing pads each batch to its longest example.",
        group=PERFORMANCE,
    )
    bucketing: bool = _setting(
        False,
        "Sort examples by length inside windows of 200 batches before cutting batches (less "
        "padding without packing), instead of Algorithm 1's plain random mini-batches; batches "
        "then repeat their membership across epochs.",
        group=PERFORMANCE,
    )
    attention: str = _setting(
        "xla",
        "Attention kernel: xla (default, anywhere) or cudnn (jax's fused cuDNN attention; GPU "
        "with --dtype bfloat16; evaluation only, training keeps xla's).",
        choices=ATTENTIONS,
        group=PERFORMANCE,
    )
    coordinator: str | None = _setting(
        None,
        "One simulation over several processes (JAX's distributed runtime): HOST:PORT of "
        "process 0, the same for every process (unset: JAX_COORDINATOR_ADDRESS, if set). Every "
        "process needs --output-dir on a filesystem they all see (docs/scaling.md).",
        metavar="HOST:PORT",
        group=DEPLOYMENT,
    )
    num_processes: int | None = _setting(
        None,
        "Processes of a multi-process simulation (unset: 1, or what SLURM / Open MPI say when "
        "a coordinator is given); the sampled clients are dealt over every device of every "
        "process, one at a time on each, and the results equal one process's that trains them "
        "one at a time (a CPU's default) bit for bit.",
        metavar="N",
        group=DEPLOYMENT,
    )
    process_id: int | None = _setting(
        None,
        "This process's index, 0..N-1 (0 writes the run directory).",
        metavar="I",
        group=DEPLOYMENT,
    )

    def check(self, config: Any) -> None:
        """Counts of at least 1, this process's index inside their count, and one-at-a-time
        clients with several processes (`check_chunk_size`)."""
        at_least_one(config, "chunk_size", "cpu_devices", "num_processes")
        n, i = self.num_processes or 1, self.process_id
        require(config, "process_id", i is None or 0 <= i < n, f"in 0..{n - 1} (--num-processes)")
        check_chunk_size(self.chunk_size, n)


def check_chunk_size(chunk_size: int | None, processes: int) -> None:
    """Several processes deal single clients to their devices: a vmapped chunk would span
    processes. Checked from the flags, and again where JAX knows the count (SLURM may set it)."""
    if processes > 1 and chunk_size not in (None, 1):
        raise UserError(
            f"--chunk-size {chunk_size} with {processes} processes: several processes train one "
            "client at a time on each device; leave --chunk-size unset"
        )


@dataclasses.dataclass(frozen=True)
class PretrainRuntime(Section):
    """How a further pre-training run uses the machine."""

    dtype: str = compute_dtype()


def run_directory(holds: str, unset: str) -> Any:
    """--output-dir: the run's directory, which holds `holds` ("" to say nothing), and `unset`:
    the directory a run without it writes."""
    return _setting(None, f"Run directory{holds} (unset: {unset}).", metavar="DIR", group=OUTPUTS)


def evaluate_every(what: str) -> Any:
    """--eval-every: evaluate `what` every N rounds."""
    return _setting(
        1, f"Evaluate {what} every N rounds (and after the last).", group=OUTPUTS, metavar="N"
    )


@dataclasses.dataclass(frozen=True)
class Outputs(Section):
    """Where a run writes and how often: its directory, evaluations, checkpoints. Each command's
    section (`OutputSettings`, `PretrainOutputs`) names its own directory and what it evaluates,
    by redefining those two settings in place."""

    output_dir: str | None = run_directory("", "runs/<a name from the settings>")
    resume: bool = _setting(
        False, "Continue the run in --output-dir from its latest checkpoint.", group=OUTPUTS
    )
    eval_every: int = evaluate_every("the model")
    checkpoint_every: int = _setting(
        1,
        "Save a checkpoint every N rounds (and after the last); 0 = never.",
        group=OUTPUTS,
        metavar="N",
    )

    def check(self, config: Any) -> None:
        """An evaluation every N >= 1 rounds, a checkpoint every N >= 0."""
        at_least_one(config, "eval_every")
        require(config, "checkpoint_every", self.checkpoint_every >= 0, ">= 0 (0 = never)")


@dataclasses.dataclass(frozen=True)
class OutputSettings(Outputs):
    """`train`'s outputs, and how many checkpoints stay on disk."""

    output_dir: str | None = run_directory(
        " for metrics.jsonl, summary.json, config.json, partition.json and checkpoints/",
        "runs/<task>_<algorithm>_c<c>_K<K>_s<seed>",
    )
    eval_every: int = evaluate_every("the personalised models")
    keep_checkpoints: int = _setting(
        2,
        "How many of the latest checkpoints stay on disk, with the client-store versions they "
        "need (at least 1); --resume and export read the latest.",
        metavar="N",
        group=OUTPUTS,
    )

    def check(self, config: Any) -> None:
        """`Outputs.check`, and at least 1 checkpoint kept."""
        super().check(config)
        at_least_one(config, "keep_checkpoints")


@dataclasses.dataclass(frozen=True)
class PretrainOutputs(Outputs):
    """`pretrain`'s outputs."""

    output_dir: str | None = run_directory("", "runs/pretrain_<corpus>_<method>_K<K>_s<seed>")
    eval_every: int = evaluate_every("on the held-out text")
