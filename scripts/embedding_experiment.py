"""Embedding-table recovery in one process, its time modelled: `simulations.cli.embedding_experiment`.

    python scripts/embedding_experiment.py --help      # the same program as the `checkfree embedding-experiment` command

Needs the package installed (``pip install -e .``).
"""

import sys

from simulations.cli.embedding_experiment import main

if __name__ == "__main__":
    sys.exit(main())
