"""The GPU path end to end, as a table: `recovery.cli.gpu_check`.

    python scripts/gpu_check.py --help      # the same program as the `checkfree gpu-check` command

Needs the package installed (``pip install -e .``).
"""

import sys

from recovery.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
