"""The ``checkfree`` command: one entry point, a subcommand per program.

This package holds only the dispatcher (`checkfree.commands`): it imports nothing of
``recovery``, ``parallelism`` or ``simulations`` until a subcommand runs, so that
``checkfree --help`` answers without loading torch or Ray. Each subcommand's code lives in
the package it belongs to (``recovery.cli``, ``simulations.cli``), or, for the benchmarks
and tools that need a checkout, in ``scripts/``.
"""

from checkfree.commands import COMMANDS, Command, main

__all__ = ["COMMANDS", "Command", "main"]
