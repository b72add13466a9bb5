"""Execute the notebooks headless (nbclient, this venv's kernel) on a tiny random BERT, and
check their first cell, which installs the package on Colab only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from run_fixtures import write_tiny_conll, write_tiny_model, write_tiny_sst2, write_tiny_text

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["quickstart", "critical_layer_sweep", "ner", "fedbfpt", "deployment", "lora"]


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
        "FEDJAX_SPLIT_CACHE": str(base / "cache"),
        "JAX_PLATFORMS": "cpu",
        # shared by the notebooks' kernels: runs with the same programs compile once
        "JAX_COMPILATION_CACHE_DIR": str(base / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "base": str(base),
    }


def _overrides(name: str, base: Path) -> dict[str, str]:
    """Each notebook's own tiny settings over tiny_env's."""
    ner = {
        "FEDJAX_SPLIT_NB_TASK": "ner",
        "FEDJAX_SPLIT_NB_DATA_DIR": str(write_tiny_conll(base / "conll")),
        "FEDJAX_SPLIT_NB_BATCH_SIZE": "8",
        "FEDJAX_SPLIT_NB_LR": "3e-3",
    }
    if name == "ner":
        return {**ner, "FEDJAX_SPLIT_NB_SENTENCE": "the good film was awful"}
    if name == "fedbfpt":  # one pre-training round: layer 0 only, so a 1-layer small model
        return {
            **ner,
            "FEDJAX_SPLIT_NB_CORPUS": "local",
            "FEDJAX_SPLIT_NB_TEXT_DIR": str(write_tiny_text(base / "text")),
            "FEDJAX_SPLIT_NB_CLIENTS": "2",
            "FEDJAX_SPLIT_NB_PT_ROUNDS": "1",
            "FEDJAX_SPLIT_NB_MAX_DOCUMENTS": "0",
        }
    if name == "deployment":  # one round: each is two Flower message exchanges
        return {"FEDJAX_SPLIT_NB_ROUNDS": "1"}
    return {}


# each notebook's run directories (under FEDJAX_SPLIT_NB_OUT) with a summary.json: their rounds
EXPECTED = {
    "quickstart": {"fedsplit": 2, "fedavg": 2, "dp": 2},
    "critical_layer_sweep": {"sweep_c0": 2, "sweep_c1": 2, "sweep_c2": 2},
    "ner": {"ner": 2},
    "fedbfpt": {"pretrain_fedbfpt": 1, "pretrain_bert-fl": 1, "finetune_none": 2,
                "finetune_fedbfpt": 2, "finetune_bert-fl": 2},  # fmt: skip
    "deployment": {"flower": 1, "simulation": 1},
    "lora": {"full": 2, "lora": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group("federation"))
                                  if n == "deployment" else n for n in NOTEBOOKS])  # fmt: skip
def test_notebook_runs(
    name: str, tiny_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = Path(tiny_env["base"])
    runs = base / "runs" / name
    env = {**tiny_env, **_overrides(name, base), "FEDJAX_SPLIT_NB_OUT": str(runs)}
    for k, v in env.items():
        if k != "base":
            monkeypatch.setenv(k, v)
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(base)}}
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]  # fmt: skip
    assert not errors
    summaries = {p.parent.name: json.loads(p.read_text()) for p in runs.glob("*/summary.json")}
    assert {k: s["rounds"] for k, s in summaries.items()} == EXPECTED[name]
    if name == "ner":  # the sentence was tagged with the exported model's tag names
        text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        assert "tags: ['O', 'B-neg', 'I-neg', 'B-pos', 'I-pos']" in text
        assert "awful" in text
    if name == "lora":  # PEFT loaded the adapter onto the base model: the merged model's logits
        text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        found = re.search(r"largest logit difference, merged vs PEFT adapter: (\S+)", text)
        assert found and float(found.group(1)) < 1e-5, text


def test_every_notebook_is_run_here() -> None:
    assert sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(NOTEBOOKS)


def _colab_cell(name: str) -> str:
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    return first.source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_cell_installs_on_colab_only(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside Colab the cell runs nothing; on Colab (google.colab imported) with the package
    missing it pip-installs REPO_URL, or LOCAL_PATH editable, and without either stops."""
    import importlib.util

    source = _colab_cell(name)
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "check_call", lambda cmd: calls.append(cmd))
    exec(source, {})
    assert calls == []  # not on Colab

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    exec(source, {})
    assert calls == []  # on Colab, already installed

    monkeypatch.setattr(importlib.util, "find_spec", lambda _: None)
    with pytest.raises(SystemExit, match="set REPO_URL"):
        exec(source, {})
    url = source.replace('REPO_URL = ""', 'REPO_URL = "https://example.org/o/fedjax_split.git"')
    exec(url, {})
    extras = "[flower]" if name == "deployment" else ""
    target = f"fedjax_split{extras} @ git+https://example.org/o/fedjax_split.git"
    assert calls.pop() == [sys.executable, "-m", "pip", "install", "-q", target]
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(source.replace('LOCAL_PATH = ""', 'LOCAL_PATH = "/content/fs"'), {})
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    assert calls.pop() == [*pip, "-e", f"/content/fs{extras}"]
    assert sys.path[0] == "/content/fs"
