"""fedjax_split.sim.processes: one simulation over several JAX processes equals one process.

Two processes on 127.0.0.1 with one CPU device each (JAX's distributed runtime, gloo collectives)
against this process with two CPU devices (tests/conftest.py gives it two): the same metrics, the
same client store bit for bit, the same checkpoints; resumed after an interruption; with a
process that trains no client in a round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from run_fixtures import cli_env, private_cache, tiny_sst2_files  # noqa: F401

from fedjax_split.deploy.launch import free_port
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir
from fedjax_split.run.experiment import run_experiment
from fedjax_split.sim import processes

pytestmark = pytest.mark.xdist_group("federation")  # one at a time: see pyproject.toml

TIMES = ("seconds", "train_seconds", "eval_seconds", "compile_seconds")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("processes")
    return {**tiny_sst2_files(base), "xla": base / "xla"}


def _settings(files: dict[str, Path], **kw: object) -> dict[str, object]:
    return {"task": "sst2", "model": str(files["model"]), "data_dir": str(files["data"]),
            "clients": 3, "rounds": 2, "local_epochs": 1, "batch_size": 32, "lr": 1e-3,
            "max_length": 16, **kw}  # fmt: skip


def _flags(settings: dict[str, object]) -> list[str]:
    """The settings as flags; True: a switch given alone."""
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
            for k, v in settings.items()]  # fmt: skip


def _two_processes(
    files: dict[str, Path], out: Path, *extra: str, env: dict | None = None,
    coordinator_env: bool = False,
) -> list[tuple[int, str]]:
    """Both processes of a 2-process run of the CLI; their (exit status, stdout + stderr).
    `coordinator_env`: the coordinator in JAX_COORDINATOR_ADDRESS instead of --coordinator."""
    address = f"127.0.0.1:{free_port()}"
    env = {**cli_env(files["xla"]), **(env or {})}
    if coordinator_env:
        env["JAX_COORDINATOR_ADDRESS"] = address
    where = [] if coordinator_env else [f"--coordinator={address}"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fedjax_split.train", *extra, f"--output-dir={out}", *where,
             "--num-processes=2", f"--process-id={i}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for i in (1, 0)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            results.append((p.returncode, out + err))
    finally:  # a process waiting in an exchange for one that failed is not left running
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results[::-1]  # process 0's first


def _records(run: Path, private: bool = False) -> list[dict]:
    """metrics.jsonl's rows, or with `private` a DP run's server-private ones, without times."""
    path = run / "private" / "clients.jsonl" if private else run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMES} for r in rows]


def _assert_same_run(one: Path, two: Path) -> None:
    assert _records(one) == _records(two)
    if (one / "private").is_dir():
        assert _records(one, private=True) == _records(two, private=True)
    stores = [sorted((run / "clients").rglob("*.npz")) for run in (one, two)]
    assert [p.relative_to(one) for p in stores[0]] == [p.relative_to(two) for p in stores[1]]
    for a, b in zip(*stores, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name
    kept = [RunCheckpointer(checkpoint_dir(run)).all_rounds() for run in (one, two)]
    assert kept[0] == kept[1] and kept[0]
    (a, _), (b, _) = (RunCheckpointer(checkpoint_dir(run)).restore_untyped() for run in (one, two))
    chex.assert_trees_all_equal(a, b, strict=True)  # the same run: dtypes too


def test_two_processes_of_two_devices_equal_one_process_with_two(files: dict[str, Path]) -> None:
    # FedAvg (nothing local), so that the pooled evaluation gathers every process's predictions
    settings = _settings(files, critical_layer="L")
    one = files["base"] / "one"
    run_experiment({**settings, "cpu_devices": 2, "output_dir": str(one)}, progress=False)
    two = files["base"] / "two"
    # two CPU devices in each process: the count must reach the devices JAX's runtime makes
    (code0, err0), (code1, err1) = _two_processes(files, two, *_flags(settings),
                                                  "--cpu-devices=2")  # fmt: skip
    assert code0 == 0 and code1 == 0, err0[-2000:] + err1[-2000:]
    _assert_same_run(one, two)
    # process 0 wrote the run's files, the round's devices are both processes' (the dealing
    # itself: test_clients_are_dealt_round_robin_...), and both report the same result
    assert json.loads((two / "summary.json").read_text())["round_devices"] == 4
    assert "done: 2 rounds" in err0 and "done: 2 rounds" in err1


def test_a_resumed_two_process_dp_run_with_an_idle_process_equals_one_process(
    files: dict[str, Path],
) -> None:
    # FedSplitBERT (a local part) with client-level DP, whose Poisson sampling (2 of 3) draws
    # clients [0, 1], [1, 2], [2], [0, 2] under the opt-out at seed 0 (two separate runs draw
    # one noise and sample only so): in round 3 process 1 trains nobody, yet joins every
    # exchange; every client clips its own update where it trains
    settings = _settings(files, clients_per_round=2, rounds=4, dp_noise_multiplier=0.5,
                         dp_clip=1.0, dp_insecure_reproducible_noise=True)  # fmt: skip
    one = files["base"] / "one_dp"
    run_experiment({**settings, "cpu_devices": 2, "output_dir": str(one)}, progress=False)
    assert [r["clients_sampled"] for r in _records(one, private=True)] == [[0, 1], [1, 2], [2],
                                                                           [0, 2]]  # fmt: skip
    two = files["base"] / "two_dp"
    stopped = _two_processes(files, two, *_flags(settings),
                             env={"FEDJAX_SPLIT_STOP_AFTER_ROUND": "2"})  # fmt: skip
    assert [code for code, _ in stopped] == [130, 130], stopped[0][1][-2000:]
    assert len(_records(two)) == 2
    # resumed with JAX's own variable for the coordinator instead of --coordinator
    resumed = _two_processes(files, two, *_flags(settings), "--resume", coordinator_env=True)
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-2000:] + resumed[1][1][-2000:]
    _assert_same_run(one, two)


def test_processes_without_a_coordinator_stop_with_one_line(files: dict[str, Path]) -> None:
    out = files["base"] / "nowhere"
    res = subprocess.run(
        [sys.executable, "-m", "fedjax_split.train", *_flags(_settings(files)),
         f"--output-dir={out}", "--num-processes=2", "--process-id=0"],
        env=cli_env(files["xla"]), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "no --coordinator given" in lines[0] and not out.exists()


def test_one_process_gathers_nothing() -> None:
    assert processes.count() == 1 and processes.index() == 0 and processes.writes()
    own = {0: {"a": np.ones(2)}, 1: {"a": np.zeros(2)}}
    assert processes.gather_clients(own, [0, 0]) == [own[0], own[1]]
    assert processes.gather_json({"x": 0.1}) == [{"x": 0.1}]
    got = processes.gather_arrays({"p": np.arange(3)})
    np.testing.assert_array_equal(got[0]["p"], np.arange(3))
    devices = jax.local_devices()[:2]
    assert processes.owners(devices, 3) == [0, 0, 0]


class _Device:
    def __init__(self, process_index: int) -> None:
        self.process_index = process_index


def test_clients_are_dealt_round_robin_over_every_processs_devices() -> None:
    # process 0 with two devices, process 1 with one: client i goes to device i % 3
    devices = [_Device(0), _Device(0), _Device(1)]
    assert processes.owners(devices, 7) == [0, 0, 1, 0, 0, 1, 0]
    processes.barrier("nothing to wait for")
