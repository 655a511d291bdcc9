"""The cluster simulator's speed against its budgets: `simulations.cli.bench_simulator`.

    python scripts/bench_simulator.py --help      # the same program as the `checkfree bench-simulator` command

Needs the package installed (``pip install -e .``).
"""

import sys

from simulations.cli.bench_simulator import main

if __name__ == "__main__":
    sys.exit(main())
