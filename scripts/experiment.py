"""An experiment matrix from a TOML file: `simulations.cli.experiment`.

    python scripts/experiment.py --help      # the same program as the `checkfree experiment` command

Needs the package installed (``pip install -e .``).
"""

import sys

from simulations.cli.experiment import main

if __name__ == "__main__":
    sys.exit(main())
