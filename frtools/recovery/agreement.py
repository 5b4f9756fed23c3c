"""One agreement through the job's store: the survivors of an incident settle on one Decision.

Keys, under ``<FRTOOLS_STORE_PREFIX>recovery/<attempt>/<key>/`` (``attempt``: torchelastic's
restart count, so a restarted job never reads its previous life's keys; ``key``: ``fail/<n>``
for the n-th membership change of this life, ``check/<k>`` for the k-th straggler check):

* ``t0`` — when the first rank asked (ns; the first ``compare_set`` wins). Every rank's
  frtools thread watches for it and answers with its summary, so a rank whose main thread is
  hung elsewhere still speaks. It only says "answer": no wait is measured from it.
* ``summary/<launch rank>/<n>`` — that rank's n-th summary of this agreement
  (``formats.summary``, JSON), never rewritten; ``summary/<launch rank>`` — its latest ``n``
  and when it was published (``<n>:<ns>``). A decision names the versions it used
  (``evidence``), so every rank can read them again.
* ``asks`` — how many times a rank asked (``add``): a rank's frtools thread answers again
  when it changes, so that an agreement begun earlier (a ``t0`` planted by another client)
  gets a summary of the rank as it is now.
* ``leader`` — the launch rank that decides (the first ``compare_set`` among the ranks that
  detected the incident). It waits until every member has published or its own
  ``summary_window_s`` has passed, diagnoses what it has, and writes:
* ``decision`` — the Decision (the first ``compare_set`` wins: a rank that waited
  ``decision_timeout_s`` in vain decides itself, and the job still ends with one decision).
* ``handle/<launch rank>`` — reconfigure handles of the survivors (Gloo).

The store is the job's own TCPStore, which has no authentication: anyone who reaches it can
write these keys. Nothing read here chooses a path, every value is checked before use, and a
value that fails the check is treated as absent (a ``leader`` or ``decision`` that fails it is
replaced, atomically, by this rank's own). With a job secret (``FRTOOLS_JOB_SECRET``) each
value is sealed (``Guard``): an HMAC-SHA256 of key name and value, so a value no rank of this
job wrote fails the check.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from frtools.config import JOB_SECRET, ConfigError
from frtools.recovery.decision import Decision

SEAL = b"frtools-mac1:"
# how often a rank replaces a forged leader or decision before it gives up (a store client
# that keeps writing them can delay a recovery, never choose it)
REPLACE_TRIES = 5
# the most summaries one rank publishes in one agreement (a version read back is checked)
MAX_VERSIONS = 1_000_000
# a summary published this long before the leader joined is not of this incident: the
# leader waits for a newer one (clocks of different hosts may differ by this much)
FRESH_SLACK_NS = 1_000_000_000


def _text(raw: Any) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def _bytes(raw: Any) -> bytes:
    if isinstance(raw, str):
        return raw.encode()
    return raw if isinstance(raw, bytes) else bytes(raw)


def _say(line: str) -> None:
    print(f"frtools: {line}", file=sys.stderr, flush=True)


def job_secret() -> bytes | None:
    """``FRTOOLS_JOB_SECRET`` as bytes; None when unset (or unusable: then unset, said once
    by the caller's config check)."""
    try:
        secret = JOB_SECRET.read()
    except ConfigError:
        return None
    return secret.encode() if secret else None


class Guard:
    """What one process trusts in the store: values sealed with the job's secret (when it
    has one), and each refusal said once. Shared by every agreement of a ``Recovery``, from
    the main thread and frtools' thread alike."""

    def __init__(
        self, secret: bytes | None = None, say: Callable[[str], None] = _say, who: str = ""
    ) -> None:
        self.secret = secret
        self.say = say
        self.who = who
        self._said: set[str] = set()
        self._checked: dict[bytes, str | None] = {}
        self._lock = threading.Lock()

    def _mac(self, key: str, value: bytes) -> bytes:
        assert self.secret is not None
        msg = key.encode() + b"\0" + value
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: bytes | str) -> bytes:
        data = value.encode() if isinstance(value, str) else value
        if self.secret is None:
            return data
        return SEAL + self._mac(key, data) + b":" + data

    def open(self, key: str, raw: Any) -> bytes | None:
        """The value a rank of this job wrote under ``key``; None (said once) for one it
        did not: no seal, or a seal that does not match."""
        data = _bytes(raw)
        if self.secret is None:
            return data
        if data.startswith(SEAL):
            mac, sep, value = data[len(SEAL) :].partition(b":")
            if sep and hmac.compare_digest(mac, self._mac(key, value)):
                return value
        self.warn(key, f"ignored an unauthenticated value of {key} (not sealed with this "
                       "job's FRTOOLS_JOB_SECRET)")  # fmt: skip
        return None

    def warn(self, topic: str, line: str) -> None:
        """``line`` on stderr, once per ``topic`` in this process."""
        with self._lock:
            if topic in self._said:
                return
            self._said.add(topic)
        self.say(f"{self.who}{line}")

    def checked(self, raw: bytes, check: Callable[[], str | None]) -> str | None:
        """``check()`` for a value, computed once per value (a rank polls the same one)."""
        digest = hashlib.sha256(raw).digest()
        with self._lock:
            if digest in self._checked:
                return self._checked[digest]
        reason = check()
        with self._lock:
            self._checked[digest] = reason
        return reason


class Agreement:
    """The store side of one agreement, as seen by one rank (``me``: its launch rank)."""

    def __init__(
        self,
        store: Any,
        base: str,
        me: int,
        members: Sequence[int],
        poll_s: float = 0.05,
        guard: Guard | None = None,
    ) -> None:
        self.store = store
        self.base = base.rstrip("/") + "/"
        self.me = me
        self.members = list(members)
        self.poll_s = poll_s
        self.guard = guard or Guard()
        self.evidence: dict[int, int] = {}  # the summary versions the last collect() read

    def key(self, name: str) -> str:
        return self.base + name

    def _read(self, name: str) -> bytes | None:
        """The value under ``name`` that this job wrote, or None."""
        key = self.key(name)
        if not self.store.check([key]):
            return None
        return self.guard.open(key, self.store.get(key))

    def _set(self, name: str, value: bytes | str) -> None:
        self.store.set(self.key(name), self.guard.seal(self.key(name), value))

    def _claim(self, name: str, value: str, valid: Callable[[bytes], bool]) -> bytes:
        """Write ``value`` under ``name`` unless a valid value is there; returns the value
        that stands. A value there that is not valid (forged, unauthenticated) is replaced
        atomically (``compare_set`` against it: of several ranks replacing it, one wins)."""
        key = self.key(name)
        sealed = self.guard.seal(key, value)
        expected: bytes | str = ""
        for _ in range(REPLACE_TRIES):
            raw = _bytes(self.store.compare_set(key, expected, sealed))
            opened = self.guard.open(key, raw)
            if opened is not None and valid(opened):
                return opened
            expected = raw
        raise RuntimeError(f"{key} is rewritten by someone outside this job; giving up")

    # -- joining ---------------------------------------------------------------------------

    def started(self) -> bool:
        raw = self._read("t0")
        return raw is not None and raw.isdigit()

    def start(self) -> int:
        """Say the agreement has begun (the first caller's time stays); returns ``t0``."""
        won = self._claim("t0", str(time.time_ns()), bytes.isdigit)
        return int(won)

    def t0(self) -> int | None:
        raw = self._read("t0")
        return int(raw) if raw is not None and raw.isdigit() else None

    def ask(self) -> int:
        """Say this rank asks now (its frtools thread and every other rank's answer anew)."""
        return int(self.store.add(self.key("asks"), 1))

    def asks(self) -> int:
        return int(self.store.add(self.key("asks"), 0))

    def publish(self, summary: bytes) -> None:
        """This rank's summary (a later one supersedes an earlier one of the same rank; the
        earlier stays readable for a decision that used it)."""
        latest = (self._pointer(self.me) or (0, 0))[0]
        self._set(f"summary/{self.me}/{latest + 1}", summary)
        self._set(f"summary/{self.me}", f"{latest + 1}:{time.time_ns()}")

    def _pointer(self, rank: int) -> tuple[int, int] | None:
        """(latest version, when it was published) of ``rank``'s summary."""
        raw = self._read(f"summary/{rank}")
        version, _, ns = (raw or b"").partition(b":")
        if not (version.isdigit() and ns.isdigit()) or not 0 < int(version) <= MAX_VERSIONS:
            return None
        return int(version), int(ns)

    def _version(self, rank: int) -> int | None:
        pointer = self._pointer(rank)
        return None if pointer is None else pointer[0]

    def summary(self, rank: int, version: int) -> bytes | None:
        """Version ``version`` of ``rank``'s summary, if this job wrote it."""
        if not 0 < version <= MAX_VERSIONS:
            return None
        return self._read(f"summary/{rank}/{version}")

    def has_published(self, rank: int | None = None) -> bool:
        return self._version(self.me if rank is None else rank) is not None

    def claim_lead(self) -> bool:
        """True for the one rank that decides (the first to ask; a leader that is not a
        member is no leader)."""
        won = self._claim("leader", str(self.me), self._is_member)
        return won == str(self.me).encode()

    def _is_member(self, raw: bytes) -> bool:
        return raw.isdigit() and int(raw) in self.members

    def leader(self) -> int | None:
        raw = self._read("leader")
        return int(raw) if raw is not None and self._is_member(raw) else None

    # -- the leader ------------------------------------------------------------------------

    def _latest(self, ranks: Sequence[int]) -> dict[int, tuple[int, int, bytes]]:
        """rank -> (version, published ns, summary) of the latest summary of each."""
        found = {}
        for m in ranks:
            pointer = self._pointer(m)
            raw = self.summary(m, pointer[0]) if pointer is not None else None
            if pointer is not None and raw is not None:
                found[m] = (*pointer, raw)
        return found

    def collect(self, deadline_ns: int, since_ns: int | None = None) -> dict[int, bytes]:
        """The members' summaries, waiting until every member has published (a summary
        published after ``since_ns``, when given) or the deadline (wall clock, ns) has
        passed. Only summaries this job wrote count (no counter another client could
        inflate); ``evidence`` says which versions were read."""
        since = None if since_ns is None else since_ns - FRESH_SLACK_NS
        fresh: set[int] = set()
        while True:
            waiting = [m for m in self.members if m not in fresh]
            fresh.update(
                m for m, (_, ns, _) in self._latest(waiting).items() if since is None or ns >= since
            )
            if len(fresh) >= len(self.members) or time.time_ns() >= deadline_ns:
                break
            time.sleep(self.poll_s)
        # each member's latest (a member may have published again while we waited)
        found = self._latest(self.members)
        self.evidence = {m: v for m, (v, _, _) in found.items()}
        return {m: raw for m, (_, _, raw) in found.items()}

    def evidence_of(self, decision: Decision) -> dict[int, bytes] | None:
        """The summaries a decision says it used, read again; None if any is not there."""
        out = {}
        for rank, version in decision.evidence.items():
            raw = self.summary(int(rank), version)
            if raw is None:
                return None
            out[int(rank)] = raw
        return out

    def settle(
        self, decision: Decision, check: Callable[[Decision], str | None] | None = None
    ) -> Decision:
        """Write ``decision`` unless a valid one is there already; returns the one that
        stands. A value there that is not a decision of this agreement, or that ``check``
        refuses (its reason said once), is replaced by ``decision``."""
        won = self._claim(
            "decision", decision.to_json(), lambda raw: self._valid(raw, check) is not None
        )
        return Decision.from_json(won)

    def _valid(self, raw: bytes, check: Callable[[Decision], str | None] | None) -> Decision | None:
        try:
            decision = Decision.from_json(raw)
        except (ValueError, TypeError, KeyError, AttributeError):
            self.guard.warn(self.key("decision") + "?", f"ignored {self.key('decision')}: "
                            "not a recovery decision")  # fmt: skip
            return None
        if not self.base.endswith(f"/{decision.key}/"):
            return None
        if check is not None:
            reason = self.guard.checked(raw, lambda: check(decision))
            if reason is not None:
                self.guard.warn(
                    self.key("decision") + "!" + reason,
                    f"ignored the decision in {self.key('decision')}: {reason}",
                )
                return None
        return decision

    # -- everyone --------------------------------------------------------------------------

    def decision(self, check: Callable[[Decision], str | None] | None = None) -> Decision | None:
        """The decision, if written and valid (None also for a value that is not a
        decision of this agreement or that ``check`` refuses)."""
        raw = self._read("decision")
        return None if raw is None else self._valid(raw, check)

    def wait_decision(
        self,
        deadline_ns: int,
        stop: Callable[[], bool] | None = None,
        check: Callable[[Decision], str | None] | None = None,
    ) -> Decision | None:
        while True:
            decision = self.decision(check)
            if decision is not None or time.time_ns() >= deadline_ns:
                return decision
            if stop is not None and stop():
                return None
            time.sleep(self.poll_s)

    def exchange(self, name: str, value: str, ranks: Sequence[int], deadline_ns: int) -> list[str]:
        """Publish this rank's ``value`` under ``name/<me>`` and return every rank's in the
        order of ``ranks`` (waiting for them until the deadline; TimeoutError after). Only
        values this job wrote count."""
        self._set(f"{name}/{self.me}", value)
        got: dict[int, str] = {}
        while True:
            for r in ranks:
                if r not in got:
                    raw = self._read(f"{name}/{r}")
                    if raw is not None:
                        got[r] = _text(raw)
            if len(got) == len(ranks):
                return [got[r] for r in ranks]
            if time.time_ns() >= deadline_ns:
                late = [r for r in ranks if r not in got]
                raise TimeoutError(f"ranks {late} did not publish their {name} in time")
            time.sleep(self.poll_s)

    def forget_summary(self) -> None:
        """Delete this rank's summaries (straggler checks run often: keep the store small)."""
        latest = self._version(self.me) or 0
        with contextlib.suppress(Exception):
            for v in range(1, latest + 1):
                self.store.delete_key(self.key(f"summary/{self.me}/{v}"))
            self.store.delete_key(self.key(f"summary/{self.me}"))
