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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["custom_transformer", "vision", "gpt2"])
def test_an_example_trains_and_recovers(example: str) -> None:
    if example == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the optional extra: pip install -e '.[hf]'")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{example}.py"), "--steps", "24"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recovery: step 12, replica_copy" in out.stdout, out.stdout
    assert "loss: step 0" in out.stdout
