"""The timeout backstop (tests/backstop.py): a test that hangs past its timeout, and hangs
again in its cleanup -- holding the GIL, so that no Python code, pytest-timeout's included,
can run -- ends the run with its stack instead of holding it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HANGS = """
import ctypes, time

def test_hangs_and_hangs_again_in_its_cleanup():
    try:
        time.sleep(60)  # pytest-timeout's signal fails the test here...
    finally:
        ctypes.PyDLL(None).sleep(60)  # ...and its cleanup blocks in C, holding the GIL
"""


def test_this_run_has_the_backstop(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("tests.backstop")  # (tests/conftest.py)


def test_a_test_that_outlives_its_timeout_ends_the_run_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHECKFREE_TIMEOUT_BACKSTOP_S": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.backstop",
            "-p",
            "no:cacheprovider",
            "--timeout",
            "1",
            "--rootdir",
            str(tmp_path),
            "test_hangs.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert took < 30, f"{took:.0f} s: the backstop did not end the run"
    assert "Timeout (0:00:02)!" in out, out
    assert 'test_hangs.py", line 8 in test_hangs_and_hangs_again_in_its_cleanup' in out, out
