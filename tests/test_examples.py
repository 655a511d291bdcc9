"""The examples run as a user runs them: a subprocess on an embedded local Ray, a kill
injected, the recovery printed. Slow (a Ray start each): `scripts/test_slow.sh` runs them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(example: str, *extra: str) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{example}.py"), "--steps", "24", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _lines(stdout: str, prefix: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", ["custom_transformer", "vision", "gpt2"])
def test_an_example_recovers_and_ends_as_the_run_without_a_failure(example: str) -> None:
    """The example with its injected kill recovers (a replica copy at step 12) and ends with
    the losses and the final state digest (every tensor, `FitResult.state_digest`) of the
    same example run without the kill."""
    if example == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the optional extra: pip install -e '.[hf]'")
    killed, clean = _run(example), _run(example, "--no-kill")
    assert _lines(killed, "recovery:") and _lines(killed, "recovery:")[0].startswith(
        "recovery: step 12, replica_copy"
    ), killed
    assert not _lines(clean, "recovery:"), clean
    for prefix in ("loss:", "final state digest:"):
        assert _lines(killed, prefix) and _lines(killed, prefix) == _lines(clean, prefix), prefix
