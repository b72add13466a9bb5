"""tools/yardstick.py end to end on a tiny model: both loops run their rounds, and the derived
figures (speed-up, MFU, FLOPs trained and evaluated) follow from what it measured."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from run_fixtures import private_cache, write_tiny_model, write_tiny_sst2  # noqa: F401

_SPEC = importlib.util.spec_from_file_location(
    "yardstick", Path(__file__).resolve().parents[1] / "tools" / "yardstick.py"
)
yardstick = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(yardstick)


def test_tiny_yardstick(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_SPLIT_XLA_CACHE", "off")  # the user's cache stays untouched
    model = write_tiny_model(tmp_path / "model")
    data = write_tiny_sst2(tmp_path / "data")
    config = tmp_path / "tiny.py"
    config.write_text(
        "def get_config():\n"
        f"    return dict(task='sst2', model={str(model)!r}, data_dir={str(data)!r},\n"
        "                max_length=16, lr=1e-3, partition='iid')\n"
    )
    out = tmp_path / "y.json"
    r = yardstick.run(["--config", str(config), "--clients", "2", "--critical-layer", "1",
                       "--max-examples", "120", "--batch-size", "8", "--rounds", "2",
                       "--torch-rounds", "2", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    ours, torch = r["ours"], r["torch"]
    assert len(ours["rounds_s"]) == 2 and len(torch["rounds_s"]) == 2
    assert ours["steady_round_s"] == ours["rounds_s"][1]  # the first round is reported apart
    assert all(0.0 <= a <= 1.0 for a in ours["accuracy"])
    assert r["speedup_vs_torch"] == pytest.approx(torch["steady_round_s"] / ours["steady_round_s"])
    total = r["model_flops"]["train"] + r["model_flops"]["eval"]
    assert r["mfu"] == pytest.approx(total / ours["steady_round_s"] / r["peak"]["flops_per_s"])
    # the FLOPs are those of the examples themselves: every training example of the 2 clients
    # (all sampled, one epoch) at its own length, 3 passes, and every test example, 1 pass:
    # 96 of the 120 examples train and 24 are tested, about 12x (their lengths vary)
    assert r["config"]["clients"] == 2 and r["config"]["local_epochs"] == 1
    ratio = r["model_flops"]["train"] / r["model_flops"]["eval"]
    assert 6 < ratio < 24, ratio
    assert r["machine"]["allocator"] and r["machine"]["torch_threads"] >= 1
    assert np.isfinite(r["torch_mfu"]) and r["torch_mfu"] > 0
