"""Execute the notebooks headless (nbclient, this venv's kernel) on a tiny random BERT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from run_fixtures import write_tiny_model, write_tiny_sst2

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("nb")
    return {
        "FEDJAX_SPLIT_NB_MODEL": str(write_tiny_model(base / "model")),
        "FEDJAX_SPLIT_NB_TASK": "sst2",
        "FEDJAX_SPLIT_NB_DATA_DIR": str(write_tiny_sst2(base / "data")),
        "FEDJAX_SPLIT_NB_ROUNDS": "2",
        "FEDJAX_SPLIT_NB_MAX_EXAMPLES": "120",
        "FEDJAX_SPLIT_NB_MAX_LENGTH": "16",
        "FEDJAX_SPLIT_NB_BATCH_SIZE": "32",
        "FEDJAX_SPLIT_NB_OUT": str(base / "runs"),
        "FEDJAX_SPLIT_CACHE": str(base / "cache"),
        "JAX_PLATFORMS": "cpu",
        # shared by both notebooks' kernels: runs with the same critical layer compile once
        "JAX_COMPILATION_CACHE_DIR": str(base / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "base": str(base),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart", "critical_layer_sweep"])
def test_notebook_runs(
    name: str, tiny_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in tiny_env.items():
        if k != "base":
            monkeypatch.setenv(k, v)
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": tiny_env["base"]}}
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]  # fmt: skip
    assert not errors
    runs = Path(tiny_env["FEDJAX_SPLIT_NB_OUT"])
    summaries = [json.loads(p.read_text()) for p in runs.glob("*/summary.json")]
    expected = {
        "quickstart": {"fedsplit", "fedavg"},
        "critical_layer_sweep": {"sweep_c0", "sweep_c1", "sweep_c2"},
    }[name]  # noqa: E501
    assert expected <= {p.parent.name for p in runs.glob("*/summary.json")}
    assert all(s["rounds"] == 2 for s in summaries)
