"""``frtools history``'s output: the JSON document a scheduler reads (the drain list: which
hosts and GPUs to take out, and why, with the evidence per host) and the terminal view.

Renders only: what the catalog holds is gathered by ``frtools.commands.history`` into a
``HistoryView``; which offender is to be drained is decided by ``action.drain_reasons``. Every
text the catalog holds went through a dump's writer: on a terminal it goes through
``escape.terminal``, and no line of the text starts a workflow command.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from frtools import __version__
from frtools.analyze.action import drain_reasons
from frtools.analyze.reporters.escape import no_workflow_commands, terminal
from frtools.formats.incidents import HEALTHY, Offender, StoredIncident, Window, iso_utc

OUTPUT_KIND = "frtools-history"
OUTPUT_VERSION = "1.1"  # 1.1: drain entries' "why", "hardware_incidents", "drain_actions";
# evidence entries' "action" and "findings"
SHOWN_OFFENDERS = 15  # rows of each ranking on a terminal
SHOWN_FINDINGS = 3  # findings per drained host on a terminal


@dataclass
class HistoryView:
    """What one ``frtools history`` question found in the catalog."""

    path: str
    window: Window
    by_kind: dict[str, int]
    in_catalog: int
    hosts: list[Offender] = field(default_factory=list)
    gpus: list[Offender] = field(default_factory=list)
    incidents: list[StoredIncident] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def healthy(self) -> int:
        return self.by_kind.get(HEALTHY, 0)

    @property
    def problems(self) -> int:
        return self.total - self.healthy

    def window_text(self) -> str:
        parts = []
        if self.window.since_ns is not None:
            parts.append(f"since {iso_utc(self.window.since_ns)}")
        if self.window.job is not None:
            parts.append(f"of job {self.window.job}")
        return " ".join(parts) if parts else "in the whole catalog"

    def why(self, o: Offender, min_incidents: int) -> list[str]:
        return drain_reasons(o.name, o.incidents, o.hardware_incidents, self.total, min_incidents)


# -- JSON ----------------------------------------------------------------------------------


def _offender_dict(o: Offender, by: str, view: HistoryView, min_incidents: int) -> dict[str, Any]:
    named = (
        {"host": o.name} if by == "host" else {"gpu": o.name, "host": o.host, "device": o.device}
    )
    why = view.why(o, min_incidents)
    return {
        **named,
        "incidents": o.incidents,
        "share": round(o.incidents / view.total, 3) if view.total else None,
        "first_seen": iso_utc(o.first_ns),
        "last_seen": iso_utc(o.last_ns),
        "kinds": o.kinds,
        "drain": bool(why),
        "why": why,
        "hardware_incidents": o.hardware_incidents,
        "drain_actions": o.drain_actions,
        "evidence": o.evidence,
        "evidence_truncated": len(o.evidence) < o.incidents,
    }


def document(
    view: HistoryView, min_incidents: int, hosts: bool, gpus: bool, listing: bool
) -> dict[str, Any]:
    """The ``--format json`` document (docs/history.md, docs/actions.md)."""

    def ranked(offenders: list[Offender], by: str) -> list[dict[str, Any]]:
        return [_offender_dict(o, by, view, min_incidents) for o in offenders]

    doc: dict[str, Any] = {
        "kind": OUTPUT_KIND,
        "schema_version": OUTPUT_VERSION,
        "tool": {"name": "frtools", "version": __version__},
        "catalog": os.path.abspath(view.path),
        "generated": iso_utc(time.time_ns()),
        "window": {"since": iso_utc(view.window.since_ns), "job": view.window.job},
        "min_incidents": min_incidents,
        "incidents_in_window": view.total,
        "problems": view.problems,
        "healthy": view.healthy,
        "by_kind": view.by_kind,
        "drain": {
            "hosts": [d for d in ranked(view.hosts, "host") if d["drain"]],
            "gpus": [d for d in ranked(view.gpus, "gpu") if d["drain"]],
        },
    }
    if hosts:
        doc["hosts"] = ranked(view.hosts, "host")
    if gpus:
        doc["gpus"] = ranked(view.gpus, "gpu")
    if listing:
        doc["incidents"] = [i.to_dict() for i in view.incidents]
    return doc


# -- the terminal view ---------------------------------------------------------------------


def _short_site(site: str | None) -> str:
    """``…/param_and_grad_buffer.py:412 in start_grad_sync`` -> ``param_and_grad_buffer.py:412``."""
    if not site:
        return ""
    where = site.split(" in ", 1)[0]
    return os.path.basename(where) or where


def _guilty_text(incident: StoredIncident) -> str:
    if not incident.guilty:
        return "-"
    parts = []
    for g in incident.guilty[:3]:
        ident = ", ".join(x for x in (g.host, g.device) if x)
        parts.append(f"rank {g.rank} ({ident})" if ident else f"rank {g.rank}")
    more = incident.guilty_total - len(parts)
    return ", ".join(parts) + (f" +{more}" if more > 0 else "")


def _where_text(incident: StoredIncident) -> str:
    parts = []
    if incident.op:
        seq = incident.collective_seq_id or incident.p2p_seq_id
        parts.append(f"{incident.op} #{seq}" if seq else incident.op)
    if incident.pg_name is not None:
        parts.append(
            f"group {incident.pg_name}" + (f" ({incident.pg_desc})" if incident.pg_desc else "")
        )
    if incident.call_site:
        parts.append(_short_site(incident.call_site))
    return " · ".join(parts) or "-"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _kinds_text(by_kind: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in by_kind.items() if kind != HEALTHY)


def _short_time(ns: int | None) -> str:
    """``2026-11-30 18:07`` (UTC): a terminal column; JSON keeps full ISO-8601."""
    text = iso_utc(ns)
    return text[:16].replace("T", " ") if text else "?"


def _drain_lines(view: HistoryView, offenders: list[Offender], min_incidents: int) -> list[Any]:
    """Each host to drain, why, and the hardware findings its incidents hold."""
    from rich.text import Text

    lines: list[Any] = []
    for o in offenders[:SHOWN_OFFENDERS]:
        why = view.why(o, min_incidents)
        if not why:
            continue
        line = Text("  ")
        line.append(terminal(o.name), style="bold red")
        line.append(": " + terminal("; ".join(why)))
        lines.append(line)
        findings = [
            (e["incident"], f)
            for e in o.evidence
            for f in e.get("findings", ())
            if f.get("hardware")
        ]
        for incident, f in findings[:SHOWN_FINDINGS]:
            lines.append(Text(f"    incident {incident}: {terminal(f['text'])}", style="red"))
        if len(findings) > SHOWN_FINDINGS:
            lines.append(Text(f"    … {len(findings) - SHOWN_FINDINGS} more", style="dim"))
    return lines


def renderable(view: HistoryView, min_incidents: int, hosts: bool, gpus: bool, listing: bool):
    """The terminal view as one rich renderable: the answer first (a repeat offender or
    none), the hosts to drain and why, the rankings, the newest incidents."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    window = view.window_text()
    drain_hosts = [o for o in view.hosts if view.why(o, min_incidents)]
    drain_gpus = [o for o in view.gpus if view.why(o, min_incidents)]
    repeat_hosts = [o for o in drain_hosts if o.incidents >= min_incidents]
    repeat_gpus = [o for o in drain_gpus if o.incidents >= min_incidents]
    head = Text()
    if view.total == 0:
        head.append(" NONE ", style="bold white on blue")
        head.append(f" No incidents recorded {window}", style="bold")
        if view.in_catalog:
            head.append(f" ({view.in_catalog} in the catalog: --since all)", style="dim")
    elif (repeat_hosts and hosts) or (repeat_gpus and gpus):
        offenders, what = (repeat_hosts, "host") if repeat_hosts and hosts else (repeat_gpus, "GPU")
        top = offenders[0]
        text = (
            f"{what} {terminal(top.name)} was guilty in {top.incidents} of {view.total} incidents"
        )
        if len(offenders) > 1:
            text += f", and {len(offenders) - 1} more {what}(s) in {min_incidents} or more"
        head.append(" REPEAT ", style="bold white on red")
        head.append(f" {text} {window}: drain candidate", style="bold red")
    elif (drain_hosts and hosts) or (drain_gpus and gpus):
        offenders, what = (drain_hosts, "host") if drain_hosts and hosts else (drain_gpus, "GPU")
        head.append(" DRAIN ", style="bold white on red")
        head.append(
            f" hardware evidence against {what} {terminal(offenders[0].name)}"
            + (f" and {len(offenders) - 1} more" if len(offenders) > 1 else "")
            + f" {window}",
            style="bold red",
        )
    else:
        noun = "host or GPU" if hosts and gpus else "host" if hosts else "GPU"
        head.append(" OK ", style="bold white on green")
        head.append(
            f" No {noun} guilty in {min_incidents} or more of {view.total} incidents {window}",
            style="bold green",
        )
    parts.append(head)
    summary = f"{_count(view.total, 'incident')}: {_count(view.problems, 'problem')}"
    if view.problems:
        summary += f" ({_kinds_text(view.by_kind)})"
    summary += f", {view.healthy} healthy · {terminal(view.path)}"
    parts.append(Text(summary, style="dim"))

    drain = (drain_hosts if hosts else []) + (drain_gpus if gpus else [])
    if drain:
        parts.append(Text(""))
        parts.append(Text("To drain, and why", style="bold"))
        parts.extend(_drain_lines(view, drain, min_incidents))

    def ranking(title: str, offenders: list[Offender], gpu: bool) -> None:
        parts.append(Text(""))
        parts.append(Text(title, style="bold"))
        if not offenders:
            known = "GPU" if gpu else "host"
            parts.append(Text(f"  none: no guilty rank with a known {known}", style="dim"))
            return
        table = Table(box=None, padding=(0, 1), header_style="dim")
        table.add_column("gpu" if gpu else "host", no_wrap=gpu, overflow="fold")
        if gpu:
            table.add_column("on", no_wrap=True)
        table.add_column("guilty", justify="right", no_wrap=True)
        if not gpu:
            table.add_column("share", justify="right")
        table.add_column("last seen", no_wrap=True)
        table.add_column("kinds")
        for o in offenders[:SHOWN_OFFENDERS]:
            row = [o.name]
            if gpu:
                row.append(" ".join(x for x in (o.host, o.device) if x) or "?")
            row.append(f"{o.incidents} of {view.total}")
            if not gpu:
                row.append(f"{o.incidents / view.total:.0%}")
            row += [_short_time(o.last_ns), ", ".join(o.kinds)]
            cells = [Text(terminal(cell)) for cell in row]  # text, never markup
            table.add_row(*cells, style="red" if view.why(o, min_incidents) else None)
        parts.append(table)
        if len(offenders) > SHOWN_OFFENDERS:
            parts.append(Text(f"  … {len(offenders) - SHOWN_OFFENDERS} more", style="dim"))

    if view.total and hosts:
        ranking(
            f"Hosts by incidents they were guilty in (red: {min_incidents}+)", view.hosts, False
        )
    if view.total and gpus:
        ranking(f"GPUs by incidents they were guilty in (red: {min_incidents}+)", view.gpus, True)
    if view.total and listing:
        parts.append(Text(""))
        parts.append(
            Text(f"Incidents, newest first ({len(view.incidents)} of {view.total})", style="bold")
        )
        for i in view.incidents:
            line = Text(f" {i.id:>4}  {_short_time(i.recorded_ns)}  ")
            line.append(terminal(f"{i.kind:<9}"), style="green" if i.kind == HEALTHY else "red")
            job = terminal(i.job_id)
            job = job if len(job) <= 28 else "…" + job[-27:]
            line.append(f" {job}  ")
            line.append(terminal(_guilty_text(i)), style="bold" if i.guilty else "dim")
            parts.append(line)
            if i.kind != HEALTHY:
                parts.append(Text(f"       {terminal(_where_text(i))}", style="dim"))
    return Group(*parts)


def render_text(renderable: Any, width: int = 100, color: bool = False) -> str:
    """Text of ``width`` columns (ANSI colours when ``color``), no line of which starts a
    workflow command."""
    import io

    from rich.console import Console

    console = Console(
        width=width,
        file=io.StringIO(),
        force_terminal=color,
        no_color=not color,
        color_system="standard" if color else None,
        highlight=False,
    )
    console.print(renderable)
    return no_workflow_commands(console.file.getvalue())  # type: ignore[attr-defined]
