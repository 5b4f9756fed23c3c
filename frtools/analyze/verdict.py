"""The Verdict: the one answer ``frtools analyze`` gives, and the JSON document it is written as.

Reporters only render a Verdict; nothing downstream re-derives the diagnosis. The JSON form
(``Verdict.to_document``) follows ``docs/verdict.schema.json``; bump ``SCHEMA_VERSION`` when a
field changes meaning or disappears (adding an optional field is a minor bump).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from frtools import __version__
from frtools.analyze.stacks import StacksSummary
from frtools.analyze.steps import StepDiff
from frtools.config import ACTION_MIN_CONFIDENCE
from frtools.model.trace import InputFile, ProcessGroup

# 1.1: "stacks"; 1.2: "inconclusive", "decide"; 1.3: "exclusion"; 1.4: "stacks.native";
# 1.5: guilty ranks' gpu, gpu_inferred, pci_bus_id, findings (device evidence), host_guessed,
# "device_sources";
# "verdict.action" (the next action, docs/actions.md); "step_diff" (docs/verdict.md)
SCHEMA_VERSION = "1.5"

KINDS = ("healthy", "missing", "dead", "mismatch", "order", "stuck", "straggler", "inconclusive")
# Kinds whose guilty ranks a job should go on without (a dead or hung rank, a collective
# stuck on some ranks' devices), for orchestrators that restart or shrink (docs/recovery.md)
EXCLUDE_KINDS = ("dead", "missing", "stuck")
# The next action a verdict asks for (docs/actions.md; decided in frtools.analyze.action)
ACTIONS = ("drain", "fix code", "restart", "investigate", "none")


@dataclass(frozen=True, kw_only=True)
class DeviceFinding:
    """One abnormal fact about a guilty rank's host, GPU or NIC, read from the device facts
    collected at dump time (docs/device-evidence.md); ``hardware`` facts count against the
    host or GPU (the evidence a drain rests on)."""

    host: str
    source: str  # "nvidia-smi" | "nvml" | "kmsg" | "infiniband" | "ncclras"
    code: str  # "xid:79", "ecc:dram_uncorrectable", "ib:link_downed", ...
    text: str  # "GPU 3 (PCI 0000:47:00.0): Xid 79 at 12:03:11 (fell off the bus)"
    hardware: bool
    gpu: int | None = None
    pci_bus_id: str | None = None
    time: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GuiltyRank:
    """A rank the verdict blames, with what a human needs to find it (host, GPU, code line)."""

    rank: int
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    device: str | None = None
    device_id: str | None = None
    reason: str = ""
    call_site: str | None = None
    # the rank's GPU on its host (its device identity, or its local rank's place in the host's
    # GPU list when the rank had no CUDA device: gpu_inferred) and what is abnormal there
    gpu: int | None = None
    gpu_inferred: bool = False
    pci_bus_id: str | None = None
    findings: list[DeviceFinding] = field(default_factory=list)
    # ``host`` was not in the rank's record: read from its file's name (or the only host with
    # device facts)
    host_guessed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ActionGpu:
    """A GPU a drain names: its host, index and PCI bus id as far as the evidence says."""

    host: str
    gpu: int | None = None
    pci_bus_id: str | None = None
    inferred: bool = False  # the index stands in from the rank's local rank (no CUDA device)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Action:
    """What to do next: one of ``ACTIONS``, the rule that chose it and its reasons in words.

    ``hosts`` are the hosts it is about (only ``drain`` asks to take them out, with ``gpus``);
    ``call_sites``/``files`` where the code to fix is (``fix code``); ``missing`` what would
    settle an ``investigate``.
    """

    kind: str
    rule: str
    reasons: list[str]
    hosts: list[str] = field(default_factory=list)
    gpus: list[ActionGpu] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    call_sites: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rule": self.rule,
            "reasons": list(self.reasons),
            "hosts": list(self.hosts),
            "gpus": [g.to_dict() for g in self.gpus],
            "ranks": list(self.ranks),
            "call_sites": list(self.call_sites),
            "files": list(self.files),
            "missing": list(self.missing),
        }


@dataclass
class RankGroup:
    """One set of ranks that agree on what they did at the verdict's collective.

    ``op`` is None and ``state`` says why ("not issued", "no record") for ranks that did not
    issue it.
    """

    ranks: list[int]
    op: str | None = None
    input_sizes: str | None = None
    input_dtypes: str | None = None
    output_sizes: str | None = None
    output_dtypes: str | None = None
    state: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Verdict:
    kind: str
    headline: str
    confidence: float
    guilty: list[GuiltyRank] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    process_group: ProcessGroup | None = None
    collective_seq_id: int | None = None
    p2p_seq_id: int | None = None
    op: str | None = None
    groups: list[RankGroup] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    ranks_expected: int = 0
    ranks_found: int = 0
    ranks_missing: list[int] = field(default_factory=list)
    inputs: list[InputFile] = field(default_factory=list)
    # where the ranks' main threads stood (faulthandler stacks), when the inputs had them
    stacks: StacksSummary | None = None
    # what would decide the question the records leave open (inconclusive verdicts, and
    # verdicts that rest on a missing dump): one sentence per missing piece
    decide: list[str] = field(default_factory=list)
    # where the device facts came from: one line per source per host (collected / absent /
    # failed, and why); empty when the inputs held no device facts
    device_sources: list[str] = field(default_factory=list)
    # the next action (drain, fix code, restart, investigate, none): frtools.analyze.action
    action: Action | None = None
    # what the failing step did differently from the last good one (frtools.analyze.steps)
    step_diff: StepDiff | None = None

    @property
    def guilty_ranks(self) -> list[int]:
        return [g.rank for g in self.guilty]

    @property
    def exit_code(self) -> int:
        """0 when healthy, 1 for any problem found (the CLI's contract)."""
        return 0 if self.kind == "healthy" else 1

    def exclusion(self) -> dict[str, Any] | None:
        """The ranks (and their hosts) to leave out when the job restarts or shrinks; None
        when the verdict names none (its kind is not in ``EXCLUDE_KINDS``, or it blames
        every expected rank), or when its confidence is below the one its action asks
        before acting (``FRTOOLS_ACTION_MIN_CONFIDENCE``: the action says to confirm it;
        e.g. every member of an op nobody completed, where the records cannot say whose)."""
        ranks = sorted(set(self.guilty_ranks))
        if self.kind not in EXCLUDE_KINDS or not ranks:
            return None
        if self.confidence < ACTION_MIN_CONFIDENCE.read():
            return None
        if self.ranks_expected and len(ranks) >= self.ranks_expected:
            return None
        hosts = sorted({g.host for g in self.guilty if g.host})
        return {"kind": self.kind, "ranks": ranks, "hosts": hosts}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "headline": self.headline,
            "confidence": round(float(self.confidence), 3),
            "guilty": [g.to_dict() for g in self.guilty],
            "waiting": list(self.waiting),
            "process_group": self.process_group.to_dict() if self.process_group else None,
            "collective_seq_id": self.collective_seq_id,
            "p2p_seq_id": self.p2p_seq_id,
            "op": self.op,
            "groups": [g.to_dict() for g in self.groups],
            "evidence": list(self.evidence),
            **({"decide": list(self.decide)} if self.decide else {}),
            **({"action": self.action.to_dict()} if self.action is not None else {}),
        }

    def to_document(self) -> dict[str, Any]:
        """The full JSON report (``docs/verdict.schema.json``)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "frtools", "version": __version__},
            "verdict": self.to_dict(),
            "ranks": {
                "expected": self.ranks_expected,
                "found": self.ranks_found,
                "missing": list(self.ranks_missing),
            },
            "inputs": [i.to_dict() for i in self.inputs],
            **({"stacks": self.stacks.to_dict()} if self.stacks is not None else {}),
            **({"exclusion": exclusion} if (exclusion := self.exclusion()) else {}),
            **({"device_sources": list(self.device_sources)} if self.device_sources else {}),
            **({"step_diff": self.step_diff.to_dict()} if self.step_diff is not None else {}),
        }
