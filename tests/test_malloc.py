"""fedjax_split.run.malloc: glibc's malloc tuned at import, so that freed buffers are reused
instead of faulted in again; which malloc a process runs on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_split.errors import UserError
from fedjax_split.run import malloc

ROOT = Path(__file__).resolve().parents[1]
GLIBC = "7f01-7f02 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
TC = "7f03-7f04 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n"
JE = "7f05-7f06 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"


def test_allocator_is_read_from_the_process_maps(monkeypatch):
    assert malloc.allocator(GLIBC + TC) == "tcmalloc"
    assert malloc.allocator(JE + GLIBC) == "jemalloc"
    monkeypatch.setattr(malloc, "_tuned", False)
    assert malloc.allocator(GLIBC) == "system"
    monkeypatch.setattr(malloc, "_tuned", True)
    assert malloc.allocator(GLIBC) == "glibc-tuned"


def test_tuning_is_wanted_on_linux_glibc_unless_opted_out():
    assert malloc.wanted({}, "linux", "system")
    assert malloc.wanted({malloc.ENV: "auto"}, "linux", "system")
    assert not malloc.wanted({malloc.ENV: "system"}, "linux", "system")  # opted out
    assert not malloc.wanted({}, "darwin", "unknown")  # not Linux
    assert not malloc.wanted({}, "linux", "tcmalloc")  # the user preloaded another malloc
    assert not malloc.wanted({}, "linux", "jemalloc")
    with pytest.raises(UserError, match=r"FEDJAX_SPLIT_MALLOC='off': use auto .* or system"):
        malloc.wanted({malloc.ENV: "off"}, "linux", "system")


# A child process that imports fedjax_split (which tunes malloc unless opted out), then, in a
# second thread as XLA's workers would, allocates, touches and frees a 64 MB block ten times,
# and prints the minor page faults that took, and the allocator it reports.
_PROBE = """
import ctypes, resource, sys, threading
import fedjax_split
from fedjax_split.run import malloc
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
faults = []
def work():
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=work)
t.start(); t.join()
print(malloc.allocator(), sum(faults[1:]), faults[0])
"""


def _probe(**env: str) -> tuple[str, int, int]:
    inherited = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.ENV)}
    res = subprocess.run([sys.executable, "-c", _PROBE], env={**inherited, **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    name, later, first = res.stdout.split()
    return name, int(later), int(first)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_freed_block_is_reused_instead_of_faulted_in_again():
    """Untuned, each of the nine repeated 64 MB blocks is a fresh mmap whose pages fault in anew
    (about 16k 4 KB faults each); tuned, the first block's pages are reused."""
    name, later, first = _probe(**{malloc.ENV: "system"})
    assert name == "system"
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert later > 9 * pages // 2, (later, pages)  # faulted in again and again
    name, later_tuned, first_tuned = _probe()
    assert name == "glibc-tuned"
    assert first_tuned > pages // 2  # the first touch faults, of course
    assert later_tuned < later // 10, (later_tuned, later)
