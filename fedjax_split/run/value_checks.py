"""Checks of one setting's value, shared by train's and pretrain's configs so that each rule and
its message is written once: "--x must be <bound>, got <value> (from <where>)", a count of at
least 1, a positive number, an existing --data-dir, a valid regex.

The section that defines a setting calls them from its `check` (`run.settings.Section`). They
take the whole config only to quote a value as it was given: where it came from
(`run.settings.origin`) is the config's, not the section's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.run.settings import as_given, flag_name, index, origin, value_of


def got(config: Any, name: str) -> str:
    """A setting's value in an error, with where it came from: "0 (from configs/x.py)"."""
    return f"{value_of(config, name)}{origin(config, name)}"


def require(config: Any, name: str, ok: bool, bound: str) -> None:
    """A UserError "--name must be {bound}, got {value}" unless `ok`."""
    if not ok:
        raise UserError(f"{flag_name(name)} must be {bound}, got {got(config, name)}")


def at_least_one(config: Any, *names: str) -> None:
    """Counts of at least 1 (an unset one, None, passes)."""
    for name in names:
        value = value_of(config, name)
        require(config, name, value is None or value >= 1, "at least 1")


def _finite_above(value: Any, zero_ok: bool) -> bool:
    """Whether `value` is None or a finite number > 0 (>= 0 with `zero_ok`)."""
    return value is None or math.isfinite(value) and (value > 0 or zero_ok and value == 0)


def positive_number(config: Any, *names: str) -> None:
    """Finite numbers > 0, said "a positive number" (unset ones pass)."""
    for name in names:
        require(config, name, _finite_above(value_of(config, name), False), "a positive number")


def number_above_zero(config: Any, *names: str, zero_ok: bool = False) -> None:
    """Finite numbers > 0 (>= 0 with `zero_ok`), said "a number > 0" (unset ones pass)."""
    for name in names:
        bound = "a number >= 0" if zero_ok else "a number > 0"
        require(config, name, _finite_above(value_of(config, name), zero_ok), bound)


def non_negative(config: Any, *names: str) -> None:
    """Finite numbers >= 0, said ">= 0" (unset ones pass)."""
    for name in names:
        require(config, name, _finite_above(value_of(config, name), True), ">= 0")


def first_set(config: Any, names: Iterable[str]) -> str | None:
    """The first of `names` whose value is not its default, None if all are."""
    fields = index(type(config))
    return next((n for n in names if value_of(config, n) != fields[n][1].default), None)


def fits_positions(config: Any, positions: int) -> None:
    """--max-length within the model's position embeddings: a longer batch would look positions
    up past the table (JAX's gather fills them with NaN), and every client would diverge."""
    require(config, "max_length", value_of(config, "max_length") <= positions,
            f"at most the model's {positions} positions (its max_position_embeddings)")  # fmt: skip


def check_data_dir(config: Any) -> None:
    """--data-dir, where given, is an existing directory."""
    data_dir = config.data.data_dir
    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"data dir {data_dir!r}{origin(config, 'data_dir')} does not exist; "
                        "pass an existing --data-dir")  # fmt: skip


def check_regex(config: Any, name: str, fix: str = "") -> None:
    """Setting `name`, where given, is a Python regex; `fix`: words after the error's reason."""
    pattern = value_of(config, name)
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise UserError(f"{as_given(config, name)} is not a valid regex ({e}){fix}") from None
