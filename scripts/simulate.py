"""Cluster-scale failure simulation, goodput per recovery strategy: `simulations.cli.simulate`.

    python scripts/simulate.py --help      # the same program as the `checkfree simulate` command

Needs the package installed (``pip install -e .``).
"""

import sys

from simulations.cli.simulate import main

if __name__ == "__main__":
    sys.exit(main())
