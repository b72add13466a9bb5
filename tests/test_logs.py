"""deploy.logs: the launcher's copies of the federation's output (no colour codes, no Flower
empty records) and the settings of an app process (each Flower record printed once, warnings on
one line), the latter in a fresh interpreter as Flower starts one."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from fedjax_split.deploy import logs

ROOT = Path(__file__).resolve().parents[1]


def test_clean_drops_colour_codes_and_flowers_empty_records() -> None:
    assert logs.clean(b"\x1b[92mINFO \x1b[0m:      Starting\n") == b"INFO :      Starting\n"
    assert logs.clean(b"\x1b[93mWARNING \x1b[0m:   careful\n") == b"WARNING :   careful\n"
    assert logs.clean(b"\x1b[92mINFO \x1b[0m:      \n") is None
    assert logs.clean(b"INFO :      \r\n") is None
    assert logs.clean(b"round 1 | loss 0.6895\n") == b"round 1 | loss 0.6895\n"
    assert logs.clean(b"\n") == b"\n"  # a blank line of the program's own stays


def test_copy_lines_appends_clean_lines_and_echoes_them(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"before\n")
    echo = io.StringIO()
    source = io.BytesIO(b"\x1b[92mINFO \x1b[0m:      a\n\x1b[92mINFO \x1b[0m:      \nb \xff\n"
                        b"error: bad\n")  # fmt: skip
    logs.copy_lines(source, log, echo)
    assert log.read_bytes() == b"before\nINFO :      a\nb \xff\nerror: bad\n"
    assert echo.getvalue() == "INFO :      a\nb \ufffd\n"  # the command says its error itself


def test_an_app_process_prints_each_flower_record_once_and_warnings_on_one_line() -> None:
    """As in a ServerApp process: a root handler is there (absl's `logging.basicConfig`, under
    orbax), then `app_process`: Flower's records once, uncoloured off a terminal, and warnings
    in the run's one-line form."""
    probe = (
        "import logging, warnings\n"
        "logging.basicConfig()\n"
        "from flwr.common.logger import log\n"
        "from fedjax_split.deploy import logs\n"
        "logs.app_process()\n"
        "log(logging.INFO, 'Starting')\n"
        "log(logging.DEBUG, 'finished running')\n"
        "warnings.warn('careful')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = (res.stdout + res.stderr).splitlines()
    assert sorted(lines) == ["INFO :      Starting", "warning: careful"], lines
