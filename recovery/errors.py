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


class RecoveryInterrupted(RecoveryError):
    """Workers were lost, or their process groups broke, while a recovery (or the start)
    was under way.

    Inside a recovery the controller catches it and plans again with the grown set of lost
    workers (see [Note: re-entrant recovery] in recovery/runtime/controller.py); it only
    reaches the user when it cannot (at start-up, or after too many interruptions).
    """

    def __init__(self, message: str, *, lost: set[int], broken: set[int]) -> None:
        super().__init__(message)
        self.lost = set(lost)
        """Ranks whose worker died or did not answer."""
        self.broken = set(broken)
        """Ranks whose worker is alive but whose call failed on a communication error."""
