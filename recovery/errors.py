"""Domain errors. Each subclasses a builtin so ordinary ``except`` clauses still work."""

from __future__ import annotations


class RecoveryError(RuntimeError):
    """A failure the job could not recover from; the message says what happened and why."""


class RedundancyExhausted(RecoveryError):
    """No allowed source exists for some lost state under the recovery policy."""
