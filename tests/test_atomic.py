"""Atomic writes: the old file or the new one, never half of one, and no temporary file left."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from fedjax_split import atomic


def test_writes_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    assert atomic.write_text(target, "one\n") == target
    assert target.read_text() == "one\n"
    atomic.write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    atomic.atomic_write(target, lambda f: np.save(f, np.arange(3)))
    np.testing.assert_array_equal(np.load(target), np.arange(3))
    atomic.atomic_write_text(target, lambda f: f.write("é\n"))
    assert target.read_bytes() == "é\n".encode()  # utf-8 whatever the locale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_text("old")

    def half_then_fail(f) -> None:
        f.write(b"half of the new")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic.atomic_write(target, half_then_fail)
    with pytest.raises(KeyboardInterrupt):  # an interrupt cleans up too
        atomic.atomic_write_text(target, lambda f: (_ for _ in ()).throw(KeyboardInterrupt))
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    with pytest.raises(RuntimeError):  # a target that did not exist is not created
        atomic.atomic_write(tmp_path / "new.bin", half_then_fail)
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_concurrent_writers_do_not_share_a_temporary(tmp_path: Path) -> None:
    """Each writer holds its temporary file open until all have started: if two shared a name,
    one would write into the other's file or fail to create it."""
    target = tmp_path / "shared.bin"
    n = 8
    barrier = threading.Barrier(n)
    seen: list[list[str]] = []
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        def write(f) -> None:
            barrier.wait(timeout=30)  # every writer has its temporary file open
            seen.append(sorted(p.name for p in tmp_path.iterdir()))
            barrier.wait(timeout=30)  # and keeps it until every writer has looked
            f.write(bytes([i]) * 1000)

        try:
            atomic.atomic_write(target, write)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(seen) == n and all(names == seen[0] for names in seen)
    assert len(seen[0]) == n  # n distinct temporaries, the target not yet written
    assert all(t.startswith("shared.bin.") and t.endswith(".tmp") for t in seen[0])
    data = target.read_bytes()
    assert len(data) == 1000 and len(set(data)) == 1  # one writer's whole file
    assert [p.name for p in tmp_path.iterdir()] == ["shared.bin"]


def test_permissions_follow_the_umask(tmp_path: Path) -> None:
    """Not mkstemp's 0600: a run directory's files are readable as files written by `open`."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    written = atomic.write_text(tmp_path / "atomic", "x")
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_replace_dir_swaps_in_a_whole_directory_and_refuses_what_is_not_its_kind(
    tmp_path: Path,
) -> None:
    from fedjax_split.atomic import replace_dir
    from fedjax_split.errors import UserError

    def fill(text: str):
        def write(d: Path) -> None:
            (d / "config.json").write_text(text)
            (d / "weights.bin").write_bytes(text.encode())

        return write

    out = tmp_path / "model"
    assert replace_dir(out, fill("one"), "config.json", "a model directory") == out
    replace_dir(out, fill("two"), "config.json", "a model directory")  # an earlier export
    assert (out / "config.json").read_text() == "two"

    def fails(d: Path) -> None:
        (d / "config.json").write_text("half")
        raise RuntimeError("killed midway")

    with pytest.raises(RuntimeError):
        replace_dir(out, fails, "config.json", "a model directory")
    assert (out / "config.json").read_text() == "two"  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="is not a model directory"):
        replace_dir(mine, fill("x"), "config.json", "a model directory")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
