"""A run compiles its client program and its evaluation program once each, whatever its clients'
sizes and rounds, in both execution paths; a second identical run loads them from the persistent
cache and compiles none (counted with JAX's own compile events, `fedjax_split.compilation`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_fixtures import ROOT, cli_env, tiny_args, tiny_sst2_files

from fedjax_split import compilation

# A child runs the command in-process with the compile log on, and prints, per program, how many
# times it was compiled and how many times the cache served it.
_CHILD = """
import json, sys
from fedjax_split import compilation, train
log = compilation.watch()
assert train.main(sys.argv[1:]) == 0
events = log.since(0)
print(json.dumps({"built": compilation.counts(events),
                  "cached": compilation.counts(events, cached=True)}))
"""

TRAINING = {"one at a time": "jit(segment_one)", "stacked": "jit(segment)"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_sst2_files(tmp_path_factory.mktemp("compilation"))


def _run(files: dict[str, Path], out: Path, cache: Path | None, **extra: object) -> dict:
    """The tiny run in a child process; `cache`: the asset cache whose xla/ the run keeps its
    programs in, as a user's run does (None: no persistent cache)."""
    # uneven clients: Dirichlet quantity skew gives each client its own number of examples
    args = tiny_args(files["model"], files["data"], out, rounds=3, partition="quantity",
                     beta=1.0, **extra)  # fmt: skip
    env = cli_env()
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)  # the test session's cache settings: a user has neither
    if cache is None:
        env["FEDJAX_SPLIT_XLA_CACHE"] = "off"
    else:
        env["FEDJAX_SPLIT_CACHE"] = str(cache)
    res = subprocess.run([sys.executable, "-c", _CHILD, *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _client_sizes(out: Path) -> list[int]:
    return [len(c["train"]) for c in json.loads((out / "partition.json").read_text())["clients"]]


@pytest.mark.parametrize(("path", "packing"),
                         [("one at a time", True), ("stacked", True), ("one at a time", False)])
def test_a_run_compiles_its_training_and_evaluation_programs_once(
    files: dict[str, Path], tmp_path: Path, path: str, packing: bool
) -> None:
    chunk = 1 if path == "one at a time" else 3  # --chunk-size 3 forces the vmapped round
    # padded batches of 8 short sentences: their longest example varies from 8 to 16 tokens,
    # which gave two shapes before one shape per run
    got = _run(files, tmp_path / "run", None, chunk_size=chunk,
               no_packing=None if packing else True)  # fmt: skip
    sizes = _client_sizes(tmp_path / "run")
    assert max(sizes) >= 2 * min(sizes), sizes  # the clients' data really are uneven
    built = got["built"]
    assert built.get(TRAINING[path]) == 1, built
    assert built.get("jit(predict)") == 1, built
    other = TRAINING["stacked" if path == "one at a time" else "one at a time"]
    assert other not in built  # the other path's program never ran
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["compilation"]["programs_compiled"] >= 2
    assert 0 < summary["fill"] <= 1


def test_a_second_identical_run_compiles_none_of_them(
    files: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = _run(files, tmp_path / "a", cache)
    assert any((cache / "xla").iterdir())  # the default place, beside the assets
    assert first["built"].get("jit(segment_one)") == 1
    second = _run(files, tmp_path / "b", cache)
    # the client program, evaluation, the server step
    for name in ("jit(segment_one)", "jit(predict)", "jit(start_one)", "jit(finish_one)",
                 "jit(add_upload)", "jit(finish)"):  # fmt: skip
        assert name not in second["built"], second
        assert second["cached"].get(name, 0) >= 1, second
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())["compilation"]
    assert summary["programs_from_cache"] >= 6
    names = {p["program"] for p in summary["slowest_programs"]}
    assert not names & {"jit(segment_one)", "jit(predict)"}, summary


def test_the_report_counts_what_it_was_given() -> None:
    c = compilation.Compiled
    events = [c("jit(a)", 2.0, False), c("jit(a)", 0.5, False), c("jit(b)", 0.1, True),
              c("jit(c)", 1.5, False)]
    rep = compilation.report(events, top=2)
    assert rep["programs_compiled"] == 3 and rep["programs_from_cache"] == 1
    assert rep["compile_seconds"] == 4.0 and rep["slow_compiles"] == 2
    assert rep["slowest_programs"] == [{"program": "jit(a)", "times": 2, "seconds": 2.5},
                                       {"program": "jit(c)", "times": 1, "seconds": 1.5}]
    assert compilation.counts(events) == {"jit(a)": 2, "jit(c)": 1}
    assert compilation.counts(events, cached=True) == {"jit(b)": 1}
