"""Embedding-table recovery on the Ray runtime, measured: `simulations.cli.embedding_runtime`.

    python scripts/embedding_runtime.py --help      # the same program as the `checkfree embedding-runtime` command

Needs the package installed (``pip install -e .``).
"""

import sys

from simulations.cli.embedding_runtime import main

if __name__ == "__main__":
    sys.exit(main())
