"""The help layout every checkfree command shares: the description as written (its examples
keep their lines), and each option's default shown beside its help.

A default is appended as ``(default: X)`` unless the help already says what happens without
the flag (it mentions "default"), or there is nothing to show: a switch (``store_true``),
a default of None (the help says what is used instead) or an empty list.
`refusals_as_errors` turns a refused setting into a one-line error and status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`argparse.RawDescriptionHelpFormatter` that appends each option's default to its help
    where the help does not give it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or text is argparse.SUPPRESS or "default" in text.lower():
            return text
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default == []:
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text  # a required positional has no default to show
        return f"{text} (default: %(default)s)"


def refusals_as_errors(prog: str, main: Callable[[], int]) -> int:
    """Run ``main()`` as a command line should: a ValueError -- checkfree refusing a setting,
    before any worker starts -- is printed as ``PROG: error: MESSAGE`` and the status is 2,
    as argparse does for a bad flag, rather than a traceback above the message.
    ``CHECKFREE_TRACEBACK=1`` raises it instead, to see where it came from."""
    try:
        return main()
    except ValueError as refusal:
        if os.environ.get("CHECKFREE_TRACEBACK") == "1":
            raise
        print(f"{prog}: error: {refusal}", file=sys.stderr)
        print("(CHECKFREE_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        return 2
