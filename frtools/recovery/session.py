"""``Recovery``: one per training process; agrees with the other ranks on a verdict and drops
the guilty ranks from the default group (see ``frtools.recovery`` for the whole story)."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import frtools.recorder
from frtools.config import STORE_PREFIX
from frtools.formats.blackbox import read_header
from frtools.formats.store_protocol import unwrap_store
from frtools.recorder import private
from frtools.recorder.jobwide import default_dump_dir
from frtools.recorder.shutdown import before_finalization
from frtools.recovery import membership
from frtools.recovery.agreement import Agreement, Guard, job_secret
from frtools.recovery.decision import (
    DROP,
    Decision,
    decide,
    disagreement,
    same_outcome,
    verdict_from_summaries,
)
from frtools.recovery.incident import Incident, access, incident_dir, write, write_file
from frtools.recovery.local import (
    Eras,
    last_completed_ns,
    oldest_pending_ns,
    stall_since,
    summary_bytes,
)
from frtools.recovery.policy import Policy

# the group timeout when neither the policy nor the recorder's stall threshold gives one
DEFAULT_GROUP_TIMEOUT_S = 60.0


class RecoveryUnavailable(RuntimeError):
    """This process cannot recover by dropping ranks (torch < 2.15, no recorder, a backend
    that can neither shrink nor reconfigure); the message says which."""


class RecoveryFailed(RuntimeError):
    """The job cannot go on without its guilty ranks: no usable verdict, a verdict the
    policy does not act on (``decision.reason``), or the rebuild of the group failed.
    Every rank of the agreement gets the same decision, so all of them raise this."""

    def __init__(self, message: str, decision: Decision | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class Excluded(Exception):  # noqa: N818 - what happened to the rank, not an error of it
    """This rank was dropped from the job: its process should leave (exit 0 under torchrun,
    where a failing worker stops the whole job)."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(f"rank dropped from the job by recovery {decision.key}: {decision.reason}")
        self.decision = decision


def _clone(store: Any) -> Any:
    clone = getattr(store, "clone", None)
    if clone is not None:
        try:
            return clone()
        except Exception:
            pass
    return store


def _say(line: str) -> None:
    print(f"frtools: {line}", file=sys.stderr, flush=True)


class Recovery:
    """Recovery that drops the guilty rank(s) and lets the others train on.

    Create it on every rank, right after ``init_process_group`` (it is collective: a barrier
    under the init timeout, then the group timeout is shortened to ``group_timeout_s`` —
    the hang detector on Gloo). Then, in the training loop, ``recover(exc)`` when a
    collective raised; ``after_step(step)`` at the end of each step for straggler checks
    and to learn early that this rank was dropped.
    """

    def __init__(self, policy: Policy | None = None, *, store: Any = None) -> None:
        reason = membership.unavailable_reason()
        if reason:
            raise RecoveryUnavailable(reason)
        box_path = frtools.recorder.output_path()
        if not box_path:
            raise RecoveryUnavailable(
                "frtools.recovery needs the recorder: call frtools.recorder.enable() before "
                "init_process_group (or run under `frtools run`)"
            )
        self.policy = policy or Policy()
        self.box_path = box_path
        self.launch_rank = dist.get_rank()
        self.members: list[int] = list(range(dist.get_world_size()))
        self.eras = Eras(self.members)
        self.generation = 0  # membership changes so far
        self.checks = 0  # straggler checks so far
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.base = f"{STORE_PREFIX.read()}recovery/{self.attempt}/"
        raw = unwrap_store(store if store is not None else c10d._get_default_store())
        self.store = raw
        self._watch_store = _clone(raw)
        self.dump_dir = default_dump_dir(box_path)
        self.group_timeout_s = self.policy.group_timeout_s or self._stall_seconds()
        self.method = membership.method()
        self.excluded: Decision | None = None
        self.incidents: list[Incident] = []
        self._lock = threading.Lock()
        # agreements this rank answered: key -> (the agreement's asks then, when)
        self._published: dict[str, tuple[int, float]] = {}
        self._publishing = threading.Lock()  # the main thread's summary replaces the watcher's
        self._leading: set[str] = set()  # agreements this process leads
        self._told: set[str] = set()
        self._stop = threading.Event()
        # what this process trusts in the store (FRTOOLS_JOB_SECRET), each refusal said once
        self.guard = Guard(job_secret(), who=f"rank {self.launch_rank}: ")
        self._recovering = False  # the main thread is in recover(): its collective failed
        self._drop_seen: dict[str, int] = {}  # decisions dropping this rank: first seen (ns)
        self._streak: dict[str, int] = {}  # the last straggler check's streak
        # start-up skew is absorbed under the init timeout; from now on a collective that
        # waits longer than the group timeout fails, and that is how a hang is noticed
        dist.barrier()
        membership.set_group_timeout(self.group_timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="frtools-recovery", daemon=True)
        self._watcher.start()
        before_finalization(self.close)

    # -- state -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank in the current group (after a recovery: renumbered)."""
        return self.members.index(self.launch_rank) if self.launch_rank in self.members else -1

    @property
    def world_size(self) -> int:
        return len(self.members)

    def _stall_seconds(self) -> float:
        try:
            value = float(read_header(self.box_path)["stall_seconds"])
        except (OSError, ValueError, KeyError):
            value = 0.0
        return value if value > 0 else DEFAULT_GROUP_TIMEOUT_S

    def _agreement(self, key: str, store: Any = None) -> Agreement:
        poll = min(0.05, self.policy.poll_s)
        return Agreement(store or self.store, self.base + key, self.launch_rank, self.members,
                         poll, guard=self.guard)  # fmt: skip

    # -- checking a decision read from the store -------------------------------------------

    def _rule(
        self, ag: Agreement, key: str, trigger: str, leader: int, summaries: dict[int, bytes],
        folder: str | os.PathLike[str], write: Any = None,
    ) -> Decision:  # fmt: skip
        """The one rule every rank runs: these summaries -> the decision (the leader to make
        it, every other rank to check it)."""
        verdict, used, notes = verdict_from_summaries(summaries, ag.members, folder, write)
        streak = None
        if trigger == "straggler check":
            named = set()
            if verdict is not None and verdict.kind == "straggler":
                named = {str(ag.members[r]) for r in verdict.guilty_ranks if r < len(ag.members)}
            streak = {r: self._streak.get(r, 0) + 1 for r in named}
        return decide(
            verdict, key=key, trigger=trigger, leader=leader, members=ag.members,
            published=used, policy=self.policy, streak=streak, notes=notes,
            evidence={r: ag.evidence.get(r, 0) for r in summaries} if ag.evidence else None,
        )  # fmt: skip

    def _checker(self, ag: Agreement, trigger: str) -> Any:
        """``check(decision)`` for decisions of ``ag``: the reason this rank does not take
        it (not this job's members, beyond the policy, or not what the evidence it names
        gives by ``_rule``), None when it does."""

        def check(decision: Decision) -> str | None:
            reason = disagreement(decision, members=ag.members, policy=self.policy)
            if reason is not None:
                return reason
            summaries = ag.evidence_of(decision)
            if summaries is None or (decision.published and not decision.evidence):
                return "the evidence it names is not in the store"
            again = Agreement(ag.store, ag.base, ag.me, ag.members, ag.poll_s, ag.guard)
            again.evidence = {int(r): v for r, v in decision.evidence.items()}
            with tempfile.TemporaryDirectory(prefix="frtools-check-") as tmp:
                mine = self._rule(again, decision.key, trigger, decision.leader, summaries, tmp)
            return same_outcome(decision, mine)

        return check

    def _may_leave(self, decision: Decision) -> bool:
        """A decision that drops this rank is acted on only where this rank itself is in
        trouble: its collective failed (``recover``), or none completed for a group
        timeout. A rank whose collectives complete stays, and says so once."""
        if self._recovering:
            return True
        now = time.time_ns()
        seen = self._drop_seen.setdefault(decision.key, now)
        with self._lock:
            era_start = self.eras.current.first_record_id
        last = last_completed_ns(self.box_path, era_start)
        if last is None or now - last >= self.group_timeout_s * 1e9:
            return True
        if last > seen:  # it completed a collective after it was told to leave
            self.guard.warn(
                "stay " + decision.key,
                f"a decision in the store drops this rank ({decision.reason}) while its "
                "collectives complete; ignored, not leaving",
            )
        return False

    def _summary(self, **kw: Any) -> bytes:
        # Python stacks only from frtools' own thread: there they show where the main thread
        # stands; taken by the main thread inside recover() they would show recover()
        stacks = threading.current_thread() is not threading.main_thread()
        return summary_bytes(
            self.box_path, self.eras, self.launch_rank, window=self.policy.window,
            stacks=stacks, **kw,
        )  # fmt: skip

    def close(self) -> None:
        """Stop frtools' recovery thread (at exit it is stopped by itself)."""
        self._stop.set()
        w = self._watcher
        if w.is_alive() and w is not threading.current_thread():
            # it may be leading an agreement: killed in a store call at exit, we would abort
            w.join(timeout=self.policy.summary_window_s + 5.0)

    # -- the watcher thread ----------------------------------------------------------------

    def _watch(self) -> None:
        failures = 0
        while not self._stop.wait(self.policy.poll_s):
            try:
                self._watch_once()
                failures = 0
            except Exception as exc:  # never hurt the job; a store gone ends the watch
                failures += 1
                if failures == 1 and not self._stop.is_set():
                    _say(f"rank {self.launch_rank}: recovery watcher: {type(exc).__name__}: {exc}")
                if failures >= 20:
                    return

    def _watch_once(self) -> None:
        if self.excluded is not None:
            return
        with self._lock:
            key = f"fail/{self.generation + 1}"
            era_start = self.eras.current.first_record_id
        ag = self._agreement(key, self._watch_store)
        if ag.started():
            with self._publishing:
                asks = ag.asks()
                answered, when = self._published.get(key, (-1, -1.0))
                # answer: this rank's record as it stands; again when a rank asked again
                # (at most once a second: the counter is anyone's to bump)
                again = asks != answered and not self._recovering  # recover() said more
                if (key not in self._published or again) and time.monotonic() - when >= 1.0:
                    self._published[key] = (asks, time.monotonic())
                    ag.publish(self._summary(stalled=stall_since(self.box_path, era_start)))
            decision = ag.decision()
            if decision is not None and self.launch_rank in decision.drop:
                decision = ag.decision(self._checker(ag, "failure"))
                if decision is not None and self._may_leave(decision):
                    self._on_excluded(decision)
            return
        if stall_since(self.box_path, era_start):
            # this rank's watchdog sees a hang: ask everybody, and decide if first to ask
            joined = time.time_ns()
            ag.start()
            with self._publishing:
                self._published[key] = (ag.ask(), time.monotonic())
                ag.publish(self._summary(stalled=True))
            if key not in self._leading and ag.claim_lead():
                self._leading.add(key)
                self._lead(ag, key, "stall", joined)

    def _on_excluded(self, decision: Decision) -> None:
        if decision.key in self._told:
            return
        self._told.add(decision.key)
        self.excluded = decision
        _say(
            f"rank {self.launch_rank}: dropped from the job ({decision.reason}); "
            + ("leaving now" if self.policy.exit_when_excluded else "leave when you can")
        )
        incident = Incident(
            key=decision.key, trigger=decision.trigger, rank=self.launch_rank,
            new_rank=None, world_size_before=len(decision.members_before),
            world_size_after=len(decision.members_after), dropped=decision.drop,
            dropped_hosts=decision.hosts, kind=decision.kind, headline=decision.headline,
            leader=decision.leader, method=None, decided_ns=decision.decided_ns,
            decision=decision,
        )  # fmt: skip
        self._record(incident)
        if self.policy.exit_when_excluded:
            os._exit(self.policy.excluded_exit_code)

    def _record(self, incident: Incident) -> Path | None:
        """Write the verdict and this rank's incident record; never fails the recovery."""
        try:
            directory = incident_dir(self.dump_dir, self.attempt, incident.key)
            write(incident, directory)
            return directory
        except Exception as exc:
            _say(f"rank {self.launch_rank}: incident record not written: {exc}")
            return None

    # -- deciding --------------------------------------------------------------------------

    def _lead(self, ag: Agreement, key: str, trigger: str, joined: int) -> Decision:
        """Collect the summaries, diagnose them, settle the decision (the first valid one
        written wins). The window counts from when this rank joined, not from ``t0``: a
        ``t0`` another client planted must not cut it short."""
        deadline = joined + int(self.policy.summary_window_s * 1e9)
        summaries = ag.collect(deadline, since_ns=joined)
        try:  # the evidence stays in the incident folder ...
            folder = incident_dir(self.dump_dir, self.attempt, key) / "summaries"
            private.prepare_dump_dir(str(folder), access(), named=False)
        except OSError as exc:  # ... unless it cannot be written: the decision comes first
            _say(f"rank {self.launch_rank}: no incident folder ({exc}); summaries not kept")
            folder = Path(tempfile.mkdtemp(prefix="frtools-recovery-"))
        decision = self._rule(ag, key, "failure", self.launch_rank, summaries, folder, write_file)
        decision.trigger = trigger
        self.guard.checked(decision.to_json().encode(), lambda: None)  # ours: no need to redo
        return ag.settle(decision, self._checker(ag, "failure"))

    def recover(self, error: BaseException | str | None = None) -> Incident:
        """Call on every rank where a collective raised (a timeout, a peer gone): the ranks
        agree on one verdict through the store, the guilty ranks are dropped and the group
        is rebuilt on the others. Returns this rank's ``Incident``; training goes on with
        ``dist.get_rank()`` / ``get_world_size()`` of the new group (re-broadcast state,
        redo the step). Raises ``Excluded`` on a dropped rank and ``RecoveryFailed`` when the
        job cannot go on without them."""
        if self.excluded is not None:
            raise Excluded(self.excluded)
        detected = time.time_ns()
        with self._lock:
            key = f"fail/{self.generation + 1}"
            era_start = self.eras.current.first_record_id
        text = None if error is None else (str(error) or type(error).__name__)
        self._recovering = True
        try:
            return self._recover(key, era_start, text, detected)
        finally:
            self._recovering = False

    def _recover(self, key: str, era_start: int, text: str | None, detected: int) -> Incident:
        try:
            ag = self._agreement(key)
            check = self._checker(ag, "failure")
            onset = oldest_pending_ns(self.box_path, era_start)
            ag.start()
            with self._publishing:
                self._published[key] = (ag.ask(), time.monotonic())
                ag.publish(self._summary(failure=text or "collective failed"))
            decision = ag.decision(check)
            if decision is None and key not in self._leading and ag.claim_lead():
                self._leading.add(key)
                decision = self._lead(ag, key, "failure", detected)
            if decision is None:
                wait = self.policy.summary_window_s + self.policy.decision_timeout_s
                decision = ag.wait_decision(detected + int(wait * 1e9), check=check)
            if decision is None:  # the leader went silent: decide here (one decision wins)
                decision = self._lead(ag, key, "failure", detected)
        except (OSError, RuntimeError) as exc:  # the store is gone (its host died) ...
            raise RecoveryFailed(f"no agreement through the job's store: {exc}") from exc
        except Exception as exc:  # a bug of ours: say so, the job cannot go on
            raise RecoveryFailed(f"recovery failed: {type(exc).__name__}: {exc}") from exc
        return self._apply(decision, ag, "failure", text, onset, detected)

    def _apply(
        self,
        decision: Decision,
        ag: Agreement,
        trigger: str,
        error: str | None,
        onset: int | None,
        detected: int,
    ) -> Incident:
        incident = Incident(
            key=decision.key, trigger=trigger, rank=self.launch_rank, new_rank=None,
            world_size_before=len(decision.members_before),
            world_size_after=len(decision.members_after), dropped=decision.drop,
            dropped_hosts=decision.hosts, kind=decision.kind, headline=decision.headline,
            leader=decision.leader, method=self.method, error=error, onset_ns=onset,
            detected_ns=detected, decided_ns=decision.decided_ns, decision=decision,
        )  # fmt: skip
        if decision.action != DROP:
            self._record(incident)
            raise RecoveryFailed(f"recovery {decision.key}: {decision.reason}", decision)
        if self.launch_rank in decision.drop:
            self._on_excluded(decision)
            raise Excluded(decision)
        timeout_s = max(60.0, 3 * self.group_timeout_s)
        try:
            membership.rebuild(
                self.method or membership.RECONFIGURE, ag, decision.members_before,
                decision.members_after, uuid=self.generation + 1, timeout_s=timeout_s,
                deadline_ns=time.time_ns() + int(timeout_s * 1e9),
            )  # fmt: skip
            membership.set_group_timeout(self.group_timeout_s)
        except Exception as exc:
            self._record(incident)
            raise RecoveryFailed(f"rebuilding the group failed: {exc}", decision) from exc
        with self._lock:
            self.generation += 1
            self.members = list(decision.members_after)
            self.eras.begin(self.members, self.box_path)
        incident.resumed_ns = time.time_ns()
        incident.new_rank = self.rank
        directory = self._record(incident)
        self.incidents.append(incident)
        took = incident.seconds_to_recover
        _say(
            f"rank {self.launch_rank}: recovered without rank(s) {decision.drop} "
            f"({decision.kind}) in {took if took is not None else '?'} s; now rank "
            f"{self.rank} of {self.world_size}; record {directory}"
        )
        return incident

    # -- stragglers ------------------------------------------------------------------------

    def after_step(self, step: int) -> Incident | None:
        """Call at the end of every step on every rank. Raises ``Excluded`` once this rank
        was dropped. Every ``policy.straggler_check_every`` steps the ranks check for a
        straggler together (collective: every rank must call it at the same steps); with
        ``policy.drop_stragglers`` a rank named by ``straggler_checks`` checks in a row is
        dropped, and the Incident is returned (re-broadcast state as after ``recover``)."""
        if self.excluded is not None:
            raise Excluded(self.excluded)
        every = self.policy.straggler_check_every
        if not every or (step + 1) % every:
            return None
        detected = time.time_ns()
        self.checks += 1
        key = f"check/{self.checks}"
        if self.checks > 1:  # every rank is past the last check: its evidence may go
            self._agreement(f"check/{self.checks - 1}").forget_summary()
        ag = self._agreement(key)
        check = self._checker(ag, "straggler check")
        ag.start()
        ag.publish(self._summary())
        if ag.claim_lead():
            decision = self._check(ag, key, detected)
        else:
            wait = self.policy.summary_window_s + 2 * self.policy.decision_timeout_s
            decision = ag.wait_decision(detected + int(wait * 1e9), check=check)
            if decision is None:
                decision = self._check(ag, key, detected)
        self._streak = dict(decision.streak)
        if decision.action != DROP:
            return None
        return self._apply(decision, ag, "straggler check", None, None, detected)

    def _check(self, ag: Agreement, key: str, joined: int) -> Decision:
        summaries = ag.collect(joined + int(self.policy.decision_timeout_s * 1e9))
        with tempfile.TemporaryDirectory(prefix="frtools-check-") as tmp:
            decision = self._rule(ag, key, "straggler check", self.launch_rank, summaries, tmp)
            if decision.action == DROP:  # the evidence stays, unless it cannot be written
                try:
                    keep = incident_dir(self.dump_dir, self.attempt, key) / "summaries"
                    private.prepare_dump_dir(str(keep), access(), named=False)
                    for path in Path(tmp).iterdir():
                        write_file(keep / path.name, path.read_bytes())
                except OSError as exc:
                    _say(f"rank {self.launch_rank}: summaries of {key} not kept: {exc}")
        self.guard.checked(decision.to_json().encode(), lambda: None)  # ours: no need to redo
        return ag.settle(decision, self._checker(ag, "straggler check"))


def incident_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """Every incident record under a dump folder (``rank_<R>.incident.json``)."""
    return sorted(Path(directory).glob("recovery/*/rank_*.incident.json"))
