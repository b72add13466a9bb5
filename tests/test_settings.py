"""The settings schema: one flag per field with its help, config files (`FILE.py:ARG`) and the
typing of their values, choices, resume checks; the same machinery for train's and pretrain's
configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fedjax_split.errors import UserError
from fedjax_split.run.settings import (
    OUTPUTS,
    Schema,
    Section,
    Settings,
    as_given,
    choose,
    drop,
    index,
    load_config_file,
    replaced,
    section,
    setting,
    split_config_spec,
    value_of,
)


@dataclasses.dataclass(frozen=True)
class Toy:
    name: str = setting("a", "A name to choose.", choices=("a", "b"))
    count: int | None = setting(None, "How many; unset means all.", metavar="N")
    rate: float = setting(0.5, "A rate for the toy.")
    flag: bool = setting(False, "Whether the toy flies.")
    config: str | None = setting(None, "Config file of the toy.", metavar="FILE")
    output_dir: str | None = setting(None, "Where the toy writes.", metavar="DIR")
    colour: str = setting("red", lambda: "Colour, from a registry read when the flags are built.")


SCHEMA = Schema(Toy, non_trajectory=("output_dir", "config"))


def test_flags_from_the_fields(tmp_path) -> None:
    parser = SCHEMA.build_parser("toy", "A toy.")
    assert {a.dest for a in parser._actions} - {"help"} == set(SCHEMA.fields)
    text = parser.format_help()
    assert "How many; unset means all." in text and "--no-flag" in text
    assert "(default: 0.5)" in text and "(default: None)" not in text  # unset: said in words
    assert SCHEMA.help("colour") == "Colour, from a registry read when the flags are built."
    assert "from a registry" in text
    assert SCHEMA.from_args(parser, ["--count", "all", "--flag"]) == Toy(count=None, flag=True)
    assert SCHEMA.from_args(parser, ["--count", "3", "--rate", "1"]) == Toy(count=3, rate=1.0)
    cfg = tmp_path / "c.json"
    cfg.write_text('{"rate": 2, "name": "b"}')
    got = SCHEMA.from_args(parser, ["--config", str(cfg), "--name", "a"])
    assert (got.rate, got.name) == (2.0, "a")  # ints become floats; flags win over the file
    with pytest.raises(SystemExit) as e:
        SCHEMA.from_args(parser, ["--count", "x"])
    assert e.value.code == 2


def test_typing_choices_and_resume_checks() -> None:
    with pytest.raises(UserError, match="'count' must be int"):
        SCHEMA.resolve({"count": 1.5})
    with pytest.raises(UserError, match="'flag' must be bool"):
        SCHEMA.resolve({"flag": 1})
    with pytest.raises(UserError, match="unknown setting 'size'"):
        SCHEMA.resolve({"size": 1})
    with pytest.raises(UserError, match="cannot be null"):
        SCHEMA.resolve({"rate": None})
    with pytest.raises(UserError, match="pass --name one of: a, b"):
        SCHEMA.check_choices(Toy(name="c"))
    saved = dataclasses.asdict(Toy(count=2))
    assert SCHEMA.trajectory_mismatch(saved, Toy(count=2, output_dir="x")) == []
    assert SCHEMA.trajectory_mismatch(saved, Toy(count=3, flag=True)) == ["count", "flag"]


def test_a_config_spec_splits_at_the_last_py_colon(tmp_path) -> None:
    assert split_config_spec("configs/t.py") == (Path("configs/t.py"), None)
    assert split_config_spec("configs/t.py:mrpc") == (Path("configs/t.py"), "mrpc")
    assert split_config_spec("a:b/c.py:k10") == (Path("a:b/c.py"), "k10")  # ':' in the path
    assert split_config_spec("a.py:b/c.py:x:y") == (Path("a.py:b/c.py"), "x:y")  # ':' in ARG
    assert split_config_spec("c.json") == (Path("c.json"), None)
    odd = tmp_path / "a.py:b.py"  # an existing file is itself, whatever its name holds
    odd.write_text("")
    assert split_config_spec(odd) == (odd, None)


PARAMETERISED = '''
from fedjax_split.run.settings import choose

RATES = {"slow": 0.1, "fast": 2.0}


def get_config(speed):
    return {"rate": RATES[choose(speed, RATES, "speed")]}
'''


def test_file_py_arg_calls_get_config_with_arg(tmp_path) -> None:
    folder = tmp_path / "with:colon"  # the path holds ':' before `.py`
    folder.mkdir()
    cfg = folder / "c.py"
    cfg.write_text(PARAMETERISED)
    assert load_config_file(f"{cfg}:fast") == {"rate": 2.0}
    parser = SCHEMA.build_parser("toy", "A toy.")
    got = SCHEMA.from_args(parser, ["--config", f"{cfg}:slow"])
    assert (got.rate, got.config) == (0.1, f"{cfg}:slow")  # the config is kept as given
    optional = tmp_path / "o.py"
    optional.write_text("def get_config(arg=None):\n    return {'name': arg or 'b'}\n")
    assert load_config_file(optional) == {"name": "b"}
    assert load_config_file(f"{optional}:a") == {"name": "a"}


def test_config_arg_mistakes_are_one_line_user_errors(tmp_path) -> None:
    cfg = tmp_path / "c.py"
    cfg.write_text(PARAMETERISED)
    plain = tmp_path / "p.py"
    plain.write_text("def get_config():\n    return {}\n")
    broken = tmp_path / "b.py"
    broken.write_text("def get_config(arg):\n    return {'rate': 1 / 0}\n")
    refusing = tmp_path / "r.py"
    refusing.write_text(
        "from fedjax_split.errors import UserError\n\n\n"
        "def get_config():\n    raise UserError('not today; try tomorrow')\n"
    )
    cases = [
        (str(cfg), f"takes an argument (speed); pass --config {cfg}:SPEED"),
        (f"{cfg}:medium", "unknown speed 'medium'; pass one of: slow, fast"),
        (f"{cfg}:", "empty argument"),
        (f"{plain}:x", f"takes no argument, got 'x'; pass --config {plain}"),
        (f"{broken}:x", "failed in get_config: ZeroDivisionError"),
        (str(refusing), f"config {str(refusing)!r}: not today; try tomorrow"),
        (f"{tmp_path / 'missing.py'}:x", "missing.py' not found"),
    ]
    for spec, needle in cases:
        with pytest.raises(UserError) as err:
            load_config_file(spec)
        assert needle in str(err.value) and "\n" not in str(err.value), spec
    with pytest.raises(UserError, match="unknown size 'x'; pass one of: a, b"):
        choose("x", ("a", "b"), "size")
    assert choose("b", {"a": 1, "b": 2}, "size") == "b"


@dataclasses.dataclass(frozen=True)
class Kept(Settings):
    count: int | None = setting(None, "How many; unset means all.", metavar="N", group=OUTPUTS)
    rate: float = setting(0.5, "A rate.", metavar="R")
    flag: bool = setting(False, "Whether it flies.")
    pattern: str = setting("a.b", "A regex.", metavar="REGEX")
    config: str | None = setting(None, "Config file.", metavar="FILE")


KEPT = Schema(Kept)


def test_each_value_keeps_where_it_came_from(tmp_path) -> None:
    """A flag, the --config file as given, or the default; what errors quote and how they fix."""
    cfg = tmp_path / "k.json"
    cfg.write_text('{"count": 3, "flag": true, "pattern": "x y", "rate": 2}')
    got = KEPT.resolve(load_config_file(cfg), {"config": str(cfg), "rate": 1.0})
    assert dict(got.origins) == {"count": str(cfg), "rate": "flag", "flag": str(cfg),
                                 "pattern": str(cfg), "config": "flag"}  # fmt: skip
    assert as_given(got, "rate") == "--rate 1"  # typed: said as typed
    assert as_given(got, "count") == f"--count 3 (from {cfg})"
    assert as_given(got, "flag") == f"--flag (from {cfg})"
    assert as_given(got, "pattern") == f"--pattern 'x y' (from {cfg})"  # as a shell reads it
    assert drop(got, "rate") == "drop --rate"
    assert drop(got, "flag") == f"pass --no-flag (or remove flag from {cfg})"
    assert drop(got, "count") == f"remove count from {cfg}"  # a None default: the caller says
    want = f"pass --count all (or remove count from {cfg})"  # the flag that unsets, if one does
    assert drop(got, "count", unset="--count all") == want
    assert as_given(KEPT.resolve(), "rate") == "--rate 0.5 (the default)"
    assert as_given(Kept(rate=2.0), "rate") == "--rate 2"  # built in code: no origin to say
    assert got == Kept(count=3, rate=1.0, flag=True, pattern="x y", config=str(cfg))
    assert "origins" not in got.to_dict() and set(KEPT.fields) == set(got.to_dict())
    parser = KEPT.build_parser("kept", "Kept.")
    assert parser.groups["outputs"]._group_actions[0].dest == "count"  # its --help section


@dataclasses.dataclass(frozen=True)
class Engine(Section):
    name: str = setting("v8", "The engine.", key="engine", choices=("v8", "v6"))
    cylinders: int = setting(8, "Cylinders.", metavar="N")


@dataclasses.dataclass(frozen=True)
class Trip(Section):
    rounds: int = setting(3, "Laps.", metavar="N", group=OUTPUTS)
    config_only: float = 0.0  # not a setting: no flag, not saved


@dataclasses.dataclass(frozen=True)
class Car(Settings):
    seed: int = setting(0, "Seed.", metavar="SEED")
    config: str | None = setting(None, "Config file.", metavar="FILE")
    engine: Engine = section(Engine)
    trip: Trip = section(Trip)


CAR = Schema(Car, non_trajectory=("config",))


def test_sections_keep_flat_names_for_flags_files_and_saved_configs(tmp_path) -> None:
    """Code reads `car.engine.cylinders`; a user, a config file and config.json say
    `--cylinders`, and a section's field may answer to another flat name (`--engine`)."""
    assert list(index(Car)) == ["seed", "config", "engine", "cylinders", "rounds"]
    cfg = tmp_path / "car.json"
    cfg.write_text('{"cylinders": 6, "engine": "v6"}')
    parser = CAR.build_parser("car", "A car.")
    got = CAR.from_args(parser, ["--config", str(cfg), "--rounds", "5", "--seed", "2"])
    assert (got.engine.name, got.engine.cylinders, got.trip.rounds, got.seed) == ("v6", 6, 5, 2)
    assert got.to_dict() == {"seed": 2, "config": str(cfg), "engine": "v6", "cylinders": 6,
                             "rounds": 5}  # fmt: skip
    assert got.origins["cylinders"] == str(cfg) and got.origins["rounds"] == "flag"
    assert as_given(got, "cylinders") == f"--cylinders 6 (from {cfg})"
    assert parser.groups["outputs"]._group_actions[0].dest == "rounds"
    assert Car.of(**got.to_dict()) == got  # a saved config builds the same config back
    assert value_of(got, "engine") == "v6" and value_of(got, "seed") == 2
    wrong = r"unknown engine 'v12' \(from the config file\); pass --engine one of: v8, v6"
    with pytest.raises(UserError, match=wrong):
        CAR.resolve({"engine": "v12"}, validate=CAR.check_choices)
    with pytest.raises(UserError, match="unknown setting 'name'"):  # the field's own name
        CAR.resolve({"name": "v6"})
    saved = Car().to_dict()
    assert CAR.trajectory_mismatch(saved, Car.of(cylinders=4, config="x")) == ["cylinders"]


def test_replaced_changes_settings_by_flat_name_in_their_sections() -> None:
    car = CAR.resolve(overrides={"rounds": 7})
    new = replaced(car, cylinders=4, engine="v6", seed=9)
    assert (new.engine, new.trip.rounds, new.seed) == (Engine("v6", 4), 7, 9)
    assert new.origins == car.origins and car.engine == Engine()  # the old one is unchanged
    with pytest.raises(TypeError, match="Car has no setting 'wheels'"):
        replaced(car, wheels=3)
    with pytest.raises(TypeError, match="Car has no setting 'config_only'"):
        Car.of(config_only=1.0)


def test_two_settings_with_one_flat_name_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Twice(Settings):
        cylinders: int = setting(4, "Again.")
        engine: Engine = section(Engine)

    with pytest.raises(ValueError, match="two settings named 'cylinders'"):
        index(Twice)
