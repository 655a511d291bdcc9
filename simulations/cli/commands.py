"""``checkfree COMMAND [ARGS...]``: the table of subcommands, and the dispatch to each.

A subcommand is either a module of the installed packages whose ``main(argv)`` runs it
(imported by name, only once chosen: ``checkfree --help`` loads neither torch nor Ray), or
a program of ``scripts/`` in the checkout this package was installed from (``pip install
-e .``), run as ``python scripts/<name>.py ARGS...``: the benchmarks and the developers'
tools that start peers from their own file, load other trees, or compare checkouts. Every
``python scripts/<name>.py`` is the same program as ``checkfree <name>`` (``_`` -> ``-``).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Command:
    """One subcommand of ``checkfree``."""

    name: str
    """What follows ``checkfree``; also ``scripts/<name with - as _>.py``."""
    summary: str
    """One line for ``checkfree --help``."""
    example: str
    """One command line that runs it, for ``checkfree --help`` and docs/cli.md."""
    module: str | None = None
    """The installed module whose ``main(argv) -> int`` runs it; None: a checkout program."""
    developer: bool = False
    """A tool for working on checkfree itself rather than for using it."""

    @property
    def script(self) -> str:
        """Its program in a checkout, relative to the checkout's root."""
        return f"scripts/{self.name.replace('-', '_')}.py"

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("-") or " " in self.name:
            raise ValueError(f"a command name is one word not starting with '-', got {self.name!r}")


COMMANDS: tuple[Command, ...] = (
    Command(
        name="train",
        module="recovery.cli.train",
        summary="train on Ray, workers killed (--failures) and recovered; also checkfree-train",
        example="checkfree train --failures auto",
    ),
    Command(
        name="chaos",
        module="recovery.cli.chaos",
        summary="SIGKILL workers from outside at random; each job checked bit for bit",
        example="checkfree chaos --kills 5",
    ),
    Command(
        name="simulate",
        module="simulations.cli.simulate",
        summary="cluster-scale failure simulation: goodput per recovery strategy",
        example="checkfree simulate --gpus 16384 --days 54 --plot goodput.png",
    ),
    Command(
        name="experiment",
        module="simulations.cli.experiment",
        summary="an experiment matrix from a TOML file (convergence, runtime, simulator)",
        example="checkfree experiment configs/runtime-smoke.toml --out /tmp/runtime-smoke",
    ),
    Command(
        name="embedding-experiment",
        module="simulations.cli.embedding_experiment",
        summary="embedding-table recovery, time modelled: rollback vs CPR vs mirrors",
        example="checkfree embedding-experiment --preset tiny --steps 60 --heldout 2000",
    ),
    Command(
        name="embedding-runtime",
        module="simulations.cli.embedding_runtime",
        summary="embedding-table recovery on the Ray runtime, every second measured",
        example="checkfree embedding-runtime --preset tiny --steps 60 --failures 2 --heldout 2000",
    ),
    Command(
        name="gpu-check",
        module="recovery.cli.gpu_check",
        summary="the GPU path end to end: equivalence, kills, a hang, a benchmark",
        example="checkfree gpu-check",
    ),
    Command(
        name="bench",
        summary="benchmarks: throughput, recovery, snapshots, zero, peers, vote, stragglers, ...",
        example="checkfree bench recovery --presets demo",
    ),
    Command(
        name="bench-simulator",
        module="simulations.cli.bench_simulator",
        summary="the cluster simulator's speed against its time budgets",
        example="checkfree bench-simulator --check",
        developer=True,
    ),
    Command(
        name="same-losses",
        summary="refactor check: the same losses and states before and after a change",
        example="checkfree same-losses --out /tmp/after.json",
        developer=True,
    ),
    Command(
        name="compare-trees",
        summary="two checkouts in turn on bench peers' job: is a change slower?",
        example="checkfree compare-trees --old ../old-checkout --sizes 10",
        developer=True,
    ),
    Command(
        name="engine-vs-ddp",
        summary="the data-parallel step without the runtime: StageEngine vs DDP",
        example="checkfree engine-vs-ddp --size 10 --rounds 1",
        developer=True,
    ),
)
"""Every subcommand, users' first; ``checkfree --help`` lists them in this order."""

_BY_NAME = {c.name: c for c in COMMANDS}


def checkout() -> Path | None:
    """The checkout this package runs from (an editable install, or the working tree on
    ``sys.path``), or None when it was installed from a wheel and there is no ``scripts/``."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "scripts").is_dir():
        return root
    return None


def _listing(developer: bool) -> list[str]:
    width = max(len(c.name) for c in COMMANDS)
    return [
        f"  {c.name + ('' if c.module else ' *'):<{width + 2}}  {c.summary}"
        for c in COMMANDS
        if c.developer == developer
    ]


def build_parser() -> argparse.ArgumentParser:
    """``checkfree``'s own parser: the command's name (and --help, --version)."""
    examples = [f"  {c.example}" for c in COMMANDS if not c.developer]
    parser = argparse.ArgumentParser(
        prog="checkfree",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="checkfree [-h] [--version] COMMAND [ARGS...]",
        description="\n".join(
            [
                "Checkpoint-free recovery for pipeline x data-parallel PyTorch training on Ray.",
                "",
                "commands for users:",
                *_listing(developer=False),
                "",
                "commands for developers of checkfree:",
                *_listing(developer=True),
                "",
                "examples:",
                *examples,
            ]
        ),
        epilog=(
            "`checkfree COMMAND --help` gives a command's flags, their defaults and examples.\n"
            "Users' commands train, break and measure jobs; developers' commands check that a\n"
            "change to checkfree keeps its losses and its speed.\n"
            "*: runs scripts/<command>.py of the checkout checkfree was installed from\n"
            "(pip install -e .), as it starts peers from its own file or loads other trees;\n"
            "the other commands are in the installed packages. In a checkout,\n"
            "`python scripts/<command>.py` (with _ for -) is the same program as each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"checkfree {_version()}")
    parser.add_argument(
        "command", metavar="COMMAND", choices=list(_BY_NAME), help="one of the commands above"
    )
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("checkfree")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``checkfree COMMAND ARGS...``; returns the command's exit status.

    Raises:
        SystemExit: after --help or --version (status 0); for no command or an unknown one
            (status 2); or as the command's own parser raises it.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    name = build_parser().parse_args(args[:1]).command
    return run(_BY_NAME[name], args[1:])


def run(command: Command, argv: Sequence[str]) -> int:
    """Run ``command`` with ``argv``: its module's ``main``, in this process, under the
    program name ``checkfree NAME``; or its checkout program in a child process. Returns
    its exit status (2, with what to do on stderr, when a checkout program has no checkout).
    """
    if command.module is not None:
        module = importlib.import_module(command.module)
        program = sys.argv[0]
        sys.argv[0] = f"checkfree {command.name}"  # argparse's prog: usage reads as typed
        from recovery.cli.help import refusals_as_errors

        try:
            return refusals_as_errors(
                f"checkfree {command.name}", lambda: int(module.main(list(argv)) or 0)
            )
        finally:
            sys.argv[0] = program
    root = checkout()
    if root is None or not (root / command.script).is_file():
        print(
            f"checkfree {command.name}: runs {command.script} of a checkout of checkfree, and "
            f"this installation ({Path(__file__).resolve().parents[2]}) has none. Clone the "
            f"repository and `pip install -e .` there, then run `checkfree {command.name}` or "
            f"`python {command.script}` in it.",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, str(root / command.script), *argv]).returncode
