"""Silent data corruption: fingerprints of a worker's state, and the vote that compares them.

- ``fingerprint``: `fingerprint` (one XXH3-64 digest per tensor of a `WorkerState`),
  `digest`, and `flip_bit`, the injected corruption.
- ``fingerprint_vote``: `vote`, `Verdict` and `can_vote` -- which replicas of a stage hold
  corrupted state ([Note: fingerprint vote]); not the commit vote of ``parallelism``.

The plan that follows a verdict is the planner's (`recovery.planner.corruption_plan`).
"""

from recovery.integrity.fingerprint import (
    DESCRIPTION,
    RECOMMENDED_FINGERPRINT_EVERY,
    Fingerprint,
    digest,
    fingerprint,
    flip_bit,
    flip_one,
    raw_bytes,
    state_tensors,
)
from recovery.integrity.fingerprint_vote import Verdict, can_vote, vote

__all__ = [
    "DESCRIPTION",
    "RECOMMENDED_FINGERPRINT_EVERY",
    "Fingerprint",
    "Verdict",
    "can_vote",
    "digest",
    "fingerprint",
    "flip_bit",
    "flip_one",
    "raw_bytes",
    "state_tensors",
    "vote",
]
