"""Config: defaults, file + flag resolution order, type checks, one-line validation errors, and
every shipped config (each ARG of a parameterised one) with the commands its docstring gives."""

from __future__ import annotations

import ast
import inspect
import json
import runpy
import shlex
from pathlib import Path

import pytest

from fedjax_split import train
from fedjax_split.errors import UserError
from fedjax_split.run.config import ExperimentConfig, resolve_config
from fedjax_split.run.cross_checks import validate_critical_layer
from fedjax_split.run.saved_config import saved_dict, trajectory_mismatch
from fedjax_split.run.settings import load_config_file

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_are_the_paper_setting() -> None:
    c = ExperimentConfig()
    assert (c.model.name, c.federation.clients, c.data.partition, c.model.critical_layer) == (
        "bert-base-uncased",
        3,
        "paper",
        "half",
    )
    assert validate_critical_layer(c, 12) == 6  # the paper's c = 6 of bert-base's 12
    fed = c.federation
    assert fed.algorithm == "fedavg" and fed.quantize == "none" and c.data.max_length == 128
    assert fed.sampled_clients == 3 and c.prox_mu == 0.0 and fed.effective_server_lr == 1.0


def test_file_then_flags_later_wins(tmp_path: Path) -> None:
    py = tmp_path / "c.py"
    py.write_text('def get_config():\n    return {"task": "mrpc", "rounds": 4, "lr": 3e-5}\n')
    cfg = resolve_config(load_config_file(py), {"rounds": 7})
    assert (cfg.data.task, cfg.federation.rounds, cfg.client.lr, cfg.seed) == ("mrpc", 7, 3e-5, 0)
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"algorithm": "fedprox", "mu": 1, "critical_layer": None}))
    cfg = resolve_config(load_config_file(js))
    assert cfg.client.mu == 1.0 and isinstance(cfg.client.mu, float)
    assert cfg.model.critical_layer is None
    assert cfg.prox_mu == 1.0


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"algorithm": "fedsplit"}, "unknown algorithm"),
        ({"partition": "zipf"}, "unknown partition"),
        ({"quantize": "int8"}, "unknown quantize"),
        ({"clients": 0}, "--clients must be at least 1"),
        ({"clients": 3, "clients_per_round": 4}, "--clients-per-round must be in 1..3"),
        ({"critical_layer": -1}, "--critical-layer"),
        ({"data_dir": "/nonexistent/dir"}, "data dir"),
        ({"rounds": 0}, "--rounds"),
        ({"lr": -1.0}, "--lr"),
        ({"bogus": 1}, "unknown setting"),
        ({"rounds": "3"}, "must be int"),
        ({"rounds": True}, "must be int"),
        ({"packing": 1}, "must be bool"),
        ({"cpu_devices": 0}, "--cpu-devices must be at least 1"),
        ({"cpu_devices": 1.5}, "must be int"),
        ({"attention": "flash"}, "unknown attention"),
        ({"keep_checkpoints": 0}, "--keep-checkpoints must be at least 1"),
        ({"entity_types": "PER,,LOC"}, "--entity-types 'PER,,LOC': '' is not an entity type"),
        ({"entity_types": "B-PER,LOC"}, "'B-PER' is not an entity type; pass TYPE1,TYPE2"),
        ({"entity_types": "O,LOC"}, "'O' is not an entity type"),
        ({"entity_types": "new york"}, "'new york' is not an entity type"),
        ({"entity_types": "LOC,PER,LOC"}, "--entity-types names 'LOC' twice"),
        ({"layer_schedule": "fedbfpt"}, "unknown layer_schedule"),
        ({"server_tau": 0.1}, "--server-tau is for the adaptive servers"),
        ({"algorithm": "fedadam", "server_tau": -1.0}, "--server-tau must be a number > 0"),
        ({"cycle_factor": 3}, "--cycle-factor 3 needs --layer-schedule fedbt"),
        ({"layer_schedule": "fedbt", "cycle_factor": 0}, "--cycle-factor must be at least 1"),
        (
            {"layer_schedule": "fedbt", "lora_rank": 4},
            "trains whole layers, not LoRA adapters (--lora-rank 4): drop --lora-rank",
        ),
        ({"client_optimizer": "lamb"}, "unknown client_optimizer"),
        ({"lr_schedule": "cosine"}, "unknown lr_schedule"),
        ({"warmup_ratio": 0.06}, "--warmup-ratio 0.06 needs --lr-schedule linear"),
        ({"lr_schedule": "linear", "warmup_ratio": 1.0}, "--warmup-ratio must be in [0, 1)"),
        ({"client_clip_norm": 0.0}, "--client-clip-norm must be a number > 0"),
    ],
)
def test_bad_values_are_one_line_user_errors(values: dict, needle: str) -> None:
    with pytest.raises(UserError) as err:
        resolve_config(overrides=values)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_entity_types_are_read_sorted_and_none_when_unset() -> None:
    given = resolve_config(overrides={"entity_types": " PER, LOC,ORG"})
    assert given.data.entity_type_list() == ("LOC", "ORG", "PER")
    assert ExperimentConfig().data.entity_type_list() is None


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_config_file(tmp_path / "missing.py")
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(UserError, match="get_config"):
        load_config_file(tmp_path / "a.py")
    (tmp_path / "b.json").write_text("{nope")
    with pytest.raises(UserError, match="not valid JSON"):
        load_config_file(tmp_path / "b.json")
    (tmp_path / "c.yaml").write_text("a: 1")
    with pytest.raises(UserError, match=r"\.py or \.json"):
        load_config_file(tmp_path / "c.yaml")


@pytest.mark.parametrize(("num_layers", "want"), [(12, 6), (6, 3), (24, 12), (2, 1), (1, 0)])
def test_default_critical_layer_is_half_of_any_models_layers(num_layers: int, want: int) -> None:
    """bert-base (12), MiniLM-L6 (6), bert-large (24): the default stays FedSplitBERT, never
    silently every layer (plain FedAvg) on a shallower model."""
    assert validate_critical_layer(resolve_config(), num_layers) == want


@pytest.mark.parametrize(
    ("text", "want"), [("half", "half"), ("HALF", "half"), ("L", None), ("all", None), ("3", 3)]
)
def test_critical_layer_words_in_flags_and_files(tmp_path: Path, text: str, want: object) -> None:
    from fedjax_split import train

    assert train.config_from_args(["--critical-layer", text]).model.critical_layer == want
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"critical_layer": text}))
    assert resolve_config(load_config_file(js)).model.critical_layer == want


def test_a_bad_critical_layer_word_is_one_line(tmp_path: Path) -> None:
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"critical_layer": "third"}))
    with pytest.raises(UserError, match="critical_layer.*'half' or 'L'"):
        resolve_config(load_config_file(js))


def test_critical_layer_against_model_depth() -> None:
    assert validate_critical_layer(ExperimentConfig.of(critical_layer=None), 6) == 6
    assert validate_critical_layer(ExperimentConfig.of(critical_layer=0), 6) == 0
    assert validate_critical_layer(ExperimentConfig.of(critical_layer=12), 12) == 12
    with pytest.raises(UserError, match=r"outside 0\.\.6"):
        validate_critical_layer(ExperimentConfig.of(critical_layer=7), 6)


def test_trajectory_mismatch_ignores_bookkeeping() -> None:
    saved = ExperimentConfig.of(rounds=4).to_dict()
    assert trajectory_mismatch(saved, ExperimentConfig.of(rounds=8, resume=True)) == []
    # clients dealt to more devices train the same models (tests/test_rounds.py)
    assert trajectory_mismatch(saved, ExperimentConfig.of(cpu_devices=1, chunk_size=1)) == []
    # another attention kernel computes the same attention (a GPU run may resume on a CPU)
    assert trajectory_mismatch(saved, ExperimentConfig.of(attention="cudnn")) == []
    assert trajectory_mismatch(saved, ExperimentConfig.of(lr=1e-4, seed=2)) == ["lr", "seed"]
    # packing and bucketing change the batches, so a run cannot switch them on resume
    assert trajectory_mismatch(saved, ExperimentConfig.of(packing=False)) == ["packing"]
    assert trajectory_mismatch(saved, ExperimentConfig.of(bucketing=True)) == ["bucketing"]
    # a run saved before the client optimiser flags trained AdamW at a constant rate, unclipped
    old = {k: v for k, v in saved.items() if k not in ("client_optimizer", "lr_schedule",
                                                       "warmup_ratio", "client_clip_norm")}
    assert trajectory_mismatch(old, ExperimentConfig()) == []
    sgd = ExperimentConfig.of(client_optimizer="sgd", lr_schedule="linear", client_clip_norm=1.0)
    assert trajectory_mismatch(old, sgd) == ["client_clip_norm", "client_optimizer",
                                             "lr_schedule"]  # fmt: skip
    sequential = ExperimentConfig.of(paper_fill="sequential")
    assert trajectory_mismatch(saved, sequential) == ["paper_fill"]


def test_a_resume_runs_the_server_settings_the_run_started_with() -> None:
    """config.json saves the server lr and tau the flags resolved to; one written before the
    adaptive servers' defaults were tuned (no `server_settings`, --server-lr unset) ran lr 1e-3,
    tau 1e-3: resuming it at today's default is refused, naming the flags that continue it."""
    today = ExperimentConfig.of(algorithm="fedadam")
    assert saved_dict(today)["server_settings"] == {"server_lr": 1e-2, "server_tau": 1e-3}
    assert trajectory_mismatch(saved_dict(today), today) == []
    old = ExperimentConfig.of(algorithm="fedadam").to_dict()  # as before: no server_settings
    assert trajectory_mismatch(old, today) == [
        "the server it ran: --server-lr 0.001 --server-tau 0.001"]  # fmt: skip
    assert trajectory_mismatch(old, ExperimentConfig.of(algorithm="fedadam", server_lr=1e-3,
                                                     server_tau=1e-3)) == []  # fmt: skip
    # an explicit flag equal to today's default is the same run
    explicit = ExperimentConfig.of(algorithm="fedadam", server_lr=1e-2)
    assert trajectory_mismatch(saved_dict(today), explicit) == []
    # FedAvg's default never changed; another tau is another run
    assert trajectory_mismatch(ExperimentConfig().to_dict(), ExperimentConfig()) == []
    assert trajectory_mismatch(saved_dict(today), ExperimentConfig.of(
        algorithm="fedadam", server_tau=1e-4)) == ["the server it ran: --server-lr 0.01 "
                                                   "--server-tau 0.001"]  # fmt: skip


def _args_of(path: Path) -> list[str | None]:
    """The ARGs a shipped config takes, from its one-line error listing them; [None] if none."""
    params = inspect.signature(runpy.run_path(str(path))["get_config"]).parameters
    if not params:
        return [None]
    with pytest.raises(UserError, match="takes an argument"):
        load_config_file(path)
    with pytest.raises(UserError) as err:
        load_config_file(f"{path}:no-such-arg")
    message = str(err.value)
    assert "no-such-arg" in message and "\n" not in message and "pass one of: " in message
    return message.split("pass one of: ")[1].split(", ")


def _documented_commands(path: Path) -> list[list[str]]:
    """The `python -m fedjax_split.train` commands of a config's docstring, as flags."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = [x.strip() for x in doc.splitlines()]
    runs = [shlex.split(x, comments=True) for x in lines if x.startswith("python -m")]
    return [cmd[3:] for cmd in runs if cmd[:3] == ["python", "-m", "fedjax_split.train"]]


def test_every_shipped_config_and_arg_resolves_and_states_only_what_differs() -> None:
    files = sorted(CONFIGS.glob("*.py"))
    assert files, "configs/ holds no config files"
    defaults = ExperimentConfig().to_dict()
    for f in files:
        documented = " ".join(" ".join(c) for c in _documented_commands(f))
        same = set(defaults)  # the settings every ARG of the file leaves at their defaults
        for arg in _args_of(f):
            spec = f"configs/{f.name}" + ("" if arg is None else f":{arg}")
            values = load_config_file(CONFIGS.parent / spec)
            assert resolve_config(values).federation.rounds >= 1
            same &= {k for k, v in values.items() if v == defaults[k]}
            assert f"--config {spec} " in documented, f"{spec}: no run command in its docstring"
        assert not same, f"{f.name} repeats the defaults of {sorted(same)}"


def test_every_command_in_a_config_docstring_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedjax_split import train

    monkeypatch.chdir(CONFIGS.parent)  # the commands name configs/ from the repository root
    commands = [c for f in sorted(CONFIGS.glob("*.py")) for c in _documented_commands(f)]
    assert len(commands) > 50
    for cmd in commands:
        cmd = [x.replace("$c", "4") for x in cmd]  # Table IV's loop over c
        assert train.config_from_args(cmd).config == cmd[cmd.index("--config") + 1]


def test_choices_mirror_the_models_own() -> None:
    """The sections keep their own copies so that parsing flags imports no jax; they must agree."""
    from fedjax_split.models import bert_config as model
    from fedjax_split.run import data_section, runtime_sections, training_sections

    assert runtime_sections.DTYPES == model.COMPUTE_DTYPES
    assert runtime_sections.ATTENTIONS == model.ATTENTION_IMPLEMENTATIONS
    from fedjax_split.data import partition

    assert data_section.PARTITIONS == partition.SCHEMES
    assert data_section.PAPER_FILLS == partition.FILLS
    from fedjax_split.fed import client

    assert training_sections.CLIENT_OPTIMIZERS == client.CLIENT_OPTIMIZERS
    assert training_sections.LR_SCHEDULES == client.LR_SCHEDULES


def test_site_data_makes_the_sites_the_clients_and_refuses_pool_settings(tmp_path: Path) -> None:
    from fedjax_split.run.sites import NODE_SITES, site_dirs

    dirs = [tmp_path / f"s{k}" for k in range(4)]
    for d in dirs:
        d.mkdir()
    listed = ",".join(map(str, dirs))
    config = resolve_config(overrides={"site_data": listed})
    assert config.federation.clients == 4 and site_dirs(config) == dirs  # no --clients: a site each
    assert resolve_config({"site_data": listed}, {"clients": 4}).federation.clients == 4
    # real sites: the server and the nodes know the count from --clients, each node its dir
    real = resolve_config(overrides={"site_data": NODE_SITES, "clients": 5})
    assert real.federation.clients == 5 and site_dirs(real) == []
    assert "site_data" not in trajectory_mismatch({"site_data": listed}, real)
    bad = [
        ({"clients": 3}, "--clients 3 but --site-data names 4 sites"),
        ({"partition": "iid"}, "--partition iid with --site-data"),
        ({"alpha": 0.1}, "--alpha 0.1 with --site-data"),
        ({"paper_fill": "sequential"}, "--paper-fill sequential with --site-data"),
        ({"max_examples": 10}, "--max-examples 10 with --site-data"),
        ({"data_dir": str(tmp_path)}, f"--data-dir {tmp_path} with --site-data"),
        ({"site_data": f"{dirs[0]},,{dirs[1]}"}, "has an empty entry"),
        ({"site_data": f"{dirs[0]},{tmp_path / 'nope'}"}, "site 1's directory"),
        ({"site_data": f"{dirs[0]},{dirs[1]}/../s0"}, "twice (sites 0 and 1)"),
        ({"site_data": NODE_SITES, "beta": 2.0}, "--beta 2 with --site-data"),
    ]
    for change, needle in bad:
        with pytest.raises(UserError) as err:
            resolve_config(overrides={"site_data": listed, **change})
        assert needle in str(err.value) and "\n" not in str(err.value), change


def test_fedbt_shares_the_whole_model_and_names_its_run_dir() -> None:
    """FedBT's one shared model: the default 'half' and 'L' become L, another c is an error;
    the default run directory says the schedule."""
    fedbt = {"layer_schedule": "fedbt"}
    assert validate_critical_layer(resolve_config(overrides=fedbt), 6) == 6
    for c in (None, 6):
        assert validate_critical_layer(resolve_config(overrides={**fedbt, "critical_layer": c}),
                                       6) == 6  # fmt: skip
    with pytest.raises(UserError, match=r"L = 6\), but --critical-layer 3 keeps .*; drop --crit"):
        validate_critical_layer(resolve_config(overrides={**fedbt, "critical_layer": 3}), 6)
    # 'half' is L: resumes agree
    assert resolve_config(overrides=fedbt).model.critical_layer is None
    assert resolve_config(overrides=fedbt).run_dir.name == "sst2_fedavg_fedbt_K3_s0"
    assert resolve_config(overrides={**fedbt, "cycle_factor": 2}).run_dir.name == (
        "sst2_fedavg_fedbt2_K3_s0")  # fmt: skip
    assert resolve_config().run_dir.name == "sst2_fedavg_chalf_K3_s0"
    assert resolve_config(overrides={"model_layers": 3}).run_dir.name == (
        "sst2_fedavg_chalf_l3_K3_s0")  # fmt: skip


# --aggregator trimmed-mean must cut at least one client at each end: floor(f M) >= 1
PLAIN_MEAN = "clients at each end, i.e. it is the plain unweighted mean: use "


@pytest.mark.parametrize(
    ("values", "want"),
    [
        # the defaults: M = 3, f = 0.1; 1/3 rounds up to 0.34, 1 / 0.1 = 10
        ({}, "floor(0.1 x 3) = 0 " + PLAIN_MEAN
         + "--trim-fraction 0.34 or more with 3 clients a round, or at least 10 clients a round"),
        # M = clients-per-round: 1/9 = 0.111.. up to 0.12
        ({"clients": 20, "clients_per_round": 9}, "floor(0.1 x 9) = 0 " + PLAIN_MEAN
         + "--trim-fraction 0.12 or more with 9 clients a round, or at least 10 clients a round"),
        # 0.3 x 3 = 0.9; 0.3 x 4 = 1.2
        ({"trim_fraction": 0.3}, "floor(0.3 x 3) = 0 " + PLAIN_MEAN
         + "--trim-fraction 0.34 or more with 3 clients a round, or at least 4 clients a round"),
        # 0.07 x 14 = 0.98, 0.07 x 15 = 1.05; 1/14 = 0.0714.. up to 0.072
        ({"clients": 14, "trim_fraction": 0.07}, "floor(0.07 x 14) = 0 " + PLAIN_MEAN
         + "--trim-fraction 0.072 or more with 14 clients a round, or at least 15 clients a round"),
        # in floats (1/49) x 49 = 0.9999999999999999, and the trimmed mean cuts floor of that: 0
        ({"clients": 49, "trim_fraction": 1 / 49}, "floor(0.0204082 x 49) = 0 " + PLAIN_MEAN
         + "--trim-fraction 0.021 or more with 49 clients a round, or at least 50 clients a round"),
        # a fraction of 0 never trims: only the fraction can fix it
        ({"clients": 5, "trim_fraction": 0.0}, "floor(0 x 5) = 0 " + PLAIN_MEAN
         + "--trim-fraction 0.2 or more with 5 clients a round"),
        # 2 clients: no fraction below 1/2 cuts one, so only more clients can fix it
        ({"clients": 2, "trim_fraction": 0.45}, "floor(0.45 x 2) = 0 " + PLAIN_MEAN
         + "at least 3 clients a round"),
        ({"clients": 2}, "floor(0.1 x 2) = 0 " + PLAIN_MEAN + "at least 10 clients a round"),
        ({"clients": 1, "trim_fraction": 0.0}, "floor(0 x 1) = 0 " + PLAIN_MEAN
         + "at least 3 clients a round and --trim-fraction 0.34 or more"),
    ],
)  # fmt: skip
def test_a_trimmed_mean_that_trims_nobody_is_refused(values: dict, want: str) -> None:
    with pytest.raises(UserError) as err:
        resolve_config(overrides={"aggregator": "trimmed-mean", **values})
    message = str(err.value)
    assert message == "--aggregator trimmed-mean cuts " + want
    assert "\n" not in message


def test_the_fixes_the_refusal_names_trim_and_are_the_least_that_do() -> None:
    trimmed = {"aggregator": "trimmed-mean"}
    # the paper's 3 clients: 0.34 trims (floor(1.02) = 1), 0.33 does not (floor(0.99) = 0)
    cut = resolve_config(overrides={**trimmed, "trim_fraction": 0.34})
    assert cut.privacy.trim_fraction == 0.34
    with pytest.raises(UserError, match="plain unweighted mean"):
        resolve_config(overrides={**trimmed, "trim_fraction": 0.33})
    # exactly 1/3 trims one of 3 too: (1/3) x 3 is 1.0 in floats
    resolve_config(overrides={**trimmed, "trim_fraction": 1 / 3})
    # the default 0.1: 10 clients a round trim one at each end, 9 do not
    assert resolve_config(overrides={**trimmed, "clients": 10}).federation.sampled_clients == 10
    resolve_config(overrides={**trimmed, "clients": 20, "clients_per_round": 10})
    with pytest.raises(UserError, match=r"floor\(0.1 x 9\)"):
        resolve_config(overrides={**trimmed, "clients": 20, "clients_per_round": 9})
    resolve_config(overrides={**trimmed, "clients": 50, "trim_fraction": 1 / 49})
    # the other rules take any number of clients; the fraction is for the trimmed mean only
    resolve_config(overrides={"aggregator": "median"})
    resolve_config(overrides={"trim_fraction": 0.0})
    # with DP the trimmed mean is refused for DP's reason, whatever it would trim
    with pytest.raises(UserError, match="with DP"):
        resolve_config(overrides={**trimmed, "dp_noise_multiplier": 0.1, "dp_clip": 1.0})


def test_train_and_flower_refuse_a_trimmed_mean_that_trims_nobody_alike() -> None:
    """The command lines of train and of the Flower federation, and the ServerApp's settings from
    the run config, all resolve through `resolve_config` and so refuse it the same."""

    from fedjax_split import flower, train
    from fedjax_split.deploy import protocol

    want = "--aggregator trimmed-mean cuts floor(0.1 x 3) = 0 "
    for parse in (train.config_from_args, lambda argv: flower.parse(argv)[0]):
        with pytest.raises(UserError) as err:
            parse(["--aggregator", "trimmed-mean"])
        assert str(err.value).startswith(want) and "\n" not in str(err.value)
        assert parse(["--aggregator", "trimmed-mean", "--clients", "10"]).privacy.aggregator == (
            "trimmed-mean")  # fmt: skip
    experiment = ExperimentConfig.of(aggregator="trimmed-mean").to_dict()
    run_config = {protocol.EXPERIMENT: json.dumps(experiment)}
    with pytest.raises(UserError) as err:
        resolve_config(overrides=protocol.experiment_values(run_config))
    assert str(err.value).startswith(want)


def _error(argv: list[str], num_layers: int | None = None) -> str:
    """The one-line error that `train`'s flags `argv` stop with (with `num_layers`: at the check
    against the model's depth, as the run makes it)."""
    with pytest.raises(UserError) as err:
        config = train.config_from_args(argv)
        if num_layers is not None:
            validate_critical_layer(config, num_layers)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_an_error_says_whether_a_value_came_from_a_flag_the_file_or_the_default(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "c.py"
    cfg.write_text("def get_config():\n    return {'clients': 0}\n")
    assert _error(["--clients", "0"]) == "--clients must be at least 1, got 0"  # typed: no more
    assert _error(["--config", str(cfg)]) == f"--clients must be at least 1, got 0 (from {cfg})"
    assert train.config_from_args(["--config", str(cfg), "--clients", "2"]).federation.clients == 2
    many = _error(["--clients-per-round", "5"])
    assert many.endswith("got 5; --clients 3 (the default) sets the clients"), many
    # FILE.py:ARG is named as given
    cfg.write_text("def get_config(k):\n    return {'clients': int(k)}\n")
    assert _error(["--config", f"{cfg}:0"]).endswith(f"got 0 (from {cfg}:0)")


def test_fedbt_after_a_file_that_sets_the_critical_layer_names_the_file_and_the_fix() -> None:
    """The offline preset sets critical_layer 3; with --layer-schedule fedbt the user never typed
    --critical-layer, so "drop --critical-layer" cannot help: --critical-layer L does."""
    preset = str(CONFIGS / "offline_rotten_tomatoes.py")
    err = _error(["--config", preset, "--layer-schedule", "fedbt"], num_layers=6)
    assert f"--critical-layer 3 (from {preset})" in err
    assert "pass --critical-layer L" in err and "drop --critical-layer" not in err
    fixed = train.config_from_args(["--config", preset, "--layer-schedule", "fedbt",
                                    "--critical-layer", "L"])  # fmt: skip
    assert validate_critical_layer(fixed, 6) == 6
    typed = _error(["--critical-layer", "3", "--layer-schedule", "fedbt"], num_layers=6)
    assert "--critical-layer 3 keeps" in typed and typed.endswith("drop --critical-layer "
                                                                  "(docs/fedbt.md)")  # fmt: skip


def test_a_files_value_that_must_go_is_overridden_by_a_flag_that_works(tmp_path: Path) -> None:
    cfg = tmp_path / "lora.json"
    cfg.write_text(json.dumps({"lora_rank": 4, "lora_alpha": 8.0}))
    err = _error(["--config", str(cfg), "--layer-schedule", "fedbt"])
    assert f"(--lora-rank 4 (from {cfg})): pass --lora-rank none (or remove lora_rank " in err
    # the fix it names works (and then lora_alpha, from the file too, is named the same way)
    err = _error(["--config", str(cfg), "--layer-schedule", "fedbt", "--lora-rank", "none"])
    assert err.startswith(f"--lora-alpha 8 (from {cfg}) needs --lora-rank R"), err


def test_where_values_came_from_is_not_a_setting() -> None:
    """`origins` is for messages: config.json and the Flower run config do not hold it, and two
    configs of the same values are equal wherever the values came from."""
    by_flag = train.config_from_args(["--clients", "2"])
    assert by_flag.origins["clients"] == "flag" and by_flag.origins["rounds"] == "default"
    assert "origins" not in by_flag.to_dict() and "origins" not in saved_dict(by_flag)
    assert by_flag == resolve_config({"clients": 2}) == ExperimentConfig.of(clients=2)
    assert "--origins" not in train.build_parser().format_help()
