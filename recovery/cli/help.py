"""The help layout every checkfree command shares: the description as written (its examples
keep their lines), and each option's default shown beside its help.

A default is appended as ``(default: X)`` unless the help already says what happens without
the flag (it mentions "default"), or there is nothing to show: a switch (``store_true``),
a default of None (the help says what is used instead) or an empty list.
"""

from __future__ import annotations

import argparse


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
