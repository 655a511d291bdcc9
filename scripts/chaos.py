"""SIGKILLs of a job's workers from outside, every job checked bit for bit: `recovery.cli.chaos`.

    python scripts/chaos.py --help      # the same program as the `checkfree chaos` command

Needs the package installed (``pip install -e .``).
"""

import sys

from recovery.cli.chaos import main

if __name__ == "__main__":
    sys.exit(main())
