"""fedjax_split.train, the command line, end to end on a tiny random BERT: its flags and --config
file, what a run writes, Ctrl-C (exit 130) and a SIGKILL then --resume equal to the straight run
(with client-level DP too),
one-line exit-2 errors that leave a run's files alone, the malloc check before anything starts.

Runs go through real subprocesses (`python -m fedjax_split.train`) sharing a persistent JAX
compilation cache, so only the first run pays for compilation. What a run computes and records
(run.experiment.run_experiment) is tests/test_experiment.py's; the export, tests/test_export.py's.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    NER_SITES,
    NER_TYPES,
    SITES,
    cli_env,
    conll_sentences,
    private_cache,
    tiny_args,
    tsv_rows,
    write_tiny_conll,
    write_tiny_model,
    write_tiny_ner_sites,
    write_tiny_sites,
    write_tiny_sst2,
)

from fedjax_split import train

ROOT = Path(__file__).resolve().parents[1]
# batch 32 >= every client's 32 training examples: one batch shape, one compilation
FAST = {"batch_size": 32, "local_epochs": 2}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("cli")
    model = write_tiny_model(base / "model")
    data = write_tiny_sst2(base / "data")
    proc_env = cli_env(jax_cache=base / "jax_cache")
    return {"base": base, "model": model, "data": data, "env": proc_env}


def _cli(env: dict, args: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedjax_split.train", *args],
        env={**env["env"], **extra_env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=env["base"],
    )


def _args(env: dict, out: Path, **extra: object) -> list[str]:
    return tiny_args(env["model"], env["data"], out, **{**FAST, **extra})


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in records]


def _digest(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def straight(env: dict) -> Path:
    """One uninterrupted 4-round run."""
    out = env["base"] / "straight"
    res = _cli(env, _args(env, out))
    assert res.returncode == 0, res.stderr
    # the first line says the method the flags make, as a person would (tiny model: 2 layers)
    assert res.stderr.splitlines()[0] == (
        "FedSplitBERT, c = 1 of 2: embeddings + layer 1 shared, layer 2 + head personal"
    )
    # every round's line, each with the time left but the last: from round 1 on (compile
    # excluded: tests/test_outputs.py computes the figure by hand)
    rounds = [x for x in res.stderr.splitlines() if re.match(r"round \d \| ", x)]
    assert [x.split(" ", 2)[1] for x in rounds] == ["1", "2", "3", "4"], res.stderr
    assert all(x.endswith(" left") for x in rounds[:3]) and not rounds[3].endswith(" left")
    # the last lines a person reads: the figure beside the label priors', MB, time, files
    assert res.stdout.startswith("done: 4 rounds, accuracy 0."), res.stdout
    assert ", majority label 0." in res.stdout and " MB sent, " in res.stdout
    assert f"results in {out} (plot {out / 'plot.png'}, summary.json" in res.stdout
    assert f"python -m fedjax_split.export --run-dir {out} --client 0" in res.stdout
    return out


def test_straight_run_writes_every_output(straight: Path) -> None:
    """The command's run directory; the rounds' accounting in it is test_experiment's."""
    for name in ("metrics.jsonl", "summary.json", "config.json", "partition.json"):
        assert (straight / name).is_file(), name
    assert [r["round"] for r in _metrics(straight)] == [1, 2, 3, 4]
    assert (straight / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["rounds"] == 4
    # the CLI ran on glibc's malloc, tuned before anything else (fedjax_split.runtime)
    assert summary["allocator"] == "glibc-tuned"
    config = json.loads((straight / "config.json").read_text())  # the flags reached the run
    assert config["critical_layer"] == 1 and config["clients"] == 3


def test_interrupted_then_resumed_run_matches_straight_run(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    """The seed comes from a parameterised config (`FILE.py:ARG`), kept as given in config.json;
    --resume with another ARG is refused, with the same one resumes."""
    out = env["base"] / "interrupted"
    seeds = env["base"] / "seeds.py"
    seeds.write_text("def get_config(seed):\n    return {'seed': int(seed)}\n")
    args = [a for a in _args(env, out) if not a.startswith("--seed=")]
    res = _cli(env, [f"--config={seeds}:0", *args], FEDJAX_SPLIT_STOP_AFTER_ROUND="2")
    assert res.returncode == 130, res.stderr
    assert "last checkpoint: round 2" in res.stderr
    assert [r["round"] for r in _metrics(out)] == [1, 2]
    assert not (out / "summary.json").exists()
    assert json.loads((out / "config.json").read_text())["config"] == f"{seeds}:0"
    assert train.main([f"--config={seeds}:1", *args, "--resume"]) == 2
    assert "seed" in capsys.readouterr().err
    res = _cli(env, [f"--config={seeds}:0", *args, "--resume"])
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["config"] == f"{seeds}:0"
    assert _without_time(_metrics(out)) == _without_time(_metrics(straight))
    a = json.loads((out / "summary.json").read_text())
    b = json.loads((straight / "summary.json").read_text())
    assert _without_time([a["final"]]) == _without_time([b["final"]])


def _sigkill_after_checkpoint(env: dict, args: list[str], out: Path, round_: int) -> None:
    """Runs `train` with `args` and SIGKILLs it as soon as checkpoint `round_` is on disk."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedjax_split.train", *args],
        env=env["env"],
        cwd=env["base"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not (out / "checkpoints" / str(round_)).is_dir() and proc.poll() is None:
        assert time.time() < deadline, f"run did not reach round {round_}"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkilled_run_resumes_to_the_same_result(env: dict, straight: Path) -> None:
    """A real SIGKILL as soon as round 2's checkpoint is on disk; metrics.jsonl may hold rows past
    the checkpoint, which --resume must drop rather than duplicate."""
    out = env["base"] / "killed"
    _sigkill_after_checkpoint(env, _args(env, out), out, 2)
    res = _cli(env, [*_args(env, out), "--resume"])
    assert res.returncode == 0, res.stderr
    assert _without_time(_metrics(out)) == _without_time(_metrics(straight))


def test_a_sigkilled_lora_run_resumes_from_its_one_base_copy_to_the_same_result(
    env: dict,
) -> None:
    """LoRA keeps its frozen base once per run (checkpoints/per_run/), not in each checkpoint:
    a run SIGKILLed once round 1's checkpoint is on disk resumes to the straight run's records,
    and client 0's export is the straight run's, tensor for tensor."""
    from safetensors.numpy import load_file

    from fedjax_split.export import export_client

    flags = {"rounds": 3, "lora_rank": 2, "lr": 1e-2}
    straight, out = env["base"] / "lora_straight", env["base"] / "lora_killed"
    res = _cli(env, _args(env, straight, **flags))
    assert res.returncode == 0, res.stderr
    _sigkill_after_checkpoint(env, _args(env, out, **flags), out, 1)
    res = _cli(env, [*_args(env, out, **flags), "--resume"])
    assert res.returncode == 0, res.stderr
    assert _without_time(_metrics(out)) == _without_time(_metrics(straight))
    for run in (straight, out):
        assert len(list((run / "checkpoints" / "per_run").iterdir())) == 1
    want, got = (load_file(str(export_client(run, 0, env["base"] / f"{run.name}_export")
                               / "model.safetensors")) for run in (straight, out))  # fmt: skip
    assert want.keys() == got.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_sigkilled_dp_run_resumes_to_the_same_result(env: dict) -> None:
    """Client-level DP with adaptive clipping (the clip norm is server state the checkpoint must
    carry) and one of 3 clients a round (Poisson: at seed 0 the opt-out's sample is client 1,
    then nobody twice, as `_opt_out_sample` works out), SIGKILLed once round 1's checkpoint is
    on disk, then
    resumed: every record as the straight run's, the server's noise included. Two separate runs
    draw the same noise only under --dp-insecure-reproducible-noise (a run's own secret is
    restored from its checkpoint: tests/test_experiment.py resumes one without the opt-out)."""
    flags = {"rounds": 3, "clients_per_round": 1, "dp_noise_multiplier": 0.05, "dp_clip": 0.05,
             "dp_clip_quantile": 0.5}  # fmt: skip
    opt_out = "--dp-insecure-reproducible-noise"
    straight, out = env["base"] / "dp_straight", env["base"] / "dp_killed"
    res = _cli(env, [*_args(env, straight, **flags), opt_out])
    assert res.returncode == 0, res.stderr
    assert "WARNING: --dp-insecure-reproducible-noise" in res.stderr
    _sigkill_after_checkpoint(env, [*_args(env, out, **flags), opt_out], out, 1)
    res = _cli(env, [*_args(env, out, **flags), opt_out, "--resume"])
    assert res.returncode == 0, res.stderr
    assert _without_time(_metrics(out)) == _without_time(_metrics(straight))
    # the per-client figures are in the server's private file, and resume alike
    want = _private(straight)
    assert _without_time(_private(out)) == _without_time(want)
    assert not any("clients_sampled" in r or "update_norms" in r for r in _metrics(out))
    assert [r["clients_sampled"] for r in want] == SAMPLED_BY_THE_OPT_OUT
    clips = [r["dp_clip"] for r in want]
    # the first round's clip norm (in fp32), then one that moved every round
    assert clips[0] == pytest.approx(0.05, rel=1e-7) and len(set(clips)) == 3
    assert want[1]["update_norms"] == [] and want[1]["bytes_up"] == 0
    eps = [r["epsilon"] for r in want]
    assert 0 < eps[0] < eps[1] < eps[2]
    a = json.loads((out / "summary.json").read_text())
    b = json.loads((straight / "summary.json").read_text())
    assert a["privacy"] == b["privacy"] and a["privacy"]["adaptive_clip_quantile"] == 0.5
    assert a["privacy"]["noise"].startswith("INSECURE")


def _private(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "private" / "clients.jsonl").read_text().splitlines()]


def _opt_out_sample() -> list[list[int]]:
    """The clients --dp-insecure-reproducible-noise samples at seed 0 (3 clients, rate 1/3),
    worked out here from its definition: HMAC-SHA256 under SHA-256(label | seed), per client."""
    import hashlib
    import hmac
    import struct

    label = b"fedjax_split: DP noise from the seed (insecure, reproducible)"
    key = hashlib.sha256(label + (0).to_bytes(16, "big", signed=True)).digest()
    out = []
    for r in (1, 2, 3):
        draws = [int.from_bytes(hmac.new(key, b"sample" + struct.pack(">qq", r, i),
                                         hashlib.sha256).digest()[:8], "big") >> 11
                 for i in range(3)]  # fmt: skip
        out.append([i for i, d in enumerate(draws) if d / 2.0**53 < 1 / 3])
    return out


SAMPLED_BY_THE_OPT_OUT = _opt_out_sample()


THREE_DIRS = f"{ROOT}/docs,{ROOT}/tests,{ROOT}/configs"  # any three directories
BAD = [
    ({"task": "nope"}, "unknown task"),
    ({"algorithm": "fedsplit"}, "unknown algorithm"),
    ({"critical_layer": 3}, "outside 0..2"),
    ({"critical_layer": -1}, "--critical-layer"),
    ({"clients": 0}, "--clients must be at least 1"),
    ({"clients_per_round": 5}, "--clients-per-round must be in 1..3"),
    ({"data_dir": "/nonexistent/glue"}, "data dir"),
    ({"attention": "cudnn"}, "--attention cudnn needs a GPU and --dtype bfloat16"),
    ({"freeze": "embeddings.("}, "--freeze"),
    ({"config": f"{ROOT}/configs/table3.py:nope"}, "unknown Table III task 'nope'"),
    ({"config": f"{ROOT}/configs/table3.py"}, "takes an argument (task)"),
    ({"config": f"{ROOT}/configs/table6_communication.py:mrpc"}, "takes no argument"),
    # the server's safeguards: settings that go together (PrivacySettings.check, run.cross_checks)
    ({"dp_clip": 1.0}, "--dp-clip 1 needs --dp-noise-multiplier"),
    ({"dp_max_epsilon": 3.0}, "--dp-max-epsilon 3 needs --dp-noise-multiplier"),
    ({"dp_noise_multiplier": 1.0}, "--dp-noise-multiplier needs --dp-clip"),
    ({"dp_noise_multiplier": 1.0, "dp_clip": 1.0, "aggregator": "median"},
     "--aggregator median with DP"),
    ({"dp_noise_multiplier": 0.0, "dp_clip": 1.0, "dp_max_epsilon": 3.0}, "no noise, no budget"),
    ({"dp_noise_multiplier": 1.0, "dp_clip": 0.0}, "--dp-clip must be a number > 0"),
    ({"dp_noise_multiplier": -1.0, "dp_clip": 1.0}, "--dp-noise-multiplier must be a number >= 0"),
    ({"dp_noise_multiplier": 1.0, "dp_clip": 1.0, "dp_delta": 1.0}, "--dp-delta must be in (0, 1)"),
    ({"trim_fraction": 0.6}, "--trim-fraction must be in [0, 0.5)"),
    ({"max_update_norm": -2.0}, "--max-update-norm must be a number > 0"),
    ({"attack": "sign-flip", "attack_fraction": 0.0}, "--attack-fraction must be in (0, 1]"),
    ({"aggregator": "mode"}, "unknown aggregator 'mode'"),
    ({"dp_noise_multiplier": 0.5, "dp_clip": 1.0, "dp_clip_quantile": 1.5},
     "--dp-clip-quantile must be in (0, 1)"),
    # LoRA (models.lora): the rank first, then the others
    ({"lora_alpha": 4.0}, "--lora-alpha 4 needs --lora-rank"),
    ({"lora_targets": "key"}, "--lora-targets key needs --lora-rank"),
    ({"lora_rank": 0}, "--lora-rank must be an integer >= 1"),
    ({"model_layers": 3}, "--model-layers 3 is outside 1..2"),
    ({"model_layers": 0}, "--model-layers must be at least 1"),
    # FedBT's schedule: a cycle inside the model, one shared model
    ({"layer_schedule": "fedbt", "critical_layer": "L", "cycle_factor": 3},
     "--cycle-factor 3 is outside 1..2"),
    ({"layer_schedule": "fedbt"},
     "(c = L = 2), but --critical-layer 1 keeps the layers above 1 personal; drop --critical"),
    ({"num_processes": 0}, "--num-processes must be at least 1"),
    ({"num_processes": 2, "process_id": 2}, "--process-id must be in 0..1"),
    ({"num_processes": 2, "process_id": 0, "chunk_size": 4}, "several processes train one"),
    ({"lora_rank": 2, "lora_dropout": 1.0}, "--lora-dropout must be in [0, 1)"),
    ({"lora_rank": 2, "lora_targets": "(query"}, "--lora-targets '(query' is not a valid regex"),
    ({"lora_rank": 2, "lora_targets": "pooler"}, "--lora-targets 'pooler' matches no dense layer"),
    # adaptive clipping's count noise is M / 20 = 0.15 with every one of 3 clients
    ({"dp_noise_multiplier": 0.5, "dp_clip": 1.0, "dp_clip_quantile": 0.5},
     "--dp-noise-multiplier below 2 x the count's noise (0.3)"),
    # sites with their own data (--site-data): no pool to subsample or partition
    ({"data_dir": None, "site_data": "/nonexistent/a,/nonexistent/b,/nonexistent/c"},
     "--site-data: site 0's directory '/nonexistent/a' does not exist"),
    ({"data_dir": None, "site_data": f"{ROOT},{ROOT}/docs"},
     "--clients 3 but --site-data names 2 sites; drop --clients"),
    ({"site_data": THREE_DIRS}, "with --site-data: each client's data are its own site's files, "
     "not drawn from a pool; drop --data-dir"),
    ({"data_dir": None, "site_data": THREE_DIRS, "partition": "dirichlet"},
     "--partition dirichlet with --site-data"),
    ({"data_dir": None, "site_data": THREE_DIRS, "max_examples": 20},
     "--max-examples 20 with --site-data"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "needle"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_one_line_and_keeps_outputs(
    env: dict, straight: Path, change: dict, needle: str, capsys: pytest.CaptureFixture
) -> None:
    before = _digest(straight)
    for resume in ([], ["--resume"]):  # pointed at the existing run, with and without --resume
        code = train.main([*_args(env, straight, **change), *resume])
        err = capsys.readouterr().err
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle.lower() in err.lower()
    assert _digest(straight) == before


def test_a_max_length_past_the_models_positions_is_one_line(
    env: dict, capsys: pytest.CaptureFixture
) -> None:
    """The tiny model has 64 positions: 65 would look past the table (NaN, every client
    diverging), so it is refused before anything is written."""
    out = env["base"] / "too_long"
    assert train.main(_args(env, out, max_length=65)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --max-length must be at most the model's 64 positions (its "
                   "max_position_embeddings), got 65"]  # fmt: skip
    assert not out.exists()


def test_clients_that_all_diverge_stop_the_run_with_one_line(
    env: dict, capsys: pytest.CaptureFixture
) -> None:
    """A learning rate of 1e10 sends every client's fp16 upload past 65,504 (inf): the server
    leaves them all out, so the run stops at round 1 with one line, not 4 rounds unmoved."""
    out = env["base"] / "diverged"
    assert train.main(_args(env, out, lr=1e10, quantize="fp16")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: round 1: every upload was rejected (not finite")
    assert not any("Traceback" in line for line in err)
    assert (out / "metrics.jsonl").read_text() == ""


def test_sites_train_on_exactly_their_own_files(env: dict) -> None:
    """--site-data: three sites of different sizes and label skews are the three clients (no
    --clients); each client trains on its site's train file and tests on its dev file (the site
    without one on a fifth of its train file), and partition.json says so."""
    sites = write_tiny_sites(env["base"] / "sites")
    out = env["base"] / "sites_run"
    res = _cli(env, tiny_args(env["model"], env["data"], out, data_dir=None, clients=None,
                              site_data=",".join(map(str, sites)), rounds=1, **FAST))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["clients"] == 3
    doc = json.loads((out / "partition.json").read_text())
    assert doc["scheme"] == "sites" and doc["label_names"] == ["negative", "positive"]
    counts = [(len(c["train"]), len(c["test"])) for c in doc["clients"]]
    for k, (site, d) in enumerate(zip(SITES, sites, strict=True)):
        rows = tsv_rows(d / "train.tsv")
        assert rows == site["n_train"]
        if site["n_dev"]:
            assert counts[k] == (rows, tsv_rows(d / "dev.tsv")), k
        else:
            assert counts[k] == (rows - int(rows / 5 + 0.5), int(rows / 5 + 0.5)), k
    shares = [s[1] for s in doc["realised_shares"]]  # the share of positive labels
    assert shares[0] > 0.7 > 0.3 > shares[2]  # the sites' own skews (85% and 15% drawn)
    assert f"partition sites K=3 seed=0 task=sst2 examples={sum(map(sum, counts))}" in res.stderr


def test_a_sites_unknown_label_is_one_line_naming_file_and_line(
    env: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    good = write_tiny_sst2(tmp_path / "good", n_train=8, n_dev=0)
    bad = write_tiny_sst2(tmp_path / "bad", n_train=8, n_dev=0)
    lines = (bad / "train.tsv").read_text().splitlines()
    lines[4] = lines[4].rsplit("\t", 1)[0] + "\tneutral"  # a label SST-2 does not have
    (bad / "train.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    args = tiny_args(env["model"], env["data"], out, data_dir=None, clients=None,
                     site_data=f"{good},{bad}")  # fmt: skip
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: site 1 ({bad}): task sst2: 1 invalid")
    assert "train.tsv:5 (label 'neutral')" in err[0]
    assert not out.exists()  # nothing written


def _ner_site_args(env: dict, out: Path, dirs: list[Path], **extra: object) -> list[str]:
    flags = {**FAST, "batch_size": 64, "entity_types": NER_TYPES, **extra}
    return tiny_args(env["model"], env["data"], out, task="ner", data_dir=None, clients=None,
                     site_data=",".join(map(str, dirs)), **flags)  # fmt: skip


def test_ner_sites_train_on_exactly_their_own_conll_files(env: dict) -> None:
    """--task ner --site-data with --entity-types: three CoNLL sites of different sizes are
    the three clients; each trains on its train file's sentences and tests on its test file
    (the site without one on a fifth of its train file), in the run's tag vocabulary."""
    dirs = write_tiny_ner_sites(env["base"] / "ner_sites")
    out = env["base"] / "ner_sites_run"
    res = _cli(env, _ner_site_args(env, out, dirs, rounds=1))
    assert res.returncode == 0, res.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["clients"] == 3 and config["entity_types"] == NER_TYPES
    doc = json.loads((out / "partition.json").read_text())
    assert doc["scheme"] == "sites" and doc["label_names"] == ["neg", "pos", "(none)"]
    for k, (c, d) in enumerate(zip(doc["clients"], dirs, strict=True)):
        rows = conll_sentences(d / "train.txt")
        assert rows == NER_SITES[k]["n_train"]
        if NER_SITES[k]["n_test"]:
            assert (len(c["train"]), len(c["test"])) == (rows, conll_sentences(d / "test.txt"))
        else:
            assert (len(c["train"]), len(c["test"])) == (rows - int(rows / 5 + 0.5),
                                                         int(rows / 5 + 0.5)), k  # fmt: skip
    (final,) = [r for r in _metrics(out) if r.get("round") == 1 and "f1" in r]
    assert len(final["clients"]) == 3  # every site scored on its own test sentences


def test_ner_site_with_an_unknown_tag_or_without_entity_types_is_one_line(
    env: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    good = write_tiny_conll(tmp_path / "good", n_train=6, n_test=0)
    bad = write_tiny_conll(tmp_path / "bad", n_train=6, n_test=0)
    lines = (bad / "train.txt").read_text().splitlines()
    at = next(i for i, x in enumerate(lines) if x.endswith("\tO"))
    lines[at] = lines[at].replace("\tO", "\tB-MISC")
    (bad / "train.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    assert train.main(_ner_site_args(env, out, [good, bad])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (
        f"error: site 1 ({bad}): {bad / 'train.txt'}:{at + 1}: tag 'B-MISC' is not in the tag "
        "vocabulary (O, B-/I- of --entity-types neg,pos); add its type to --entity-types or fix "
        "the tag"
    )
    assert train.main(_ner_site_args(env, out, [good, bad], entity_types=None)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --entity-types TYPE1,TYPE2" in err[0]
    assert not out.exists()  # nothing written


def test_existing_run_without_resume_is_refused(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    before = _digest(straight)
    assert train.main(_args(env, straight)) == 2
    assert "--resume" in capsys.readouterr().err
    assert _digest(straight) == before


def test_unreadable_checkpoint_with_resume(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    run = env["base"] / "corrupt"
    shutil.copytree(straight, run)
    for f in (run / "checkpoints" / "4").rglob("*"):
        if f.is_file() and "state" in f.parts:
            f.write_bytes(b"\x00garbage")
    before = _digest(run)
    code = train.main([*_args(env, run), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is damaged (state/" in err[0]
    assert _digest(run) == before


def test_resume_with_another_model_of_the_same_shapes_is_refused(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    run = env["base"] / "other_model"
    shutil.copytree(straight, run)
    other = env["base"] / "model_gelu_new"
    shutil.copytree(env["model"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_act"] = "gelu_new"  # same shapes, different function
    (other / "config.json").write_text(json.dumps(cfg))
    before = _digest(run)
    args = [a for a in _args(env, run) if not a.startswith("--model=")]
    code = train.main([*args, f"--model={other}", "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "model" in err[0]
    assert _digest(run) == before


def test_resume_on_edited_texts_with_the_same_examples_is_refused(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    """The same number of examples (so the same partition) but edited texts: --resume would train
    the checkpoint's clients on other data, so it is refused, and the run is left as it was."""
    run = env["base"] / "edited_data"
    shutil.copytree(straight, run)
    edited = env["base"] / "data_edited"
    shutil.copytree(env["data"], edited)
    lines = (edited / "train.tsv").read_text().splitlines()
    first, label = lines[1].rsplit("\t", 1)
    lines[1] = f"{first} again\t{label}"  # one text changed, its label and the rest kept
    (edited / "train.tsv").write_text("\n".join(lines) + "\n")
    before = _digest(run)
    args = [a for a in _args(env, run) if not a.startswith("--data-dir=")]
    code = train.main([*args, f"--data-dir={edited}", "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "have the checkpoint's examples but other texts or labels" in err[0]
    assert _digest(run) == before


def test_process_exit_status_and_no_traceback(env: dict) -> None:
    res = _cli(env, _args(env, env["base"] / "never", algorithm="bogus"))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: unknown algorithm")
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (env["base"] / "never").exists()


def test_dp_flags_without_their_mechanism_are_refused_by_the_command(env: dict) -> None:
    res = _cli(env, _args(env, env["base"] / "never_dp_cli", dp_clip=0.5))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: --dp-clip 0.5 needs --dp-noise-multiplier")
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (env["base"] / "never_dp_cli").exists()


def test_help_explains_every_flag() -> None:
    text = train.build_parser().format_help()
    for flag in (
        "--task", "--model", "--data-dir", "--algorithm", "--critical-layer", "--clients",
        "--clients-per-round", "--partition", "--alpha", "--beta", "--rounds", "--local-epochs",
        "--batch-size", "--lr", "--mu", "--quantize", "--max-length", "--max-examples", "--seed",
        "--output-dir", "--resume", "--config", "--chunk-size", "--dtype", "--packing",
        "--cpu-devices", "--attention", "--bucketing", "--paper-fill", "--freeze",
    ):  # fmt: skip
        assert flag in text, flag
    assert train.config_from_args(["--packing"]).runtime.packing is True
    assert train.config_from_args(["--no-packing"]).runtime.packing is False
    assert train.config_from_args([]).runtime.packing is True  # packed, plain shuffled batches
    assert train.config_from_args([]).runtime.bucketing is False
    assert train.config_from_args(["--bucketing"]).runtime.bucketing is True
    assert train.config_from_args([]).data.paper_fill == "exact"
    assert train.config_from_args(["--paper-fill", "sequential"]).data.paper_fill == "sequential"
    assert train.config_from_args(["--cpu-devices", "1"]).runtime.cpu_devices == 1
    assert train.config_from_args([]).runtime.cpu_devices is None  # default: one device
    assert train.config_from_args(["--attention", "cudnn"]).runtime.attention == "cudnn"
    assert train.config_from_args([]).runtime.attention == "xla"
    assert train.config_from_args(["--freeze", r"embeddings\."]).model.freeze == r"embeddings\."


def test_help_lists_every_registered_task() -> None:
    """--task's help is generated from the registry, so a task added there is listed."""
    from fedjax_split.tasks.registry import TASKS

    text = " ".join(train.build_parser().format_help().split())  # argparse wraps lines
    assert {"wnut16", "nero", "ner", "20news", "stsb"} <= set(TASKS)
    for name in TASKS:
        assert re.search(rf"[(, ]{re.escape(name)}[,)]", text), name


def test_every_setting_has_exactly_one_flag_with_help() -> None:
    """The flags are generated from the config schema: one per setting, none besides."""
    from fedjax_split.run.config import FIELDS, SCHEMA

    parser = train.build_parser()
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(FIELDS)
    for name in FIELDS:
        assert len(SCHEMA.help(name)) >= 10, name
    assert train.config_from_args(["--critical-layer", "L"]).model.critical_layer is None
    every = train.config_from_args(["--clients-per-round", "all"])
    assert every.federation.clients_per_round is None
    assert train.config_from_args(["--server-lr", "0.5"]).federation.server_lr == 0.5


def test_config_file_with_flag_override(env: dict, tmp_path: Path) -> None:
    cfg = tmp_path / "c.py"
    cfg.write_text('def get_config():\n    return {"task": "sst2", "rounds": 9, "seed": 5}\n')
    config = train.config_from_args(["--config", str(cfg), "--rounds", "2"])
    assert (config.federation.rounds, config.seed, config.data.task) == (2, 5, "sst2")


def test_an_error_names_the_config_file_a_value_came_from_and_a_fix_that_works(
    env: dict, tmp_path: Path
) -> None:
    """The command with a config file that sets the critical layer, and --layer-schedule fedbt:
    the user typed no --critical-layer, so the error says the value is the file's and passes
    the flag that overrides it; a flag's own error names the flag alone."""
    out = env["base"] / "never_from_file"
    cfg = tmp_path / "tiny_split.py"
    values = {"task": "sst2", "model": str(env["model"]), "data_dir": str(env["data"]),
              "output_dir": str(out), "critical_layer": 1, "max_length": 16}  # fmt: skip
    cfg.write_text(f"def get_config():\n    return {values!r}\n")
    res = _cli(env, ["--config", str(cfg), "--layer-schedule", "fedbt"])
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("error: --layer-schedule fedbt trains one shared model")
    assert f"--critical-layer 1 (from {cfg}) keeps the layers above 1 personal" in res.stderr
    assert f"pass --critical-layer L (or remove critical_layer from {cfg})" in res.stderr
    res = _cli(env, ["--config", str(cfg), "--clients", "0"])
    assert res.returncode == 2 and res.stderr == "error: --clients must be at least 1, got 0\n"
    assert not out.exists()


def test_resume_without_any_checkpoint_is_refused(
    env: dict, straight: Path, capsys: pytest.CaptureFixture
) -> None:
    """Rounds are logged but no checkpoint exists: --resume must not silently start over."""
    run = env["base"] / "no_ckpt"
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoints")
    before = _digest(run)
    assert train.main([*_args(env, run), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no readable checkpoint" in err[0]
    assert _digest(run) == before


def test_an_unknown_malloc_mode_is_a_one_line_error(env: dict) -> None:
    res = _cli(env, _args(env, env["base"] / "never_malloc"), FEDJAX_SPLIT_MALLOC="off")
    assert res.returncode == 2
    want = "error: FEDJAX_SPLIT_MALLOC='off': use auto (tune glibc's malloc) or system\n"
    assert res.stderr == want
    assert not (env["base"] / "never_malloc").exists()


def test_console_script_goes_through_cli() -> None:
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="fedjax-split-train")
    assert script.value == "fedjax_split.train:cli"  # not main: cli checks the malloc setting
