"""Domain errors. Each subclasses a builtin so ordinary ``except`` clauses still work."""

from __future__ import annotations


class RecoveryError(RuntimeError):
    """A failure the job could not recover from; the message says what happened and why."""


class RedundancyExhausted(RecoveryError):
    """No allowed source exists for some lost state under the recovery policy."""


class SnapshotCorrupted(RecoveryError):
    """A durable snapshot failed verification (a missing, truncated or altered file).

    The message names the snapshot, the file and the problem. Its bytes are never loaded:
    fall back to an older intact snapshot (``DurableStore.newest_intact``).
    """
