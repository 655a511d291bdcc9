"""The library's command-line programs, installed as ``checkfree`` subcommands.

- ``train``: ``checkfree train`` (also ``checkfree-train``), training with failures injected.
- ``chaos``: ``checkfree chaos``, SIGKILLs of a job's workers from outside, every job
  checked bit for bit against the uninterrupted run.
- ``gpu_check``: ``checkfree gpu-check``, the GPU path end to end, as a table.
- ``workloads``: the small jobs ``chaos`` and ``gpu_check`` train.
- ``help``: `HelpFormatter`, the help layout every command shares.

Each program's ``main(argv) -> int`` runs it and ``build_parser()`` holds its flags;
``scripts/<name>.py`` is a thin wrapper that runs it from a checkout. The dispatcher is
`simulations.cli.commands`, in the top package: it imports a program only once it is chosen, so ``checkfree --help`` loads neither torch nor Ray. The simulators'
programs are in ``simulations.cli``; the benchmarks stay in ``scripts/`` (they start peers
from their own file and compare checkouts).
"""

__all__: list[str] = []
