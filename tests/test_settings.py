"""The settings schema: one flag per field with its help, typing of config-file values, choices,
resume checks; the same machinery for train's and pretrain's configs."""

from __future__ import annotations

import dataclasses

import pytest

from fedjax_split.errors import UserError
from fedjax_split.run.settings import Schema, setting


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
    assert "How many; unset means all. (default: None)" in text and "--no-flag" in text
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
