"""The command-line programs, importable so that they can be installed as commands.

- ``train``: ``checkfree-train``, training with failures injected.

``checkfree-train`` (`recovery.cli.train`) trains with failures injected; ``scripts/train.py``
is the same program for a checkout (after ``pip install -e .``). Benchmarks and
experiments stay in ``scripts/``: they measure or study the library and are not part of it.
"""

__all__: list[str] = []
