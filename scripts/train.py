"""Train with pipeline x data parallelism on Ray, with failures injected: `recovery.cli.train`.

    python scripts/train.py --help      # the same program as `checkfree train` (and `checkfree-train`)

Needs the package installed (``pip install -e .``); under ``ray job submit --working-dir .``
Ray puts the uploaded checkout on the path.
"""

import sys

from recovery.cli.train import cli

if __name__ == "__main__":
    sys.exit(cli())
