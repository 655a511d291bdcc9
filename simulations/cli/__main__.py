"""``python -m simulations.cli``: the ``checkfree`` command without its console script."""

import sys

from simulations.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
