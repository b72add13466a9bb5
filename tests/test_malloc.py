"""fedjax_split.run.malloc: the malloc a process runs on, and the CLI's re-execution on tcmalloc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_fixtures import tcmalloc_installed

from fedjax_split.errors import UserError
from fedjax_split.run import malloc

ROOT = Path(__file__).resolve().parents[1]
GLIBC = "7f01-7f02 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
TC = "7f03-7f04 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n"
JE = "7f05-7f06 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"


def test_allocator_is_read_from_the_process_maps():
    assert malloc.allocator(GLIBC) == "system"
    assert malloc.allocator(GLIBC + TC) == "tcmalloc"
    assert malloc.allocator(JE + GLIBC) == "jemalloc"
    assert malloc.allocator() in {"system", "tcmalloc", "jemalloc"}


def test_search_dirs_start_with_this_architecture(monkeypatch) -> None:
    monkeypatch.setattr(malloc.sysconfig, "get_config_var", lambda name: "aarch64-linux-gnu")
    assert malloc.search_dirs()[0] == "/usr/lib/aarch64-linux-gnu"
    assert "/usr/lib/x86_64-linux-gnu" not in malloc.search_dirs()


def test_find_tcmalloc_prefers_the_minimal_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(malloc.ctypes.util, "find_library", lambda name: None)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert malloc.find_tcmalloc([str(a), str(b)]) is None
    (b / "libtcmalloc.so.4").write_bytes(b"")
    assert malloc.find_tcmalloc([str(a), str(b)]) == str(b / "libtcmalloc.so.4")
    (b / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert malloc.find_tcmalloc([str(a), str(b)]) == str(b / "libtcmalloc_minimal.so.4")
    (a / "libtcmalloc.so.4").write_bytes(b"")  # an earlier directory wins
    assert malloc.find_tcmalloc([str(a), str(b)]) == str(a / "libtcmalloc.so.4")


def test_find_tcmalloc_finds_what_ldconfig_knows() -> None:
    assert (malloc.find_tcmalloc() is not None) == tcmalloc_installed()


def test_should_preload_on_linux_with_the_system_malloc_and_nothing_preloaded():
    assert malloc.should_preload({}, "linux", "system")
    assert malloc.should_preload({malloc.ENV: "auto", "LD_PRELOAD": ""}, "linux", "system")


@pytest.mark.parametrize(
    "environ, platform, current",
    [
        ({}, "darwin", "unknown"),  # not Linux
        ({malloc.ENV: "system"}, "linux", "system"),  # opted out
        ({malloc._MARK: "1"}, "linux", "system"),  # re-executed once already
        ({"LD_PRELOAD": "/usr/lib/libasan.so.8"}, "linux", "system"),  # the user's preload
        ({}, "linux", "tcmalloc"),  # already on it
        ({}, "linux", "jemalloc"),  # someone chose another
    ],
)
def test_should_preload_leaves_the_process_alone(environ, platform, current):
    assert not malloc.should_preload(environ, platform, current)


def test_an_unknown_mode_is_a_user_error():
    with pytest.raises(UserError, match=r"FEDJAX_SPLIT_MALLOC='off': use auto .* or system"):
        malloc.should_preload({malloc.ENV: "off"}, "linux", "system")


PY = "/venv/bin/python"
ARGS = ["--task=sst2", "x y"]
TRAIN = "/src/fedjax_split/train.py"  # sys.argv[0] under -m


@pytest.mark.parametrize(
    "orig_argv, argv",
    [
        ([PY, "-m", "fedjax_split.train", *ARGS], [TRAIN, *ARGS]),
        ([PY, "-X", "dev", "-m", "fedjax_split.train", *ARGS], [TRAIN, *ARGS]),
        ([PY, "/venv/bin/fedjax-split-train", *ARGS], ["/venv/bin/fedjax-split-train", *ARGS]),
        ([PY, "-m", "fedjax_split.train"], [TRAIN]),  # no arguments
    ],
)  # fmt: skip
def test_own_command_line_is_the_cli_started_as_itself(orig_argv, argv):
    assert malloc.own_command_line(orig_argv, argv, {}) == orig_argv


@pytest.mark.parametrize(
    "orig_argv, argv, modules",
    [
        ([PY, "-c", "import x", *ARGS], ["-c", *ARGS], {}),  # python -c
        ([PY, "-", *ARGS], ["-", *ARGS], {}),  # a script on stdin: it cannot be read again
        ([PY, *ARGS], ["", *ARGS], {}),  # python < script
        ([PY, "-m", "wrapper", *ARGS], ["/w/wrapper.py", *ARGS], {}),  # another module
        ([PY, "run_many.py", *ARGS], ["run_many.py", *ARGS], {}),  # another script
        ([PY, "-m", "fedjax_split.train", "a"], ["/t.py", "b"], {}),  # argv changed since
        ([PY, "-m", "ipykernel_launcher", "-f", "k.json"], ["/t.py", "-f", "k.json"],
         {"IPython": object()}),  # %run in a notebook kernel
    ],
)  # fmt: skip
def test_own_command_line_refuses_other_programs(orig_argv, argv, modules):
    assert malloc.own_command_line(orig_argv, argv, modules) is None


def _run(tmp_path: Path, *command: str, **env: str) -> list[str]:
    """`python *command` with a probe module/script that calls reexec_with_tcmalloc, as the CLI
    does, on behalf of the module `probe_cli` (standing in for fedjax_split.train)."""
    probe = (
        "import os, sys\n"
        "from fedjax_split.run import malloc\n"
        "malloc.MODULE = 'probe_cli'\n"
        "print('before', flush=True)\n"
        "malloc.reexec_with_tcmalloc()\n"
        "print(malloc.allocator(), os.environ.get(malloc._MARK), sys.argv[1:])\n"
    )
    (tmp_path / "probe_cli.py").write_text(probe)
    drop = ("LD_PRELOAD", malloc.ENV, malloc._MARK)
    inherited = {k: v for k, v in os.environ.items() if k not in drop}
    proc_env = {**inherited, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), **env}
    res = subprocess.run([sys.executable, *command, *ARGS], env=proc_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_reexecution_runs_the_same_command_once_on_tcmalloc(tmp_path: Path) -> None:
    """A real execve, where ldconfig knows a tcmalloc (it does where CI runs)."""
    lines = _run(tmp_path, "-m", "probe_cli")
    if tcmalloc_installed():
        # the first process printed "before" and became the second, which printed it again
        assert lines == ["before", "before", f"tcmalloc 1 {ARGS}"]
    else:
        assert lines == ["before", f"system None {ARGS}"]


def test_no_reexecution_when_opted_out_or_not_started_as_the_cli(tmp_path: Path) -> None:
    assert _run(tmp_path, "-m", "probe_cli", **{malloc.ENV: "system"}) == [
        "before",
        f"system None {ARGS}",
    ]
    # the same probe run as a script, not as the CLI's module: a wrapper must not run twice
    assert _run(tmp_path, "probe_cli.py") == ["before", f"system None {ARGS}"]
