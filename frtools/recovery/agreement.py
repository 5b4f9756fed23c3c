"""One agreement through the job's store: the survivors of an incident settle on one Decision.

Keys, under ``<FRTOOLS_STORE_PREFIX>recovery/<attempt>/<key>/`` (``attempt``: torchelastic's
restart count, so a restarted job never reads its previous life's keys; ``key``: ``fail/<n>``
for the n-th membership change of this life, ``check/<k>`` for the k-th straggler check):

* ``t0`` — when the first rank asked (ns; the first ``compare_set`` wins). Every rank's
  frtools thread watches for it and answers with its summary, so a rank whose main thread is
  hung elsewhere still speaks.
* ``summary/<launch rank>`` — that rank's summary (``formats.summary``, JSON); ``count``
  counts them.
* ``leader`` — the launch rank that decides (the first ``compare_set`` among the ranks that
  detected the incident). It waits until every member has published or ``t0`` +
  ``summary_window_s``, diagnoses what it has, and writes:
* ``decision`` — the Decision (the first ``compare_set`` wins: a rank that waited
  ``decision_timeout_s`` in vain decides itself, and the job still ends with one decision).
* ``handle/<launch rank>`` — reconfigure handles of the survivors (Gloo).

The store is the job's own TCPStore, which has no authentication: nothing read here chooses a
path, and every value is checked before use.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from frtools.recovery.decision import Decision


def _text(raw: Any) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


class Agreement:
    """The store side of one agreement, as seen by one rank (``me``: its launch rank)."""

    def __init__(
        self, store: Any, base: str, me: int, members: Sequence[int], poll_s: float = 0.05
    ) -> None:
        self.store = store
        self.base = base.rstrip("/") + "/"
        self.me = me
        self.members = list(members)
        self.poll_s = poll_s

    def key(self, name: str) -> str:
        return self.base + name

    # -- joining ---------------------------------------------------------------------------

    def started(self) -> bool:
        return bool(self.store.check([self.key("t0")]))

    def start(self) -> int:
        """Say the agreement has begun (the first caller's time stays); returns ``t0``."""
        now = str(time.time_ns())
        won = _text(self.store.compare_set(self.key("t0"), "", now))
        return int(won) if won.isdigit() else time.time_ns()

    def t0(self) -> int | None:
        if not self.started():
            return None
        raw = _text(self.store.get(self.key("t0")))
        return int(raw) if raw.isdigit() else None

    def publish(self, summary: bytes) -> None:
        """This rank's summary (a later one replaces an earlier one of the same rank)."""
        key = self.key(f"summary/{self.me}")
        fresh = not self.store.check([key])
        self.store.set(key, summary)
        if fresh:
            self.store.add(self.key("count"), 1)

    def has_published(self, rank: int | None = None) -> bool:
        return bool(self.store.check([self.key(f"summary/{self.me if rank is None else rank}")]))

    def claim_lead(self) -> bool:
        """True for the one rank that decides (the first to ask)."""
        won = _text(self.store.compare_set(self.key("leader"), "", str(self.me)))
        return won == str(self.me)

    def leader(self) -> int | None:
        if not self.store.check([self.key("leader")]):
            return None
        raw = _text(self.store.get(self.key("leader")))
        return int(raw) if raw.isdigit() else None

    # -- the leader ------------------------------------------------------------------------

    def collect(self, deadline_ns: int) -> dict[int, bytes]:
        """The members' summaries, waiting until every member has published or the deadline
        (wall clock, ns) has passed."""
        count = self.key("count")
        while time.time_ns() < deadline_ns:
            if int(self.store.add(count, 0)) >= len(self.members):
                break
            time.sleep(self.poll_s)
        found: dict[int, bytes] = {}
        for m in self.members:
            key = self.key(f"summary/{m}")
            if self.store.check([key]):
                found[m] = bytes(self.store.get(key))
        return found

    def settle(self, decision: Decision) -> Decision:
        """Write ``decision`` unless one is there already; returns the one that stands
        (a value there that is not a decision of this agreement: ValueError)."""
        won = Decision.from_json(
            self.store.compare_set(self.key("decision"), "", decision.to_json())
        )
        if not self.base.endswith(f"/{won.key}/"):
            raise ValueError(f"the decision in the store is for {won.key!r}")
        return won

    # -- everyone --------------------------------------------------------------------------

    def decision(self) -> Decision | None:
        """The decision, if written (None also for a value that is not a valid decision)."""
        key = self.key("decision")
        if not self.store.check([key]):
            return None
        try:
            decision = Decision.from_json(self.store.get(key))
        except (ValueError, TypeError, KeyError):
            return None
        return decision if self.base.endswith(f"/{decision.key}/") else None

    def wait_decision(
        self, deadline_ns: int, stop: Callable[[], bool] | None = None
    ) -> Decision | None:
        while True:
            decision = self.decision()
            if decision is not None or time.time_ns() >= deadline_ns:
                return decision
            if stop is not None and stop():
                return None
            time.sleep(self.poll_s)

    def exchange(self, name: str, value: str, ranks: Sequence[int], deadline_ns: int) -> list[str]:
        """Publish this rank's ``value`` under ``name/<me>`` and return every rank's in the
        order of ``ranks`` (waiting for them until the deadline; TimeoutError after)."""
        self.store.set(self.key(f"{name}/{self.me}"), value)
        keys = [self.key(f"{name}/{r}") for r in ranks]
        while not self.store.check(keys):
            if time.time_ns() >= deadline_ns:
                late = [r for r, k in zip(ranks, keys, strict=True) if not self.store.check([k])]
                raise TimeoutError(f"ranks {late} did not publish their {name} in time")
            time.sleep(self.poll_s)
        return [_text(self.store.get(k)) for k in keys]

    def forget_summary(self) -> None:
        """Delete this rank's summary (straggler checks run often: keep the store small)."""
        with contextlib.suppress(Exception):
            self.store.delete_key(self.key(f"summary/{self.me}"))
