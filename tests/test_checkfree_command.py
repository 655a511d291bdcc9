"""The ``checkfree`` command: its listing, every subcommand's --help, one run end to end, the
cheap dispatch, and every ``python scripts/X.py`` still working."""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recovery.cli.help import HelpFormatter
from simulations.cli import commands as dispatch
from simulations.cli.commands import COMMANDS, Command, main

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
PARTS_OF_BENCH = {"peers.py", "vote_scale.py", "stragglers.py"}
"""Scripts that are pieces of ``scripts/bench.py`` (``bench peers``, ``bench vote``,
``bench stragglers``), not commands of their own."""

KEY_FLAGS = {
    "train": ["--stages", "--replicas", "--failures", "--steps", "--out"],
    "chaos": ["--kills", "--mean-interval", "--burst-prob", "--hot-spares", "--nodes"],
    "simulate": ["--gpus", "--layout", "--strategies", "--seeds", "--plot", "--straggler-rate"],
    "experiment": ["config", "--out", "--jobs", "--report-only"],
    "embedding-experiment": ["--preset", "--workers", "--failures", "--report-only"],
    "embedding-runtime": ["--preset", "--workers", "--failures", "--table"],
    "gpu-check": ["--cpu", "--bench-preset", "--budget-s"],
    "bench": ["throughput", "recovery", "snapshots", "zero", "fingerprint", "peers", "vote"],
    "bench-simulator": ["--seeds", "--repeats", "--check"],
    "same-losses": ["--out", "--only", "--compare"],
    "compare-trees": ["--old", "--new", "--sizes", "--spares"],
    "engine-vs-ddp": ["--size", "--steps", "--rounds", "--no-votes"],
}
"""What each command's --help must mention; a new command must be added here."""

MODULES = [c for c in COMMANDS if c.module is not None]


def _env() -> dict[str, str]:
    """The environment for a child: this checkout first on its path."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), path]))}


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_known_to_these_tests() -> None:
    assert [c.name for c in COMMANDS] == list(KEY_FLAGS)
    assert len({c.name for c in COMMANDS}) == len(COMMANDS)


def test_checkfree_help_lists_every_subcommand_users_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _help(["--help"], capsys)
    for command in COMMANDS:
        assert f"\n  {command.name}" in out, command.name
        assert command.summary in out
    users, developers = out.split("commands for developers")
    assert {c.name for c in COMMANDS if c.name in users.split()} == {
        c.name for c in COMMANDS if not c.developer
    }
    assert "same-losses" in developers and "pip install -e ." in developers
    assert "checkfree COMMAND --help" in out


def test_no_command_or_an_unknown_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in ([], ["trian"], ["--steps", "3"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2, argv
        assert "usage: checkfree" in capsys.readouterr().err


def test_checkfree_help_loads_neither_torch_nor_ray() -> None:
    """The dispatcher imports a program only once it is chosen: ``checkfree --help`` stays
    quick (it is the first thing a new user types)."""
    code = (
        "import sys\nfrom simulations.cli import commands\n"
        "try:\n    commands.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'ray', 'numpy', 'recovery', 'parallelism'})\n"
        "print('loaded:', heavy, file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stderr and "train" in done.stdout


def test_python_dash_m_simulations_cli_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "simulations.cli", "--help"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert all(c.name in done.stdout for c in COMMANDS)


def test_the_installed_console_scripts() -> None:
    """pyproject declares both commands; where this environment has them installed (``pip
    install -e .``) they answer --help."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '\ncheckfree = "simulations.cli.commands:main"\n' in pyproject
    assert '\ncheckfree-train = "recovery.cli.train:cli"\n' in pyproject
    installed = shutil.which("checkfree", path=str(Path(sys.executable).parent))
    if installed is None:
        pytest.skip("the checkfree console script is not installed in this environment")
    done = subprocess.run(
        [installed, "--help"], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert all(c.name in done.stdout for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_each_subcommand_help_exits_0_and_names_its_key_flags(
    command: Command, capfd: pytest.CaptureFixture[str]
) -> None:
    """``checkfree NAME --help``: in this process for an installed program (its usage reads
    ``checkfree NAME``), in a child for a checkout one."""
    program = sys.argv[0]
    with pytest.raises(SystemExit) as done:
        code = main([command.name, "--help"])
        raise SystemExit(code)  # a checkout program returns the child's status
    assert done.value.code == 0
    assert sys.argv[0] == program  # the program name is given back
    out = capfd.readouterr().out
    for flag in KEY_FLAGS[command.name]:
        assert flag in out, (command.name, flag)
    assert f"checkfree {command.name}" in out  # an example, or the usage line
    if command.module is not None:
        assert out.startswith(f"usage: checkfree {command.name} ")


@pytest.mark.parametrize("command", MODULES, ids=lambda c: c.name)
def test_every_flag_of_an_installed_program_has_help_and_shows_its_default(
    command: Command,
) -> None:
    """The shared layout (`HelpFormatter`): a description with examples, and every option
    with help text that gives its default (the formatter appends the ones not written)."""
    import importlib

    parser = importlib.import_module(str(command.module)).build_parser()
    assert parser.formatter_class is HelpFormatter
    assert parser.description and f"checkfree {command.name}" in parser.description
    formatter = HelpFormatter(prog="checkfree")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), (command.name, action.dest)
        shown = formatter._get_help_string(action) or ""
        has_default = action.default not in (None, False, [], argparse.SUPPRESS)
        if has_default and (action.option_strings or action.nargs in ("?", "*")):
            assert "default" in shown.lower(), (command.name, action.dest, shown)


def test_the_formatter_appends_a_default_only_where_it_is_not_written() -> None:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--stages", type=int, default=None, help="stages (default 4)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--set", action="append", default=[], help="an override")
    text = parser.format_help()
    assert "optimizer steps (default: 300)" in text
    assert "stages (default 4)\n" in text and "(default: None)" not in text
    assert "no progress bar\n" in text and "(default: False)" not in text
    assert "(default: [])" not in text


def test_one_command_end_to_end_and_its_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``checkfree simulate`` on a small job: the table printed, the JSON written, status 0;
    bad input: the program's status 2 comes back through the dispatcher."""
    out = tmp_path / "goodput.json"
    argv = ["simulate", "--gpus", "64", "--layout", "pp=2,dp=4,tp=8", "--days", "2",
            "--strategies", "checkpoint_restart,replica_copy", "--seeds", "3", "--quiet",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "replica_copy" in printed and "goodput" in printed
    summary = json.loads(out.read_text())
    assert set(summary["strategies"]) == {"checkpoint_restart", "replica_copy"}
    assert main(["simulate", "--gpus", "64", "--strategies", "magic", "--quiet"]) == 2
    assert "unknown strategy" in capsys.readouterr().err


def test_a_checkout_command_without_a_checkout_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dispatch, "checkout", lambda: None)
    assert main(["bench", "recovery"]) == 2
    err = capsys.readouterr().err
    assert "scripts/bench.py" in err and "pip install -e ." in err


def test_each_installed_program_is_what_its_script_runs() -> None:
    """``scripts/<name>.py`` of an installed program is a thin wrapper importing its
    ``main`` (or ``cli``: ``main`` with refusals as one error line); every script is a
    command's, or a piece of bench."""
    for command in COMMANDS:
        path = ROOT / command.script
        assert path.is_file(), path
        if command.module is None:
            continue
        tree = ast.parse(path.read_text())
        imported = {
            (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert {(command.module, "main"), (command.module, "cli")} & imported, path
        assert len(path.read_text().splitlines()) <= 15, f"{path}: not a thin wrapper"
    named = {Path(c.script).name for c in COMMANDS}
    assert set(SCRIPTS) == named | PARTS_OF_BENCH


_HELP_OF_EVERY_SCRIPT = """
import contextlib, io, json, runpy, sys, traceback
found = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0] = [path, "--help"], path.rsplit("/", 1)[0]  # as `python path --help`
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if stop.code is None or isinstance(stop.code, int) else repr(stop.code)
    except BaseException:
        code = traceback.format_exc()
    found[path] = [code, out.getvalue()]
print(json.dumps(found), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list[object]]:
    """``python scripts/X.py --help`` of every script, run as the interpreter runs a file
    (``runpy``, the script's folder first on the path), all in one child: one torch import
    instead of one per script."""
    paths = [str(ROOT / "scripts" / name) for name in SCRIPTS]
    done = subprocess.run(
        [sys.executable, "-c", _HELP_OF_EVERY_SCRIPT, *paths],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, list[object]] = json.loads(done.stderr.strip().splitlines()[-1])
    return {Path(path).name: result for path, result in found.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_python_scripts_x_help_still_works(script: str, helps: dict[str, list[object]]) -> None:
    code, out = helps[script]
    assert code == 0, (script, code)
    assert str(out).startswith("usage:"), str(out)[:500]
