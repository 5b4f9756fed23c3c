"""From the ranks' summaries to the one Decision every survivor acts on.

The leader writes the summaries it received into a folder, reads them back as the analyzer
reads any dump folder (``load_trace``) and runs the diagnosis (``diagnose``): the verdict a
recovery acts on is the verdict ``frtools analyze`` gives for that folder. ``decide`` turns
the verdict into an action under the ``Policy``.

Two numberings meet here. Ranks in a verdict are the ranks of the *current* group (after a
recovery the survivors are renumbered 0..n-1, as torch numbers them). A decision names ranks
by their *launch rank* (``RANK`` at start), which never changes: ``members[i]`` is the launch
rank of current rank ``i``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import UnusableInput, load_trace
from frtools.analyze.verdict import Verdict
from frtools.formats.summary import MAX_RANK_BYTES, SummaryError, decode, file_name
from frtools.recovery.policy import Policy

DECISION_FORMAT = "frtools-recovery-decision"
DROP, NONE = "drop", "none"
# an agreement's key: it names the incident's folder, so a decision read back must match it
KEY = re.compile(r"(fail|check)/[0-9]{1,9}")


@dataclass
class Decision:
    """What the survivors of one incident agreed on. Ranks are launch ranks."""

    key: str  # the agreement it settles: "fail/1", "check/12"
    trigger: str  # "failure", "stall", "straggler check"
    leader: int
    decided_ns: int
    members_before: list[int]
    drop: list[int]
    members_after: list[int]
    action: str  # DROP or NONE
    reason: str
    kind: str  # the verdict's kind ("" when there was none)
    headline: str
    guilty: list[int]
    hosts: list[str]  # the dropped ranks' hosts, where known
    published: list[int]  # whose summaries the verdict used
    verdict: dict[str, Any] | None = None  # Verdict.to_document(), ranks in current numbering
    streak: dict[str, int] = field(default_factory=dict)  # straggler checks: rank -> checks
    # the summaries it was decided from: launch rank -> version (``Agreement.collect``), so
    # that every rank can read them again and check that the decision follows from them
    evidence: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": DECISION_FORMAT, **asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Decision:
        """A decision read back from the store (written by a rank of this job; still checked,
        since the store is not authenticated: a bad value raises ValueError)."""
        doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        if not isinstance(doc, dict) or doc.pop("format", None) != DECISION_FORMAT:
            raise ValueError("not a recovery decision")
        d = cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})
        ints = (d.members_before, d.drop, d.members_after, d.guilty, d.published)
        if not all(isinstance(x, list) and all(type(r) is int for r in x) for x in ints):
            raise ValueError("a recovery decision's rank lists are not lists of ints")
        if d.action not in (DROP, NONE) or not set(d.members_after) <= set(d.members_before):
            raise ValueError("a recovery decision that keeps ranks it did not have")
        if not isinstance(d.key, str) or not KEY.fullmatch(d.key):
            raise ValueError("a recovery decision for no agreement of ours")
        maps = (d.streak, d.evidence)
        if not all(
            isinstance(x, dict) and all(k.isdigit() and type(v) is int for k, v in x.items())
            for x in maps
        ):
            raise ValueError("a recovery decision's streak or evidence is not rank -> int")
        if type(d.leader) is not int or not isinstance(d.kind, str):
            raise ValueError("a recovery decision's leader or kind is not of its type")
        return d

    def outcome(self) -> tuple[Any, ...]:
        """What a rank acts on: two decisions with the same outcome do the same thing."""
        return (self.key, self.action, self.drop, self.members_after, self.kind, self.guilty,
                self.published, self.streak)  # fmt: skip


def disagreement(decision: Decision, *, members: Sequence[int], policy: Policy) -> str | None:
    """Why ``decision`` cannot be one of this job's, as a rank with these ``members`` (launch
    ranks, in rank order) and this ``policy`` sees it; None when it can. A store client
    outside the job can write any decision: this is what a rank checks before it reads the
    evidence again (``same_outcome``)."""
    members = list(members)
    if decision.members_before != members:
        return f"its members {decision.members_before} are not this job's {members}"
    if decision.leader not in members:
        return f"its leader {decision.leader} is not a member"
    named = set(decision.drop) | set(decision.published) | {int(r) for r in decision.evidence}
    if not named <= set(members):
        return f"it names ranks that are not members: {sorted(named - set(members))}"
    if decision.members_after != [m for m in members if m not in decision.drop]:
        return "its members after are not the members without the dropped ones"
    if decision.action == NONE and decision.drop:
        return "it drops ranks with no action"
    if decision.drop and len(decision.drop) > policy.max_drop_fraction * len(members):
        return f"it drops {len(decision.drop)} of {len(members)} ranks (max_drop_fraction)"
    if decision.drop and len(decision.members_after) < policy.min_world_size:
        return f"it leaves {len(decision.members_after)} ranks (min_world_size)"
    if decision.action == DROP and not decision.drop:
        return "it drops no rank"
    return None


def same_outcome(published: Decision, recomputed: Decision) -> str | None:
    """None when the decision read from the store is the one this rank computes from its
    evidence by the same rule, else what differs."""
    if published.outcome() == recomputed.outcome():
        return None
    return (
        f"it does not follow from the evidence (it drops {published.drop}, the evidence "
        f"drops {recomputed.drop})"
    )


def verdict_from_summaries(
    summaries: Mapping[int, bytes],
    members: Sequence[int],
    directory: str | os.PathLike[str],
    write: Callable[[Path, bytes], None] | None = None,
) -> tuple[Verdict | None, list[int], list[str]]:
    """Diagnose the summaries of an agreement (launch rank -> encoded summary).

    Each summary must speak for its sender's current rank; the usable ones are written into
    ``directory`` (``rank_<R>.summary.json``) and diagnosed as a dump folder of
    ``len(members)`` ranks: members without a usable summary have no record. Returns the
    verdict (None when no summary was usable), the launch ranks used, and notes on the ones
    refused. ``write(path, data)`` writes a file (default: a plain write); ``directory``
    must exist."""
    out = Path(directory)
    used, notes = [], []
    for current, launch in enumerate(members):
        raw = summaries.get(launch)
        if raw is None:
            continue
        if len(raw) > MAX_RANK_BYTES:
            notes.append(f"rank {launch}: summary of {len(raw)} bytes refused")
            continue
        try:
            (summary,) = decode(raw)
        except (SummaryError, ValueError) as e:
            notes.append(f"rank {launch}: summary refused: {e}")
            continue
        if summary.rank != current:
            notes.append(f"rank {launch}: summary speaks for rank {summary.rank}, not {current}")
            continue
        path = out / file_name(current)
        if write is not None:
            write(path, raw)
        else:
            path.write_bytes(raw)
        used.append(launch)
    if not used:
        return None, used, notes
    try:
        trace = load_trace(out, world_size=len(members))
    except UnusableInput as e:
        notes.append(str(e))
        return None, [], notes
    return diagnose(trace), used, notes


def decide(
    verdict: Verdict | None,
    *,
    key: str,
    trigger: str,
    leader: int,
    members: Sequence[int],
    published: Sequence[int],
    policy: Policy,
    streak: Mapping[str, int] | None = None,
    notes: Sequence[str] = (),
    evidence: Mapping[int, int] | None = None,
) -> Decision:
    """The decision for this verdict under ``policy``: drop its guilty ranks when its kind
    allows it and the rest of the policy agrees, else nothing (``action`` "none", with the
    reason). ``streak``: for straggler checks, how many checks in a row named each rank
    (this one included); ``evidence``: the summary versions it comes from."""
    members = list(members)
    base = dict(
        key=key,
        trigger=trigger,
        leader=leader,
        decided_ns=time.time_ns(),
        members_before=members,
        published=sorted(published),
        streak=dict(streak or {}),
        evidence={str(r): v for r, v in sorted((evidence or {}).items())},
    )
    if verdict is None:
        reason = "no usable summary: " + ("; ".join(notes) or "none arrived")
        return Decision(**base, drop=[], members_after=members, action=NONE, reason=reason,
                        kind="", headline="", guilty=[], hosts=[])  # fmt: skip
    guilty = sorted({members[r] for r in verdict.guilty_ranks if 0 <= r < len(members)})
    hosts = sorted({g.host for g in verdict.guilty if g.host})
    doc = verdict.to_document()
    common = dict(kind=verdict.kind, headline=verdict.headline, guilty=guilty, verdict=doc)

    def nothing(reason: str) -> Decision:
        return Decision(**base, **common, drop=[], members_after=members, action=NONE,
                        reason=reason, hosts=hosts)  # fmt: skip

    if not guilty:
        return nothing(f"the verdict ({verdict.kind}) names no rank to drop")
    if not policy.may_drop(verdict.kind):
        return nothing(
            f"the policy does not drop ranks for a {verdict.kind} verdict "
            f"(it drops for {', '.join(policy.drop_kinds) or 'none'})"
        )
    if verdict.kind == "straggler":
        persistent = [r for r in guilty if (streak or {}).get(str(r), 0) >= policy.straggler_checks]
        if not persistent:
            return nothing(
                f"straggler not yet persistent ({policy.straggler_checks} checks in a row needed)"
            )
        guilty = persistent
    survivors = [m for m in members if m not in guilty]
    if len(guilty) > policy.max_drop_fraction * len(members):
        return nothing(
            f"dropping {len(guilty)} of {len(members)} ranks exceeds max_drop_fraction "
            f"{policy.max_drop_fraction}"
        )
    if len(survivors) < policy.min_world_size:
        return nothing(f"{len(survivors)} survivors would be fewer than min_world_size")
    return Decision(**base, **common, drop=guilty, members_after=survivors, action=DROP,
                    reason=f"{verdict.kind}: {verdict.headline}", hosts=hosts)  # fmt: skip
