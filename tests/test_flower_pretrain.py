"""FedBFPT through the Flower apps (`python -m fedjax_split.flower pretrain`: a SuperLink and two
SuperNodes as processes on 127.0.0.1, each node reading its own text) against
`python -m fedjax_split.pretrain` on the same flags: every figure but the times is the same, and
so are split.json and the exported model's bytes; what crosses the wire is each client's model
down and only the round's trained layer and MLM head up. The server's checks of what nodes send
(an upload, held-out figures) are unit tests here; test_flower.py is fine-tuning's."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    TINY_LAYER,
    TINY_MLM_HEAD,
    cli_env,
    private_cache,
    write_text_sites,
    write_tiny_model,
    write_tiny_text,
)
from test_flower import _kill_marked, _no_processes_left

from fedjax_split.deploy import codec, protocol
from fedjax_split.deploy.pretrain_server import heldout_rows, take_upload
from fedjax_split.errors import UserError
from fedjax_split.run.pretrain_config import PretrainConfig

pytestmark = pytest.mark.xdist_group("federation")  # one at a time: see pyproject.toml

TIMEOUT = 300  # seconds for one command; the CLI kills its federation when it ends
# two rounds training layers 0 then 1 of 4 on 2-layer small models; held-out evaluation before
# round 1 and after round 2 (each evaluation is one more exchange, seconds here)
FLAGS = {
    "corpus": "local", "method": "fedbfpt", "clients": 2, "split": "source", "rounds": 2,
    "small-layers": 2, "schedule": "every", "batch-size": 8, "max-length": 24, "lr": 1e-3,
    "heldout-fraction": 0.1, "eval-every": 2,
}  # fmt: skip
TIMES = ("seconds", "cpu_seconds")
FLOWER_ONLY = {"clients_failed", "clients_rejected", "eval_failed", "eval_bytes_down"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("flower_pretrain")
    return {
        "base": base,
        "model": write_tiny_model(base / "model", num_layers=4),
        "text": write_tiny_text(base / "text"),
        "env": cli_env(jax_cache=base / "jax_cache"),
    }


def _args(env: dict, out: Path) -> list[str]:
    flags = {**FLAGS, "data-dir": env["text"], "model": env["model"], "output-dir": out}
    return [f"--{k}={v}" for k, v in flags.items()]


def _run(env: dict, args: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", *args], env={**env["env"], **extra_env},
            capture_output=True, text=True, timeout=TIMEOUT, cwd=env["base"],
        )  # fmt: skip
    except BaseException:
        out = next((a.split("=", 1)[1] for a in args if a.startswith("--output-dir=")), None)
        if out is not None:
            _kill_marked(out)
        raise


def _timeless(value: object) -> object:
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items()
                if not k.endswith(TIMES) and k not in FLOWER_ONLY}  # fmt: skip
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fedbfpt_through_flower_equals_the_simulation_and_sends_only_the_trained_part(
    env: dict,
) -> None:
    out, sim, record = env["base"] / "flower", env["base"] / "sim", env["base"] / "sent"
    res = _run(env, ["fedjax_split.flower", "pretrain", *_args(env, out)],
               **{protocol.RECORD_ENV: str(record)})  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "done on 2 SuperNodes: fedbfpt, 2 rounds, held-out MLM loss" in res.stdout
    _no_processes_left(str(out))
    res = _run(env, ["fedjax_split.pretrain", *_args(env, sim)])
    assert res.returncode == 0, res.stderr[-3000:]

    got, want = _metrics(out), _metrics(sim)
    assert _timeless(got) == _timeless(want)
    assert [r["layer"] for r in got] == [0, 1] and got[1]["mlm_loss"] is not None
    assert all(r["clients_failed"] == [] == r["clients_rejected"] == r["eval_failed"] for r in got)
    assert (out / "split.json").read_text() == (sim / "split.json").read_text()
    assert _sha(out / "model" / "model.safetensors") == _sha(sim / "model" / "model.safetensors")
    a, b = (json.loads((r / "summary.json").read_text()) for r in (out, sim))
    assert a.pop("deploy") == "flower" and a.pop("supernodes") == 2
    # the held-out text's unigram level: the simulation counts it; the server never sees that text
    assert a.pop("unigram") is None and 0 < b.pop("unigram")["unigram_accuracy"] < 1
    # what this process compiled (the server's programs, not the clients')
    drop = ("run_dir", "wall_seconds_this_process", "compilation")
    assert _timeless({k: v for k, v in a.items() if k not in drop}) == _timeless(
        {k: v for k, v in b.items() if k not in drop}
    )
    sent = [json.loads(x) for f in record.glob("*.jsonl") for x in f.read_text().splitlines()]
    _check_wire(sent, got)


def test_sites_through_flower_equal_the_simulation_and_no_site_path_is_written(
    env: dict,
) -> None:
    """--site-data: SuperNode k is given site k's directory alone (its node config's data-dir)
    and the server none (the run config says `node-config`); one FedBFPT round, the held-out
    figures before and after it each site's own batches scored where they live and summed by
    the server in site order. metrics.jsonl but times, split.json (the sites' counts) and the
    model's bytes equal `pretrain --site-data`'s; no site's path is in the run's files."""
    dirs = write_text_sites(env["base"] / "sites")
    flags = {k: v for k, v in FLAGS.items() if k not in ("corpus", "clients", "split")}
    flags |= {"rounds": 1, "site-data": ",".join(map(str, dirs)), "model": env["model"]}
    out, sim = env["base"] / "sites_flower", env["base"] / "sites_sim"
    args = lambda run: [f"--{k}={v}" for k, v in {**flags, "output-dir": run}.items()]  # noqa: E731
    res = _run(env, ["fedjax_split.flower", "pretrain", *args(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    _no_processes_left(str(out))
    res = _run(env, ["fedjax_split.pretrain", *args(sim)])
    assert res.returncode == 0, res.stderr[-3000:]
    got, want = _metrics(out), _metrics(sim)
    assert _timeless(got) == _timeless(want) and got[0]["mlm_loss"] is not None
    assert all(r["eval_failed"] == [] == r["clients_failed"] for r in got)
    assert (out / "split.json").read_text() == (sim / "split.json").read_text()
    split = json.loads((out / "split.json").read_text())
    assert split["scheme"] == "sites" and [s["documents"] for s in split["sites"]] == [60, 30]
    assert _sha(out / "model" / "model.safetensors") == _sha(sim / "model" / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["site_data"] == "node-config"
    for name in ("config.json", "split.json", "metrics.jsonl", "summary.json"):
        assert not any(str(d) in (out / name).read_text() for d in dirs), name


def _check_wire(sent: list[dict], got: list[dict]) -> None:
    """Down: each client's small model (2 of the 4 layers, the embeddings, the head) to train,
    the whole model to evaluate; up: the round's layer and the MLM head only, exactly the bytes
    the records count, and the held-out figures."""
    trains = [e for e in sent if e["type"] == "train.pretrain"]
    down = [e for e in trains if e["sender"] == "server"]
    up = [e for e in trains if e["sender"] == "client"]
    assert len(down) == len(up) == 4
    for e in down:
        layers = {a["path"].split("/")[1] for a in e["arrays"] if a["path"].startswith("encoder/")}
        assert len(layers) == 2 and "layer_0" in layers
        assert any(a["path"].startswith("embeddings/") for a in e["arrays"])
    uploaded = {p.split("/")[1] for e in up for a in e["arrays"]
                for p in [a["path"]] if p.startswith("encoder/")}  # fmt: skip
    assert uploaded == {"layer_0", "layer_1"}  # round 1's layer, then round 2's
    for e in up:
        paths = {a["path"] for a in e["arrays"]}
        assert all(p.startswith(("encoder/layer_", "mlm/")) for p in paths), paths
        assert len({p.split("/")[1] for p in paths if p.startswith("encoder/")}) == 1
        assert all(a["dtype"] == "float32" for a in e["arrays"])
        assert sum(4 * int(np.prod(a["shape"])) for a in e["arrays"]) == 4 * (
            TINY_LAYER + TINY_MLM_HEAD
        )
    assert sum(r["bytes_up"] for r in got) == sum(
        4 * int(np.prod(a["shape"])) for e in up for a in e["arrays"]
    )
    evals = [e for e in sent if e["type"] == "evaluate.pretrain"]
    assert {a["path"] for e in evals if e["sender"] == "client" for a in e["arrays"]} == {
        "batches", "sums"
    }  # fmt: skip


# --- the server's checks of what a node sends (no Flower processes) ---

GLOBAL = {
    "embeddings": {"word": jnp.ones((4, 2), jnp.float32)},
    "encoder": {"layer_0": {"k": jnp.ones((2, 2), jnp.float32)},
                "layer_1": {"k": jnp.ones((2, 2), jnp.float32)}},
    "mlm": {"bias": jnp.zeros(4, jnp.float32)},
}  # fmt: skip
TRAINED = frozenset({"encoder/layer_0/k", "mlm/bias"})
SETUP = SimpleNamespace(server_state=SimpleNamespace(global_params=GLOBAL), sizes=[7, 9])
GOOD = {"encoder": {"layer_0": {"k": jnp.full((2, 2), 2.0)}}, "mlm": {"bias": jnp.ones(4)}}
FIGURES = {
    protocol.TRAIN_LOSS: 2.5, protocol.TOKENS: 12, protocol.STEPS: 3, protocol.FLOPS: 2**60,
    protocol.BERT_FL_FLOPS: 2**61, protocol.SECONDS: 0.5, protocol.CPU_SECONDS: 0.4,
    protocol.SEQUENCES: 7,
}  # fmt: skip


def _reply(arrays: dict, **figures: object) -> SimpleNamespace:
    metrics = {k: v for k, v in {**FIGURES, **figures}.items() if v is not None}
    content = RecordDict({protocol.UPLOAD: codec.to_record(arrays),
                          protocol.METRICS: MetricRecord(metrics)})  # fmt: skip
    return SimpleNamespace(content=content)


def _flat(tree: dict, **changes: np.ndarray) -> dict:
    return {**codec.encode(tree, "float32"), **changes}


BAD_UPLOADS = {
    "nan": (_flat(GOOD, **{"mlm/bias": np.full(4, np.nan, np.float32)}), {}, "non-finite"),
    "inf": (_flat(GOOD, **{"mlm/bias": np.full(4, np.inf, np.float32)}), {}, "non-finite"),
    "shape": (_flat(GOOD, **{"mlm/bias": np.ones(5, np.float32)}), {}, "shape"),
    "dtype": (_flat(GOOD, **{"mlm/bias": np.ones(4, np.float16)}), {}, "arrived as"),
    "untrained layer": (_flat(GOOD, **{"encoder/layer_1/k": np.ones((2, 2), np.float32)}), {},
                        "unexpected paths"),
    "missing head": ({"encoder/layer_0/k": np.ones((2, 2), np.float32)}, {}, "missing paths"),
    "other sequence count": (_flat(GOOD), {protocol.SEQUENCES: 700}, "sequence count"),
    "fractional tokens": (_flat(GOOD), {protocol.TOKENS: 1.5}, "tokens"),
    "negative flops": (_flat(GOOD), {protocol.FLOPS: -1}, "flops"),
    "nan loss": (_flat(GOOD), {protocol.TRAIN_LOSS: float("nan")}, "training loss"),
    "no steps": (_flat(GOOD), {protocol.STEPS: None}, "steps"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_a_malformed_or_non_finite_upload_is_rejected(case: str) -> None:
    arrays, figures, needle = BAD_UPLOADS[case]
    with pytest.raises(ValueError, match=needle):
        take_upload(SETUP, _reply(arrays, **figures), 0, (0, 1), TRAINED)


def test_a_good_upload_is_taken_with_its_figures_exact() -> None:
    upload, report, bert_fl = take_upload(SETUP, _reply(_flat(GOOD)), 0, (0, 1), TRAINED)
    np.testing.assert_array_equal(np.asarray(upload["mlm"]["bias"]), np.ones(4))
    assert report.flops == 2**60 and bert_fl == 2**61  # past 2**53: no float on the way
    assert (report.client, report.layers, report.loss, report.tokens) == (0, (0, 1), 2.5, 12)
    assert report.bytes_up == 4 * (4 + 4)


def _eval_reply(batches: np.ndarray, sums: np.ndarray) -> SimpleNamespace:
    record = codec.to_record({"batches": batches, "sums": sums})
    return SimpleNamespace(content=RecordDict({protocol.HELDOUT: record}))


def test_held_out_figures_must_be_the_nodes_share_and_finite() -> None:
    rows = np.asarray([[3.0, 4.0, 1.0], [2.0, 2.0, 2.0]])
    ok = heldout_rows(_eval_reply(np.asarray([1, 3]), rows), 1, 2, 5)  # batches 1, 3 of 0..4
    assert sorted(ok) == [1, 3] and ok[3].tolist() == [2.0, 2.0, 2.0]
    bad = {
        "other batches": (np.asarray([0, 2]), rows, "expected"),
        "too few": (np.asarray([1]), rows[:1], "expected"),
        "not finite": (np.asarray([1, 3]), rows * np.asarray([1.0, 1.0, np.nan]), "finite"),
        "more correct than tokens": (np.asarray([1, 3]), rows + np.asarray([0, 0, 9.0]), "finite"),
        "float indices": (np.asarray([1.0, 3.0]), rows, "int64"),
    }
    for batches, sums, needle in bad.values():
        with pytest.raises(ValueError, match=needle):
            heldout_rows(_eval_reply(batches, sums), 1, 2, 5)
    empty = SimpleNamespace(content=RecordDict({protocol.HELDOUT: ArrayRecord()}))
    with pytest.raises(ValueError, match="int64"):
        heldout_rows(empty, 1, 2, 5)


BAD_FLAGS = [
    (["--method=centralised"], "does not run on Flower"),
    (["--site-data=node-config"], "--split source with --site-data"),
    (["--supernodes=3"], "--supernodes 3 but --clients 2"),
    (["--small-layers=9"], "outside 1..4"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD_FLAGS, ids=[b[1] for b in BAD_FLAGS])
def test_bad_input_exits_2_with_one_line_before_starting_anything(
    env: dict, extra: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    from fedjax_split import flower

    out = env["base"] / "bad"
    assert flower.main(["pretrain", *_args(env, out), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not out.exists()


def test_a_bad_site_is_one_line_before_starting_anything(
    env: dict, capsys: pytest.CaptureFixture
) -> None:
    """The local federation reads each site's text as its SuperNode would before it starts one;
    `node-config` is for real sites (--write-app), whose App names no site's path."""
    from fedjax_split import flower

    good = write_text_sites(env["base"] / "bad_sites")[0]
    empty = env["base"] / "bad_sites" / "empty"
    empty.mkdir()
    out, app = env["base"] / "bad_sites_out", env["base"] / "bad_sites_app"
    common = [f"--model={env['model']}", "--method=bert-fl", "--max-length=24",
              f"--output-dir={out}"]  # fmt: skip
    cases = {f"--site-data={good},{empty}": f"site 1 ({empty}): no *.txt files",
             "--site-data=node-config": "is for `--write-app`"}  # fmt: skip
    for flag, needle in cases.items():
        assert flower.main(["pretrain", *common, flag, "--clients=2"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], lines
        assert not out.exists()
    assert flower.main(["pretrain", *common, f"--site-data={good},{empty}",
                        f"--write-app={app}"]) == 0  # fmt: skip
    text = (app / "pyproject.toml").read_text()
    assert "node-config" in text and str(good) not in text and str(empty) not in text


def _sites_found(**heldout: object) -> dict:
    """Two sites' query records (site 0: 3 held-out batches of 2 held-out documents)."""
    found = {}
    for c, (docs, held) in enumerate([(10, 2), (6, 1)]):
        counts = {"documents": docs, "train": docs - held, "heldout": held}
        found[c] = (20 + c, {protocol.SPLIT_JSON: json.dumps(counts),
                             protocol.HELDOUT_BATCHES: heldout.get(f"h{c}", 3 - c),
                             protocol.SEQUENCES: heldout.get(f"s{c}", 40 + c)})  # fmt: skip
    return found


def test_the_join_counts_are_whole_numbers_within_bounds_else_one_line_naming_the_site() -> None:
    """A site's held-out batches and sequences are taken as reported, but a negative count
    (which would shift the next site's batches onto its rows), a fraction, a string or one
    beyond any corpus (which would make np.arange exhaust the server's memory) stops the run
    with one line naming the site."""
    from fedjax_split.deploy import pretrain_server

    config = PretrainConfig.of(clients=2, site_data="node-config", seed=3)
    split, shares, sizes = pretrain_server.join_counts(config, _sites_found())
    assert [(s.count, s.offset) for s in shares] == [(3, 0), (2, 3)] and sizes == [40, 41]
    bad = {
        "h0": (-1, "site 0 \\(SuperNode 20\\) reported heldout-batches -1"),
        "h1": (10**12, "site 1 \\(SuperNode 21\\) reported heldout-batches 1000000000000"),
        "s1": (2.5, "site 1 .*sequences 2.5"),
        "s0": ("7", "site 0 .*sequences 7"),
    }
    for key, (value, needle) in bad.items():
        with pytest.raises(UserError, match=needle):
            pretrain_server.join_counts(config, _sites_found(**{key: value}))
    found = _sites_found()
    found[1][1][protocol.SPLIT_JSON] = json.dumps({"documents": 6, "train": 6, "heldout": 0})
    with pytest.raises(UserError, match="site 1 reported 2 held-out batches of no held-out"):
        pretrain_server.join_counts(config, found)


def test_one_corpus_join_counts_are_checked_too() -> None:
    from fedjax_split.deploy import pretrain_server

    split = json.dumps({"clients": [[0, 1], [2]], "heldout": [3], "scheme": "source", "seed": 3})
    config = PretrainConfig.of(clients=2, site_data=None, seed=3)

    def found(heldout: object, text: str = split) -> dict:
        return {c: (20 + c, {protocol.SPLIT_JSON: text, protocol.HELDOUT_BATCHES: heldout,
                             protocol.SEQUENCES: 5}) for c in range(2)}  # fmt: skip

    _, shares, _ = pretrain_server.join_counts(config, found(4))
    assert [(s.part, s.parts, s.count) for s in shares] == [(0, 2, 4), (1, 2, 4)]
    for value in (-4, 10**9, 1.0):
        with pytest.raises(UserError, match="client [01] .*heldout-batches"):
            pretrain_server.join_counts(config, found(value))
    with pytest.raises(UserError, match="the split"):
        pretrain_server.join_counts(config, found(4, json.dumps({"clients": 3})))
