"""fedjax_split.pretrain, the command line, end to end on a tiny random BERT and local text:
what a run writes, a kill -9 then --resume equal to the straight run, one-line exit-2 errors that
write nothing (a corrupt checkpoint, an existing run without --resume, bad flags).

Runs go through real subprocesses sharing the session's persistent JAX compilation cache
(tests/conftest.py), so only the first run pays for compilation. What a run computes, sends and
exports (run.pretraining.run_pretraining) is tests/test_pretraining.py's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    cli_env,
    private_cache,
    write_tiny_model,
    write_tiny_text,
)

from fedjax_split import pretrain


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("pretrain")
    model = write_tiny_model(base / "model", num_layers=4)
    proc_env = cli_env()  # the session's XLA cache
    return {"base": base, "model": model, "text": write_tiny_text(base / "text"), "env": proc_env}


def _args(env: dict, out: Path, **extra: object) -> list[str]:
    flags = {
        "corpus": "local", "data-dir": env["text"], "model": env["model"], "method": "fedbfpt",
        "clients": 2, "split": "source", "rounds": 3, "small-layers": 2, "batch-size": 8,
        "max-length": 24, "lr": 1e-3, "heldout-fraction": 0.1, "output-dir": out,
    }  # fmt: skip
    flags.update({k.replace("_", "-"): v for k, v in extra.items()})
    return [f"--{k}={v}" for k, v in flags.items()]


def _cli(env: dict, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedjax_split.pretrain", *args], env=env["env"],
        capture_output=True, text=True, timeout=300, cwd=env["base"],
    )  # fmt: skip


def _metrics(run: Path, timeless: bool = True) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    if not timeless:
        return rows
    drop = ("seconds", "cpu_seconds", "client_seconds", "client_cpu_seconds")

    def clean(d: dict) -> dict:
        return {
            k: [clean(c) for c in v] if k == "clients" else v
            for k, v in d.items()
            if not k.endswith(drop)
        }

    return [clean(r) for r in rows]


def _digest(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def straight(env: dict) -> Path:
    out = env["base"] / "straight"
    res = _cli(env, _args(env, out))
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if not line.startswith("warning:")]
    # the tiny model has no MLM head: the one pre-training adds is said plainly, not as a warning
    assert said[0] == "a new masked-LM head, initialised from seed 0"
    assert said[1] == (  # then the method, as a person says it
        "FedBFPT: each client trains a 2-layer model, one encoder layer of 4 + the MLM head a "
        "round (deeper layers drawn with replacement); the server averages what was trained"
    )
    assert "done: fedbfpt, 3 rounds" in res.stdout
    return out


def test_the_command_writes_a_run_directory(straight: Path) -> None:
    """The flags reached the run; its accounting is test_pretraining's."""
    for name in ("config.json", "split.json", "metrics.jsonl", "summary.json"):
        assert (straight / name).is_file(), name
    assert [r["round"] for r in _metrics(straight)] == [1, 2, 3]
    config = json.loads((straight / "config.json").read_text())
    assert config["method"] == "fedbfpt" and config["small_layers"] == 2
    assert json.loads((straight / "split.json").read_text())["scheme"] == "source"
    assert (straight / "model" / "model.safetensors").is_file()


def test_sigkilled_run_resumes_to_the_same_result(env: dict, straight: Path) -> None:
    out = env["base"] / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedjax_split.pretrain", *_args(env, out)], env=env["env"],
        cwd=env["base"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 240
    while not (out / "checkpoints" / "2").is_dir() and proc.poll() is None:
        assert time.time() < deadline, "run did not reach round 2"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "model").exists()
    res = _cli(env, [*_args(env, out), "--resume"])
    assert res.returncode == 0, res.stderr
    assert _metrics(out) == _metrics(straight)
    a, b = (json.loads((r / "summary.json").read_text()) for r in (out, straight))
    assert a["final"] == b["final"] and a["cum_flops"] == b["cum_flops"]
    # the exported models are the same bytes
    assert _digest(out / "model") == _digest(straight / "model")


BAD = [
    ({"corpus": "wiki"}, "unknown corpus"),
    ({"method": "fedprox"}, "unknown method"),
    ({"small_layers": 1}, "--small-layers 2 or more"),
    ({"small_layers": 9}, "outside 1..4"),
    ({"data_dir": "/nonexistent/text"}, "data dir"),
    ({"schedule_period": 0}, "--schedule-period must be at least 1"),
    ({"text_mode": "paragraph"}, "unknown text_mode"),
]


@pytest.mark.parametrize(("change", "needle"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    env: dict, straight: Path, change: dict, needle: str, capsys: pytest.CaptureFixture
) -> None:
    fresh = env["base"] / "never"
    before = _digest(straight)
    for out, resume in ((fresh, []), (straight, ["--resume"])):  # a new run, or an existing one
        code = pretrain.main([*_args(env, out, **change), *resume])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert needle in err, err
    assert not fresh.exists() and _digest(straight) == before


def test_corrupt_checkpoint_and_existing_run(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    assert pretrain.main(_args(env, straight)) == 2  # an existing run needs --resume
    assert "--resume" in capsys.readouterr().err
    broken = env["base"] / "broken"
    shutil.copytree(straight, broken)
    for f in (broken / "checkpoints").rglob("*"):
        if f.is_file() and f.stat().st_size > 100 and "meta" not in str(f):
            f.write_bytes(b"\0" * f.stat().st_size)
    before = _digest(broken)
    assert pretrain.main([*_args(env, broken), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "checkpoint" in err and len(err.strip().splitlines()) == 1
    assert _digest(broken) == before
