"""Settings schemas: a frozen dataclass of `Section`s whose fields say their help, choices and
metavar, and everything generated from it once, for every command that has one (`train`'s
ExperimentConfig, `pretrain`'s PretrainConfig): the command-line flags, config files and their
typing, choice checks, and which settings a `--resume` must keep. Sections are for the code;
a user, a config file and config.json name each setting by its flat name (`index`).

Resolution order (later wins): dataclass defaults -> `--config FILE` -> flags given explicitly on
the command line. A config file is either a Python file defining `get_config() -> dict`
(big_vision style, with the run command in its docstring; `--config FILE.py:ARG` calls
`get_config(ARG)`, so one file holds several configs that differ by one value) or a JSON object.
Every problem a user can cause is a one-line `UserError`; one that quotes a setting's value says
where it came from (`as_given`: a flag, the config file, the default) and gives a fix that works
from there (`drop`): a user cannot drop a flag they never typed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import runpy
import shlex
import sys
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError

# The --help sections, in this order: what a user decides, one section each. A setting names its
# own (`setting(group=...)`); --config and --help stay in the general section above them.
TASK = "task and data"
MODEL = "model and method"
FEDERATION = "federation"
PRIVACY = "privacy and robustness"
DEPLOYMENT = "deployment"
PERFORMANCE = "performance"
OUTPUTS = "outputs"
GROUPS = (TASK, MODEL, FEDERATION, PRIVACY, DEPLOYMENT, PERFORMANCE, OUTPUTS)


def setting(
    default: Any,
    help: str | Callable[[], str],
    *,
    group: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    key: str | None = None,
) -> Any:
    """A setting and what its flag needs (help text, --help section, allowed values, metavar):
    the one place each is written; `Schema` generates flags, typing and choice checks from it. A
    callable help is called when the flags are built, for text generated from a registry that is
    costly to import. `group` is one of `GROUPS` (None: the general section). `parse` reads a
    value written as text (a flag, or a string in a config file) where the annotation's type
    alone cannot, e.g. an integer or a word such as 'half'; it raises
    argparse.ArgumentTypeError for a bad value. `key`: the setting's flat name (its flag, its
    key in config files and config.json) where it differs from the field's name in its section
    (`--model` is `config.model.name`)."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}; use one of {GROUPS}")
    metadata = {
        "help": help, "group": group, "choices": choices, "metavar": metavar, "parse": parse,
        "key": key,
    }  # fmt: skip
    return dataclasses.field(default=default, metadata=metadata)


FLAG, DEFAULT = "flag", "default"  # where a value came from, besides a config file's name


@dataclasses.dataclass(frozen=True)
class Section:
    """A section of a config: the settings of one concern (the model, the data, privacy...),
    which the code that needs them takes alone. Its settings keep flat names: a flag, a config
    file's key and config.json say `--lr`, not the section."""

    def check(self, config: Any) -> None:
        """A one-line UserError for a value of this section's own that no run can take (beyond
        its choices); `config`, the whole config, only says where values came from. Rules
        between sections are the config's own."""


def section(cls: type[Section]) -> Any:
    """A config's field holding section `cls` (its defaults unless given)."""
    return dataclasses.field(default_factory=cls, metadata={"section": True})


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of a settings dataclass: `Section`s and top-level settings. `origins` says where each
    value came from (`FLAG`, `DEFAULT`, or the --config spec as given), keyed by flat name,
    filled by `Schema.resolve` for the errors (`as_given`, `drop`); not a setting: no flag, not
    saved, not compared. A config built in code has none."""

    origins: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, **settings: Any) -> Any:
        """A config from settings given by flat name (`ExperimentConfig.of(lr=1e-4)`), the
        defaults for the others; unchecked (`Schema.resolve` checks)."""
        return build(cls, settings)

    def to_dict(self) -> dict[str, Any]:
        """The settings by flat name, as config.json and the Flower run config hold them."""
        return {name: value_of(self, name) for name in index(type(self))}


@functools.cache
def index(cls: type) -> dict[str, tuple[str | None, dataclasses.Field]]:
    """A settings class's settings by flat name: (the section's attribute, or None for a
    top-level setting; the field)."""
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        members = ([(f.name, g) for g in dataclasses.fields(hints[f.name])]
                   if f.metadata.get("section") else [(None, f)])  # fmt: skip
        for where, g in members:
            if "help" not in g.metadata:
                continue
            name = g.metadata.get("key") or g.name
            if name in out:
                raise ValueError(f"{cls.__name__}: two settings named {name!r}")
            out[name] = (where, g)
    return out


def value_of(config: Any, name: str) -> Any:
    """Setting `name` (its flat name) of `config`, wherever its section keeps it."""
    where, f = index(type(config))[name]
    return getattr(config if where is None else getattr(config, where), f.name)


def _by_section(cls: type, values: Mapping[str, Any]) -> tuple[dict, dict[str, dict]]:
    """Flat-named `values` as (top-level fields, {section: its fields}) of settings class `cls`."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, given in values.items():
        if name not in index(cls):
            raise TypeError(f"{cls.__name__} has no setting {name!r}")
        where, f = index(cls)[name]
        (top if where is None else sections.setdefault(where, {}))[f.name] = given
    return top, sections


def replaced(config: Any, /, **changes: Any) -> Any:
    """`config` with settings changed, given by flat name (`replaced(config, lr=1e-4)`);
    positional-only, since `config` (the config file) is itself a setting to change."""
    top, sections = _by_section(type(config), changes)
    for where, fields in sections.items():
        top[where] = dataclasses.replace(getattr(config, where), **fields)
    return dataclasses.replace(config, **top)


def build(cls: type, values: Mapping[str, Any], **extra: Any) -> Any:
    """A settings class from flat-named values (the defaults for the others); `extra`: its
    fields that are not settings (`origins`)."""
    top, sections = _by_section(cls, values)
    hints = typing.get_type_hints(cls)
    for where, fields in sections.items():
        top[where] = hints[where](**fields)
    return cls(**top, **extra)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def origin(config: Any, name: str) -> str:
    """Where setting `name`'s value came from, as words to put after it: " (from FILE)",
    " (the default)", or "" for a flag (the user typed it) or a config built in code."""
    where = getattr(config, "origins", {}).get(name)
    if where in (None, FLAG):
        return ""
    return " (the default)" if where == DEFAULT else f" (from {where})"


def flag_text(name: str, value: Any) -> str:
    """The flag that sets `name` to `value` (not None), as a user types it: `--lora-rank 8`,
    `--freeze 'embeddings\\.'`, `--packing`, `--no-packing`."""
    if isinstance(value, bool):
        return flag_name(name) if value else "--no-" + flag_name(name)[2:]
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{flag_name(name)} {shlex.quote(text)}"


def as_given(config: Any, name: str) -> str:
    """Setting `name` as it was set, with where from: `--critical-layer 3 (from configs/x.py)`,
    `--clients 0`; what every error that quotes a setting's value shows."""
    given = value_of(config, name)
    shown = flag_name(name) if given is None else flag_text(name, given)
    return shown + origin(config, name)


def drop(config: Any, name: str, unset: str | None = None) -> str:
    """The fix that takes setting `name` back to its default, whoever set it: "drop --x" for a
    flag; for a config file's value, the flag that overrides it (`unset`: its text, else the
    default's flag where that has one) or its line removed from the file."""
    where = getattr(config, "origins", {}).get(name, FLAG)
    if where in (FLAG, DEFAULT):
        return f"drop {flag_name(name)}"
    default = index(type(config))[name][1].default
    if unset is None and default is not None:
        unset = flag_text(name, default)
    remove = f"remove {name} from {where}"
    return f"pass {unset} (or {remove})" if unset else remove


def optional_int(text: str) -> int | None:
    """Integers, with 'none'/'all'/'L' meaning "not set" (all clients, all layers, no limit)."""
    if text.lower() in ("none", "all", "l"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


class Parser(argparse.ArgumentParser):
    """A command's parser: errors on one line, and the --help sections of `GROUPS` in their
    order (`groups`; empty ones are not shown), for a command's own flags to join."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = {title: self.add_argument_group(title) for title in GROUPS}

    def error(self, message: str) -> typing.NoReturn:  # one line, exit 2, like every user error
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def split_config_spec(spec: str | Path) -> tuple[Path, str | None]:
    """`FILE.py:ARG` -> (FILE.py, ARG), big_vision's convention for one file holding several
    configs that differ by a value. ARG is what follows the last `.py:`, so the path itself may
    hold ':'; a spec that names an existing file as a whole is that file, with no ARG."""
    text = str(spec)
    cut = text.rfind(".py:")
    if cut < 0 or Path(text).is_file():
        return Path(text), None
    return Path(text[: cut + 3]), text[cut + 4 :]


def choose(arg: str, choices: Collection[str], what: str) -> str:
    """For a parameterised config's `get_config(arg)`: `arg` if it is one of `choices` (a dict's
    keys count), else a one-line UserError listing them."""
    if arg not in choices:
        raise UserError(f"unknown {what} {arg!r}; pass one of: {', '.join(choices)}")
    return arg


def _call_get_config(get_config: Any, path: Path, arg: str | None) -> Any:
    """get_config() or get_config(ARG), as the file's signature asks; a mismatch is the user's."""
    params = list(inspect.signature(get_config).parameters.values())
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [q for q in params if q.default is q.empty and q.kind not in variadic]
    if arg is None and required:
        name = required[0].name
        raise UserError(
            f"config file {str(path)!r} takes an argument ({name}); pass --config "
            f"{path}:{name.upper()} (its docstring lists the choices)"
        )
    if arg is not None and not params:
        raise UserError(
            f"config file {str(path)!r} takes no argument, got {arg!r}; pass --config {path}"
        )
    if arg == "":
        raise UserError(f"config file {str(path)!r} got an empty argument after ':'; name one")
    try:
        return get_config() if arg is None else get_config(arg)
    except UserError as e:
        spec = str(path) if arg is None else f"{path}:{arg}"
        raise UserError(f"config {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any error in user code is a user error
        raise UserError(
            f"config file {str(path)!r} failed in get_config: {type(e).__name__}: {e}"
        ) from None


def load_config_file(spec: str | Path) -> dict[str, Any]:
    """Read a `.py` (defining `get_config() -> dict`, or `get_config(arg) -> dict` named as
    `FILE.py:ARG`) or `.json` config file into a plain dict."""
    p, arg = split_config_spec(spec)
    if not p.is_file():
        raise UserError(f"config file {str(p)!r} not found; pass an existing --config file")
    if p.suffix == ".json":
        try:
            values = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(
                f"config file {str(p)!r} is not valid JSON ({e}); fix the file"
            ) from None
    elif p.suffix == ".py":
        try:
            namespace = runpy.run_path(str(p))
        except Exception as e:  # noqa: BLE001 - any error in user code is a user error
            raise UserError(
                f"config file {str(p)!r} failed to run: {type(e).__name__}: {e}"
            ) from None
        get_config = namespace.get("get_config")
        if not callable(get_config):
            raise UserError(
                f"config file {str(p)!r} defines no get_config(); add one returning a dict"
            )
        values = _call_get_config(get_config, p, arg)
    else:
        raise UserError(f"config file {str(p)!r} must end in .py or .json")
    if not isinstance(values, dict):
        raise UserError(f"config file {str(p)!r} must give a dict of settings, got {type(values)}")
    return dict(values)


class Schema:
    """What a settings dataclass `cls` generates; `non_trajectory`: settings that do not change
    a run's results (a `--resume` may change them)."""

    def __init__(self, cls: type, non_trajectory: Collection[str] = ()) -> None:
        self.cls = cls
        self.fields = {name: f for name, (_, f) in index(cls).items()}
        self.non_trajectory = frozenset(non_trajectory)
        hints = typing.get_type_hints(cls)
        self._hints = {
            name: typing.get_type_hints(hints[where])[f.name] if where else hints[f.name]
            for name, (where, f) in index(cls).items()
        }

    def value_type(self, name: str) -> type:
        """The type of a setting's values (int for `int | None`)."""
        hint = self._hints[name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if args else hint

    def nullable(self, name: str) -> bool:
        """Whether a setting may be None (unset)."""
        return type(None) in typing.get_args(self._hints[name])

    def coerce(self, name: str, value: Any) -> Any:
        """Type-check one setting from a config file (flags are already typed by argparse)."""
        if value is None:
            if self.nullable(name):
                return None
            raise UserError(f"setting {name!r} cannot be null; give a value or leave it out")
        parse = self.fields[name].metadata.get("parse")
        if parse is not None and isinstance(value, str):
            try:
                return parse(value)
            except argparse.ArgumentTypeError as e:
                raise UserError(f"setting {name!r}: {e}; fix the config") from None
        expected = self.value_type(name)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if expected is int and isinstance(value, bool) or not isinstance(value, expected):
            raise UserError(
                f"setting {name!r} must be {expected.__name__}, got {value!r}; fix the config"
            )
        return value

    def resolve(
        self,
        file_values: dict[str, Any] | None = None,
        overrides: dict[str, Any] | None = None,
        validate: Callable[[Any], None] | None = None,
    ) -> Any:
        """Defaults <- config-file values <- explicit overrides (typed), then `validate`. Each
        value's origin is kept (a `Settings` class): the file is the overrides' `config` as
        given, where there is one."""
        merged: dict[str, Any] = {}
        origins = dict.fromkeys(self.fields, DEFAULT)
        file = str((overrides or {}).get("config") or "the config file")
        for source, where in ((file_values or {}, file), (overrides or {}, FLAG)):
            for name, value in source.items():
                if name not in self.fields:
                    known = ", ".join(self.fields)
                    raise UserError(f"unknown setting {name!r}; known settings: {known}")
                merged[name] = self.coerce(name, value)
                origins[name] = where
        extra = {"origins": origins} if issubclass(self.cls, Settings) else {}
        config = build(self.cls, merged, **extra)
        if validate is not None:
            validate(config)
        return config

    def check_choices(self, config: Any) -> None:
        """UserError for a setting outside its choices."""
        for name, field in self.fields.items():
            choices = field.metadata["choices"]
            given = value_of(config, name)
            if choices and given not in choices:
                raise UserError(
                    f"unknown {name} {given!r}{origin(config, name)}; pass "
                    f"{flag_name(name)} one of: {', '.join(choices)}"
                )

    def help(self, name: str) -> str:
        """The help text of setting `name`."""
        text = self.fields[name].metadata["help"]
        return text() if callable(text) else text

    def build_parser(self, prog: str, description: str) -> Parser:
        """One flag per setting, in its --help section (--config first, in the general one):
        type from the annotation, 'L'/'all'/'none' for unset ints, --x/--no-x for booleans;
        only the flags given are returned."""
        p = Parser(
            prog=prog,
            description=description,
            usage="%(prog)s [--config FILE[:ARG]] [flags, by section below]",
            argument_default=argparse.SUPPRESS,
        )
        names = ["config"] if "config" in self.fields else []
        for name in names + [n for n in self.fields if n != "config"]:
            field = self.fields[name]
            meta, kind = field.metadata, self.value_type(name)
            kw: dict[str, Any] = {"metavar": meta["metavar"]}
            if meta["choices"]:  # checked by check_choices, so a bad value is a one-line error
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            if kind is bool:
                kw = {"action": argparse.BooleanOptionalAction}
            elif meta.get("parse") is not None:
                kw["type"] = meta["parse"]
            elif kind is int and self.nullable(name):
                kw["type"] = optional_int
            elif kind is not str:
                kw["type"] = kind
            # an unset default is said in the help's own words ("unset: ...", "default: L/2")
            default = "" if field.default is None else f" (default: {field.default})"
            where = p if meta.get("group") is None else p.groups[meta["group"]]
            where.add_argument(flag_name(name), help=self.help(name) + default, **kw)
        return p

    def from_args(self, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Any:
        """Parse flags and resolve them against the defaults and the --config file."""
        given = vars(parser.parse_args(argv))
        file_values = load_config_file(given["config"]) if "config" in given else {}
        return self.resolve(file_values, given)

    def trajectory_mismatch(self, saved: dict[str, Any], config: Any) -> list[str]:
        """Settings that differ from a saved run's and would change its results on --resume."""
        current = {name: value_of(config, name) for name in self.fields}
        return sorted(
            k
            for k in current
            if k not in self.non_trajectory and k in saved and saved[k] != current[k]
        )
