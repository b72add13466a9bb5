"""Atomic file writes: a reader, or a process killed mid-write, sees the old file or the new one,
never half of one.

The content goes to a temporary file beside the target (the same file system, so the rename is
atomic), under a name unique to this write (`<name>.<random>.tmp`, created exclusively, so
concurrent writers of one path never share a temporary file), which `os.replace` then renames over
the target. A writer that fails leaves the old file as it was and removes its temporary file. The
temporary file is created with the permissions `open` would give (the umask applies), so a file
written here looks like any other.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from fedjax_split.errors import UserError

__all__ = ["atomic_write", "atomic_write_text", "replace_dir", "write_bytes", "write_text"]


def _temporary(path: Path) -> tuple[int, Path]:
    """A new, empty file beside `path` that no other writer has: its descriptor and name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # another writer drew the same name: draw again
            continue


def _replace(path: str | os.PathLike[str], write: Callable[[Any], None], **open_kw: Any) -> Path:
    path = Path(path)
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, **open_kw) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> Path:
    """Replaces `path` with what `write` writes to the binary file it is given."""
    return _replace(path, write, mode="wb")


def atomic_write_text(
    path: str | os.PathLike[str], write: Callable[[TextIO], None], encoding: str = "utf-8"
) -> Path:
    """Replaces `path` with what `write` writes to the text file it is given."""
    return _replace(path, write, mode="w", encoding=encoding)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replaces `path` with `data`."""
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Replaces `path` with `text`."""
    return atomic_write_text(path, lambda f: f.write(text), encoding)


def replace_dir(
    out_dir: str | os.PathLike[str], fill: Callable[[Path], None], marker: str, what: str
) -> Path:
    """Writes a directory: `fill(tmp)` fills a temporary sibling, which is then renamed into
    place, so `out_dir` is never half-written (an export killed midway leaves the old one). An
    existing `out_dir` is replaced only if empty or holding the file `marker` (an earlier output
    of the same kind; `what` names that kind, "a model directory"): anything else is a
    UserError, so a mistyped path destroys nothing. The directory and its files get the modes a
    plain mkdir and open would give."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / marker).is_file())):
        raise UserError(f"{out} exists and is not {what}; choose another output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        fill(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        old = None
        if out.exists():
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
