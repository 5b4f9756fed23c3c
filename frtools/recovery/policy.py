"""What a recovery may do: which verdicts drop ranks, how many, how long each step may take."""

from __future__ import annotations

from dataclasses import dataclass

from frtools.analyze.verdict import EXCLUDE_KINDS
from frtools.formats.summary import DEFAULT_WINDOW


@dataclass(frozen=True)
class Policy:
    """The rules every rank of a job applies the same way (give every rank the same Policy).

    * ``drop_kinds``: verdict kinds whose guilty ranks are dropped: by default a rank that is
      dead, hung elsewhere (``missing``) or stuck in a collective the others got past
      (``stuck``) — the faults of one machine. A ``mismatch`` or an ``order`` verdict is a
      bug in the program: dropping a rank would not fix it, so recovery fails instead.
    * ``max_drop_fraction``: never drop more than this share of the current members at once
      (a verdict that blames half the job is not "one bad GPU"); ``min_world_size``: never go
      below this many survivors.
    * ``group_timeout_s``: how long a collective may wait before it fails (on Gloo the only
      way to release the survivors of a hang); None: the recorder's stall threshold
      (``FRTOOLS_STALL_SECONDS``), so that "hung" means the same thing to both.
    * ``summary_window_s``: how long after the first rank asked the leader waits for the
      others' summaries (it goes on as soon as every member's is in);
      ``decision_timeout_s``: how long a rank waits for the leader's decision before it
      decides itself (the first decision written wins either way).
    * ``poll_s``: how often each rank looks at the store for an agreement it should join.
    * ``window``: ops per rank summary (``formats.summary.DEFAULT_WINDOW``).
    * Stragglers: ``straggler_check_every`` steps (0: never) ``Recovery.after_step`` runs a
      job-wide check; with ``drop_stragglers``, a rank named straggler by
      ``straggler_checks`` checks in a row is dropped through the same path. Never by
      default.
    * ``exit_when_excluded``: a dropped rank's process leaves with ``excluded_exit_code`` as
      soon as it learns it was dropped, from frtools' thread, whatever its main thread is
      doing (a hung rank cannot leave otherwise; under torchrun a non-zero code would stop
      the whole job). Otherwise it learns it at its next ``recover`` / ``after_step``
      (``Excluded`` is raised) and the launcher must stop it.
    """

    drop_kinds: tuple[str, ...] = EXCLUDE_KINDS
    max_drop_fraction: float = 0.5
    min_world_size: int = 1
    group_timeout_s: float | None = None
    summary_window_s: float = 2.0
    decision_timeout_s: float = 20.0
    poll_s: float = 0.1
    window: int = DEFAULT_WINDOW
    straggler_check_every: int = 0
    straggler_checks: int = 3
    drop_stragglers: bool = False
    exit_when_excluded: bool = False
    excluded_exit_code: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.max_drop_fraction <= 1:
            raise ValueError("max_drop_fraction must be in (0, 1]")
        if self.min_world_size < 1:
            raise ValueError("min_world_size must be at least 1")
        if self.group_timeout_s is not None and self.group_timeout_s <= 0:
            raise ValueError("group_timeout_s must be positive")
        if self.summary_window_s < 0 or self.decision_timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError("summary_window_s, decision_timeout_s and poll_s must be positive")
        if self.straggler_check_every < 0 or self.straggler_checks < 1:
            raise ValueError("straggler_check_every >= 0 and straggler_checks >= 1")

    def may_drop(self, kind: str) -> bool:
        return kind in self.drop_kinds or (kind == "straggler" and self.drop_stragglers)
