"""tools/scale.py end to end on a tiny model: one process per K, figures read back from each run,
and the checkpoint holding the server state only, whatever K."""

import importlib.util
import json
from pathlib import Path

from run_fixtures import private_cache, write_tiny_model, write_tiny_sst2  # noqa: F401

_SPEC = importlib.util.spec_from_file_location(
    "scale", Path(__file__).resolve().parents[1] / "tools" / "scale.py"
)
scale = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scale)


def test_tiny_scale(tmp_path, monkeypatch):
    for name in ("FEDJAX_SPLIT_STOP_AFTER_ROUND", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    model = write_tiny_model(tmp_path / "model")
    data = write_tiny_sst2(tmp_path / "data", n_train=400, n_dev=80)
    out = tmp_path / "scale.json"
    flags = ["--task=sst2", f"--model={model}", f"--data-dir={data}", "--max-length=16",
             "--batch-size=8", "--critical-layer=1", "--lr=1e-3"]  # fmt: skip
    rows = scale.main(["--clients", "10", "20", "--rounds", "3", "--out", str(out), "--", *flags])
    assert json.loads(out.read_text()) == rows
    assert [r["clients"] for r in rows] == [10, 20]
    for r, k in zip(rows, (10, 20), strict=True):
        assert f"--clients {k} --clients-per-round 10" in r["command"]
        assert 0.0 <= r["final_accuracy"] <= 1.0
        assert 0.05 < r["peak_rss_gb"] < 24  # the child's own peak, from the kernel
        assert r["checkpoint_mb"] > 0 and r["client_store_mb"] > 0
        assert r["steady_round_s"] > 0 and r["final_eval_s"] > 0
    # a checkpoint is the server state only: 10 more clients' local parts (layer 1, pooler and
    # head: about 9.7k parameters, 39 KB each) would add 0.39 MB; it grows by a few KB at most
    assert abs(rows[1]["checkpoint_mb"] - rows[0]["checkpoint_mb"]) < 0.1
