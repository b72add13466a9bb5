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
    Settings,
    as_given,
    choose,
    drop,
    load_config_file,
    setting,
    split_config_spec,
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
