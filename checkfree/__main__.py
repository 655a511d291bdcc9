"""``python -m checkfree``: the ``checkfree`` command."""

import sys

from checkfree.commands import main

if __name__ == "__main__":
    sys.exit(main())
