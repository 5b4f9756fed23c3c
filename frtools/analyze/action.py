"""The next action a verdict asks for: drain the host, fix the code, restart, or investigate.

Decided by rules over the Verdict, not by a model, in this order (docs/actions.md):

1. ``none``        the verdict is healthy;
2. ``drain``       a guilty rank's host or GPU shows hardware evidence (a ``DeviceFinding``
                   with ``hardware``: an Xid that means a GPU fault, uncorrectable ECC, a
                   NIC port that went down);
3. ``fix code``    the ranks disagree in the program they run: a mismatch (sizes, dtypes,
                   op, all_to_all splits), a cross-group order, a skipped collective;
4. ``drain``       a repeat offender: a guilty host that the incident catalog shows guilty in
                   ``FRTOOLS_DRAIN_INCIDENTS`` incidents of ``FRTOOLS_DRAIN_WINDOW`` (this one
                   counted), where the verdict would otherwise restart or investigate;
5. ``restart``     a transient fault (a dead, killed or stuck rank) with no evidence against
                   its host, at ``FRTOOLS_ACTION_MIN_CONFIDENCE`` or more;
6. ``investigate`` the rest: an inconclusive verdict, a rank alive in its own code, a
                   straggler, a process that raised, a weak verdict; what is known and what is
                   missing are listed.

Worked example: rank 5 on node7 is dead (killed), its GPU 3 shows "Xid 79 (fell off the bus)"
-> ``drain`` node7 GPU 3; the same verdict without the Xid and node7 guilty in 1 incident of
the catalog -> ``restart``; node7 guilty in a 2nd incident -> ``drain`` (repeat offender).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from frtools.analyze.verdict import Action, ActionGpu, Verdict
from frtools.config import ACTION_MIN_CONFIDENCE, DRAIN_INCIDENTS

# Reason values (diagnosis.model.Reason) that put the fault in the program the ranks run
CODE_CAUSES = frozenset({"mismatch", "skipped", "order", "splits", "disagrees"})
CODE_KINDS = ("mismatch", "order")
# Reason values of a rank that died or hung without a failure of its own
TRANSIENT_CAUSES = frozenset(
    {"absent", "gone", "stuck", "never_started", "device_stopped", "in_host_call",
     "unlisted_member", "no_dump"}
)  # fmt: skip
TRANSIENT_KINDS = ("dead", "stuck")
# How a process ended (model.trace.EXIT_KINDS) when it ended by a failure of its own: a
# restart runs into it again unless its cause was transient
OWN_FAILURE_ENDINGS = frozenset({"exception", "exit", "os_exit"})
MAX_LISTED = 8  # hosts, call sites or findings named one by one in a reason
MAX_REASONS = 20  # findings listed as reasons of a drain
# Every rule that can decide (Action.rule; docs/verdict.schema.json lists the same)
RULES = (
    "healthy", "hardware_evidence", "code_fault", "repeat_offender", "transient_fault",
    "low_confidence", "own_failure", "inconclusive", "straggler", "alive_elsewhere",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class HostHistory:
    """What the incident catalog says about the guilty hosts: for each, in how many incidents
    of the window it was guilty, this verdict's incident counted once."""

    catalog: str
    window: str  # "the last 7d"
    incidents: Mapping[str, int] = field(default_factory=dict)
    unreadable: str | None = None  # why the catalog could not be read (then no counts)


NO_CATALOG = "no incident catalog (--history, FRTOOLS_HISTORY): repeat offenders not checked"
Causes = Mapping[int, tuple[str, str | None]]  # rank -> (Reason value, how its process ended)


def decide_action(
    verdict: Verdict,
    causes: Causes | None = None,
    history: HostHistory | None = None,
    *,
    drain_incidents: int | None = None,
    min_confidence: float | None = None,
) -> Action:
    """The Action for ``verdict``. ``causes``: each guilty rank's reason and ending, as the
    diagnosis found them (without them the verdict kind alone decides); ``history``: the
    catalog's counts (None: no catalog, the repeat-offender rule does not apply)."""
    causes = causes or {}
    n = DRAIN_INCIDENTS.read() if drain_incidents is None else drain_incidents
    floor = ACTION_MIN_CONFIDENCE.read() if min_confidence is None else min_confidence
    if verdict.kind == "healthy":
        return Action(
            kind="none",
            rule="healthy",
            reasons=["healthy: no rank is blocked and every expected rank is accounted for"],
        )
    hardware = _hardware(verdict)
    if hardware:
        return hardware
    if _is_code_fault(verdict, causes):
        return _fix_code(verdict)
    base = _restart_or_investigate(verdict, causes, floor)
    return _with_history(base, verdict, history, n)


def with_history(verdict: Verdict, history: HostHistory) -> Action:
    """The verdict's action once the incident catalog is known (``frtools analyze
    --history``): the repeat-offender rule applied to what the diagnosis decided."""
    action = verdict.action or decide_action(verdict)
    action = _replace(action, reasons=[r for r in action.reasons if r != NO_CATALOG])
    return _with_history(action, verdict, history, DRAIN_INCIDENTS.read())


def _ranks_text(ranks: list[int]) -> str:
    from frtools.model.ranks import format_ranks

    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks, 60)}"


# what a transient cause did to the rank, in the words of the restart's reason
_DIED = frozenset({"absent", "gone", "no_dump", "unlisted_member"})


def _what_happened(causes: set[str], n: int) -> str:
    if causes == {"device_stopped"}:
        return (
            "stopped: its GPU ran no more kernels"
            if n == 1
            else "stopped: their GPUs ran no more kernels"
        )
    if causes == {"never_started"}:
        return (
            "hung: its GPU never started the op its peers' GPUs run"
            if n == 1
            else "hung: their GPUs never started the op their peers' GPUs run"
        )
    if causes and causes <= _DIED:
        return "died or left no record"
    if causes and causes.isdisjoint(_DIED | {"device_stopped"}):
        return "hung"
    return "died or hung"


def _guilty_hosts(verdict: Verdict) -> list[str]:
    return sorted({g.host for g in verdict.guilty if g.host})


def _hardware(verdict: Verdict) -> Action | None:
    """``drain`` where a guilty rank's host or GPU carries hardware evidence."""
    reasons: list[str] = []
    hosts: list[str] = []
    gpus: dict[tuple[str, int | None, str | None], ActionGpu] = {}
    ranks: list[int] = []
    seen: set[tuple[str, str, str]] = set()
    for g in verdict.guilty:
        found = [f for f in g.findings if f.hardware]
        if not found:
            continue
        ranks.append(g.rank)
        for f in found:
            host = f.host or g.host
            if (host or "", f.code, f.text) not in seen:
                seen.add((host or "", f.code, f.text))
                reasons.append(f"{host or 'an unnamed host'}: {f.text} ({f.source})")
            if host is None:  # evidence still, but nothing a scheduler could drain by name
                continue
            if host not in hosts:
                hosts.append(host)
            if f.gpu is not None or f.pci_bus_id:
                key = (host, f.gpu, f.pci_bus_id)
                inferred = g.gpu_inferred and f.gpu is not None and f.gpu == g.gpu
                gpus.setdefault(
                    key, ActionGpu(host=host, gpu=f.gpu, pci_bus_id=f.pci_bus_id, inferred=inferred)
                )
    if not ranks:
        return None
    if len(reasons) > MAX_REASONS:
        reasons[MAX_REASONS:] = [f"… {len(reasons) - MAX_REASONS} more findings"]
    where = ", ".join(hosts[:MAX_LISTED]) or "an unnamed host"
    if len(hosts) > MAX_LISTED:
        where += f" and {len(hosts) - MAX_LISTED} more hosts"
    head = f"hardware evidence on {where}, where guilty {_ranks_text(ranks)} ran"
    if any(g.inferred for g in gpus.values()):
        head += " (GPU inferred from the local rank: the rank had no CUDA device)"
    reasons.insert(0, head)
    if verdict.kind in CODE_KINDS:
        reasons.append(
            f"the verdict is also a {verdict.kind}: check the code at the call site once the "
            "host is out"
        )
    return Action(
        kind="drain",
        rule="hardware_evidence",
        reasons=reasons,
        hosts=hosts,
        gpus=list(gpus.values()),
        ranks=sorted(ranks),
        call_sites=_call_sites(verdict),
    )


def _is_code_fault(verdict: Verdict, causes: Causes) -> bool:
    if verdict.kind in CODE_KINDS:
        return True
    reasons = {causes[g.rank][0] for g in verdict.guilty if g.rank in causes}
    return bool(reasons) and reasons <= CODE_CAUSES


def _call_sites(verdict: Verdict) -> list[str]:
    return list(dict.fromkeys(g.call_site for g in verdict.guilty if g.call_site))


def _file_of(call_site: str) -> str:
    """``/src/train.py:120 in step`` -> ``/src/train.py``."""
    where = call_site.split(" in ", 1)[0]
    path, sep, line = where.rpartition(":")
    return path if sep and line.isdigit() else where


def _fix_code(verdict: Verdict) -> Action:
    sites = _call_sites(verdict)
    reasons = [
        f"a code fault ({verdict.kind}): the ranks disagree in the program they run, so a "
        "restart runs into it again"
    ]
    by_site: dict[str, list[int]] = {}
    for g in verdict.guilty:
        if g.call_site:
            by_site.setdefault(g.call_site, []).append(g.rank)
    reasons += [f"{_ranks_text(r)} at {site}" for site, r in list(by_site.items())[:MAX_LISTED]]
    missing = []
    if not sites:
        missing.append(
            "the call site: the records keep no Python stack for the guilty ranks (frtools "
            "run records one per op; FRTOOLS_STACKS=1)"
        )
    return Action(
        kind="fix code",
        rule="code_fault",
        reasons=reasons,
        hosts=_guilty_hosts(verdict),
        ranks=sorted(set(verdict.guilty_ranks)),
        call_sites=sites,
        files=list(dict.fromkeys(_file_of(s) for s in sites)),
        missing=missing,
    )


def _device_note(verdict: Verdict) -> tuple[list[str], list[str]]:
    """(reasons, missing) about the device facts of the guilty hosts."""
    hosts = _guilty_hosts(verdict)
    where = ", ".join(hosts) if hosts else "the guilty ranks' hosts"
    reasons = [
        f"seen on {f.host or g.host or '?'} (not hardware evidence): {f.text}"
        for g in verdict.guilty
        for f in g.findings
        if not f.hardware
    ][:MAX_LISTED]
    if verdict.device_sources:
        reasons.append(f"no hardware evidence against {where} in the device facts")
        return reasons, []
    return reasons, [
        f"device facts of {where} (nvidia-smi, the kernel log's Xid lines, NIC counters: "
        "frtools dump collects them): without them a GPU or NIC fault cannot be ruled out"
    ]


def _restart_or_investigate(verdict: Verdict, causes: Causes, floor: float) -> Action:
    ranks = sorted(set(verdict.guilty_ranks))
    device_reasons, device_missing = _device_note(verdict)
    own = sorted(
        r for r in ranks if r in causes and causes[r][1] in OWN_FAILURE_ENDINGS
    )  # its process raised or exited: a restart meets the same error unless it was transient
    base = {"hosts": _guilty_hosts(verdict), "ranks": ranks, "call_sites": _call_sites(verdict)}
    known_causes = {causes[r][0] for r in ranks if r in causes}
    transient = (
        verdict.kind in TRANSIENT_KINDS
        and ranks
        and not own
        and (not known_causes or known_causes <= TRANSIENT_CAUSES)
    )
    if transient and verdict.confidence >= floor:
        its = "its" if len(ranks) == 1 else "their"
        hosts = ", ".join(base["hosts"]) or f"{its} host{'s' if len(ranks) > 1 else ''}"
        return Action(
            kind="restart",
            rule="transient_fault",
            reasons=[
                f"a transient fault ({verdict.kind}): {_ranks_text(ranks)} "
                f"{_what_happened(known_causes, len(ranks))}, with no error of {its} own on "
                f"record, and nothing counts against {hosts}",
                *device_reasons,
            ],
            missing=device_missing,
            **base,
        )
    if transient:
        why = (
            f"the verdict's confidence {verdict.confidence:.0%} is below "
            f"{floor:.0%} (FRTOOLS_ACTION_MIN_CONFIDENCE): confirm it before restarting"
        )
        rule = "low_confidence"
    elif own:
        why = (
            f"{_ranks_text(own)} ended by a failure of its own (an exception or exit): a restart "
            "meets it again unless its cause was transient (a full disk, a lost file system); "
            "read its error first"
        )
        rule = "own_failure"
    elif verdict.kind == "inconclusive":
        why = f"the records leave the question open (inconclusive): {verdict.headline}"
        rule = "inconclusive"
    elif verdict.kind == "straggler":
        why = (
            f"{_ranks_text(ranks)} reaches collectives late: a slow host (clocks throttled, a "
            "failing NIC) or more work on its side; a restart does not change it"
        )
        rule = "straggler"
    else:
        # beside ranks alive elsewhere, a mixed verdict can blame ranks without a record
        gone = [r for r in ranks if causes.get(r, ("",))[0] in TRANSIENT_CAUSES]
        alive = [r for r in ranks if r not in gone]
        parts = []
        if alive or not gone:
            one = len(alive) <= 1  # "no rank is alive …" when none is
            its = "its" if one else "their"
            parts.append(
                f"{_ranks_text(alive) if alive else 'no rank'} {'is' if one else 'are'} alive "
                f"in code of {its} own while {its} peers wait ({verdict.kind}): "
                f"{'its stack says' if one else 'their stacks say'} where (data loading, a "
                "hang in user code, a collective behind a condition)"
            )
        if gone:
            parts.append(
                f"{_ranks_text(gone)} died or left no record (peers wait for "
                f"{'it' if len(gone) == 1 else 'them'} too; a lost dump looks the same)"
            )
        why = "; ".join(parts)
        rule = "alive_elsewhere"
    missing = [*verdict.decide, *device_missing]
    if not verdict.stacks and verdict.kind in ("missing", "straggler") and ranks:
        missing.append(
            f"the Python stacks of {_ranks_text(ranks)} (frtools dump asks the ranks for them)"
        )
    return Action(
        kind="investigate",
        rule=rule,
        reasons=[why, *device_reasons],
        missing=list(dict.fromkeys(missing)),
        **base,
    )


def _with_history(
    action: Action, verdict: Verdict, history: HostHistory | None, threshold: int
) -> Action:
    """``action``, or ``drain`` of the guilty hosts the catalog shows as repeat offenders."""
    if action.kind not in ("restart", "investigate"):
        return action
    if not action.hosts:
        if history is None or not action.ranks:
            return action
        note = (
            f"the dumps name no host for {_ranks_text(action.ranks)}: the catalog's repeat "
            "offenders cannot be matched"
        )
        return _replace(action, reasons=[*action.reasons, note])
    if history is None:
        return _replace(action, reasons=[*action.reasons, NO_CATALOG])
    if history.unreadable:
        note = (
            f"the incident catalog cannot be read ({history.unreadable}): repeat offenders "
            "not checked"
        )
        return _replace(action, reasons=[*action.reasons, note])
    counts = {h: int(history.incidents.get(h, 1)) for h in action.hosts}
    whole_job = bool(verdict.ranks_expected) and len(action.ranks) >= verdict.ranks_expected
    repeat = [h for h in action.hosts if counts[h] >= threshold]
    if not repeat or whole_job:
        said = ", ".join(f"{h} guilty in {counts[h]}" for h in action.hosts[:MAX_LISTED])
        note = (
            f"not a repeat offender: {said} incident(s) of {history.window} in "
            f"{history.catalog} (drain at {threshold}, FRTOOLS_DRAIN_INCIDENTS)"
        )
        if repeat and whole_job:
            note = f"every rank is guilty, so no host stands out: {note}"
        return _replace(action, reasons=[*action.reasons, note])
    reasons = [
        f"repeat offender: {h} was guilty in {counts[h]} incidents of {history.window} "
        f"(drain at {threshold}, FRTOOLS_DRAIN_INCIDENTS; {history.catalog})"
        for h in repeat
    ]
    reasons.append(f"otherwise: {action.kind} ({action.reasons[0]})")
    ranks = sorted(g.rank for g in verdict.guilty if g.host in repeat)
    gpus = [
        ActionGpu(host=g.host, gpu=g.gpu, pci_bus_id=g.pci_bus_id, inferred=g.gpu_inferred)
        for g in verdict.guilty
        if g.host in repeat and (g.gpu is not None or g.pci_bus_id)
    ]
    return Action(
        kind="drain",
        rule="repeat_offender",
        reasons=reasons,
        hosts=repeat,
        gpus=gpus,
        ranks=ranks,
        call_sites=action.call_sites,
        missing=action.missing,
    )


def _replace(action: Action, **changes: object) -> Action:
    import dataclasses

    return dataclasses.replace(action, **changes)  # type: ignore[arg-type]


def drain_reasons(
    name: str, incidents: int, hardware_incidents: int, total: int, min_incidents: int
) -> list[str]:
    """Why ``frtools history`` lists a host (or GPU) to drain; empty: it does not. Guilty in
    ``min_incidents`` or more incidents of the window, or hardware evidence against it in any
    (each evidence incident lists its findings)."""
    reasons = []
    if incidents >= min_incidents:
        reasons.append(
            f"{name} was guilty in {incidents} of {total} incidents (drain at {min_incidents})"
        )
    if hardware_incidents:
        reasons.append(f"hardware evidence against {name} in {hardware_incidents} incident(s)")
    return reasons
