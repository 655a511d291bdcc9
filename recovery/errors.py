"""Domain errors. Each subclasses a builtin so ordinary ``except`` clauses still work."""

from __future__ import annotations


class RecoveryError(RuntimeError):
    """A failure the job could not recover from; the message says what happened and why."""


class RedundancyExhausted(RecoveryError):
    """No allowed source exists for some lost state under the recovery policy."""


class PlacementFailed(RecoveryError):
    """Workers found no room on any node they may run on within
    ``RecoveryPolicy.timeouts.replace`` (at the start or for a replacement).

    The message names each worker and why (its node is gone, full, or can never hold a
    worker's `Trainer(worker_resources=...)`); ``unplaced`` maps each rank to that reason.
    """

    def __init__(self, message: str, *, unplaced: dict[int, str]) -> None:
        super().__init__(message)
        self.unplaced = dict(unplaced)

    def __reduce__(self) -> tuple[object, ...]:
        return (_placement_failed, (str(self), self.unplaced))


def _placement_failed(message: str, unplaced: dict[int, str]) -> PlacementFailed:
    return PlacementFailed(message, unplaced=unplaced)


class SnapshotCorrupted(RecoveryError):
    """A durable snapshot failed verification (a missing, truncated or altered file).

    The message names the snapshot, the file and the problem. Its bytes are never loaded:
    fall back to an older intact snapshot (``DurableStore.newest_intact``).
    """


class TransferCorrupted(RecoveryError):
    """State arrived whose bytes do not match the digests its sender took of them: it was
    corrupted on the way (a bad link or NIC) or, for a snapshot, in the memory that held
    it (see [Note: checked transfers] in recovery/transport/process_group.py). Nothing of
    it is trusted.

    ``found`` lists each corrupted arrival as ``(target rank, source rank, tensor names)``;
    ``snapshot`` is the step of the peer snapshot that arrived corrupted (None: a live
    worker's state). The executor retries from another source; with none left the next
    tier of the recovery hierarchy is used.
    """

    def __init__(
        self,
        message: str,
        *,
        found: list[tuple[int, int, tuple[str, ...]]],
        snapshot: int | None = None,
    ) -> None:
        super().__init__(message)
        self.found = list(found)
        self.snapshot = snapshot

    def __reduce__(self) -> tuple[object, ...]:
        return (_transfer_corrupted, (str(self), self.found, self.snapshot))


def _transfer_corrupted(
    message: str, found: list[tuple[int, int, tuple[str, ...]]], snapshot: int | None
) -> TransferCorrupted:
    return TransferCorrupted(message, found=found, snapshot=snapshot)


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


class CallbackError(RuntimeError):
    """A user callback of the `TrainSpec` raised inside a worker.

    Names the callback, the step (or held-out batch index) and the worker; the user's own
    exception is its ``__cause__`` (and ``user_error``), also after it crossed from a Ray
    worker to the driver. The job stops: retrying the same deterministic call on a rebuilt
    worker would raise again.
    """

    def __init__(
        self, callback: str, step: int | None, stage: int, replica: int, user_error: BaseException
    ) -> None:
        when = "at start-up" if step is None else f"at step {step}"
        super().__init__(
            f"{callback} raised {type(user_error).__name__}: {user_error} "
            f"(in worker stage {stage}, replica {replica}, {when})"
        )
        self.callback, self.step, self.stage, self.replica = callback, step, stage, replica
        self.user_error = user_error
        self.__cause__ = user_error

    def __reduce__(self) -> tuple[object, ...]:
        user_error: BaseException = self.user_error
        try:
            import pickle

            pickle.dumps(user_error)
        except Exception:  # an exception that does not pickle travels as its text
            user_error = RuntimeError(f"{type(self.user_error).__name__}: {self.user_error}")
        return (
            CallbackError,
            (self.callback, self.step, self.stage, self.replica, user_error),
        )
