"""The simulators' and experiments' command-line programs, installed as ``checkfree``
subcommands (`simulations.cli.commands`, the dispatcher); ``scripts/<name>.py`` runs each from a checkout.

- ``simulate``: ``checkfree simulate``, cluster-scale goodput per recovery strategy.
- ``experiment``: ``checkfree experiment``, an experiment matrix from a TOML file.
- ``embedding_experiment``: ``checkfree embedding-experiment``, embedding-table recovery
  in one process, its time modelled.
- ``embedding_runtime``: ``checkfree embedding-runtime``, the same on the Ray runtime, timed.
- ``bench_simulator``: ``checkfree bench-simulator``, the simulator's speed against its budgets.

Each module's ``main(argv) -> int`` is the program; ``build_parser()`` its flags.
"""

__all__: list[str] = []
