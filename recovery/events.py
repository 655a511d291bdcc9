"""`RecoveryEvent`: one failure and what the job did about it, as it lands in events.jsonl."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The phases of a recovery, in order; their seconds add up to `RecoveryEvent.seconds`.
PHASES = ("detect", "replace", "reform", "transfer", "resume")


@dataclass
class RecoveryEvent:
    """A failure and its recovery.

    ``seconds`` runs from the failure (the kill, when it was injected; otherwise the start
    of the failed step) to the first step committed after recovery, and ``breakdown``
    splits it into `PHASES`: detect (failure -> the controller knows who is lost),
    replace (replacement workers started and built), reform (the new generation's
    process groups formed), transfer (state copied into the rebuilt workers), resume
    (recovery done -> the next step committed, which includes re-running the step that
    failed).
    """

    step: int
    """The first uncommitted step when the failure struck (the step that was abandoned)."""
    generation: int
    """The generation formed by the recovery."""
    cause: str
    """What happened: ``killed``, ``hung``, ``node lost``, ``communication error``..."""
    lost: list[tuple[int, int]]
    """(stage, replica) of every lost worker."""
    strategy: str
    """The strategies used, e.g. ``replica_copy``."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    """Per rebuilt worker: ``{"worker": (stage, replica), "strategy": ..., "sources": [...]}``."""
    seconds: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0
    """State bytes copied between workers."""
    lost_steps: int = 0
    """Committed steps that had to be redone (0 for exact recovery from live replicas)."""
    time: float = 0.0
    """When the failure struck, in seconds since training started (for plots)."""
    tier: str | None = None
    """For rollbacks: the snapshot tier restored from."""
    detail: str = ""
    """The errors the workers reported, and the plan, for the record."""
    interruptions: list[str] = field(default_factory=list)
    """Failures during this recovery, each of which sent it back to planning with more
    workers lost (``"<phase>: <what failed>"``)."""
    corrupted: list[dict[str, Any]] = field(default_factory=list)
    """Cause ``corrupted``: per worker outside its stage group's fingerprint majority,
    ``{"worker": (stage, replica), "tensors": [names whose digest differs], "majority":
    True}``; with ``"majority": False``, every worker of a stage group that disagreed
    without a majority (two replicas, or a tie), and the tensors they disagree on."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Cause ``straggler``: per worker replaced for being slow, ``{"worker": (stage,
    replica), "ratio": its compute time over the median of its stage's other replicas',
    over the detection window}`` (see docs/stragglers.md)."""
    transfers_corrupted: list[dict[str, Any]] = field(default_factory=list)
    """State that arrived corrupted during this recovery and was never used (see [Note:
    checked transfers] in recovery/transport/process_group.py): ``{"target": (stage,
    replica), "source": (stage, replica), "tensors": [names], "snapshot": step of a peer
    snapshot, or None for a live worker's state}``. The recovery then went on from another
    source."""
    embedding: dict[str, float] | None = None
    """Embedding tables (a restore from a shard mirror): ``rows_exact``, ``rows_stale``,
    ``lost_samples`` (samples whose updates were lost), ``pls_event`` (those over the
    samples trained) and ``pls_job`` (the job's portion of lost samples after this event)."""

    def __post_init__(self) -> None:
        # Plain strings, not `Strategy`/`Tier`/`FailureCause` members: an event is data
        # (JSON, and `torch.load(weights_only=True)` of a saved result must not need our
        # classes).
        self.cause = f"{self.cause}"
        self.strategy = f"{self.strategy}"
        self.tier = None if self.tier is None else f"{self.tier}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary_row(self) -> list[str]:
        lost = " ".join(f"({s},{r})" for s, r in self.lost)
        b = self.breakdown
        return [
            str(self.step),
            self.cause,
            lost,
            self.strategy,
            f"{self.seconds:.2f}",
            " ".join(f"{k[:3]} {b.get(k, 0.0):.2f}" for k in PHASES),
            f"{self.bytes_moved / 1e6:.1f}",
            str(self.lost_steps),
        ]


SUMMARY_HEADERS = [
    "step",
    "cause",
    "lost",
    "strategy",
    "seconds",
    "breakdown (s)",
    "MB moved",
    "lost steps",
]


def summary_table(events: list[RecoveryEvent]) -> str:
    """A plain-text table of recoveries, for the end of a run."""
    if not events:
        return "no failures"
    rows = [e.summary_row() for e in events]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(SUMMARY_HEADERS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*SUMMARY_HEADERS), fmt.format(*("-" * w for w in widths))]
        + [fmt.format(*r) for r in rows]
    )
