"""``frtools history [CATALOG]``: the incidents ``frtools analyze --history`` recorded, and
the hosts and GPUs that keep being guilty — the drain list a scheduler reads.

Also what ``analyze`` calls to record a verdict (``record_verdict``): a catalog that cannot
take the record is one warning on stderr, never a lost verdict or another exit code.

Exit codes: 0, or 2 on unusable input (a catalog that is missing, corrupt, locked, not a
catalog) or a usage error: one line on stderr naming the file and the reason.
"""

from __future__ import annotations

import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from frtools import __version__
from frtools.analyze.reporters.escape import no_workflow_commands, terminal
from frtools.commands._common import OneLineCommand, fail, first_line, run_guarded, write_text
from frtools.config import HISTORY
from frtools.formats.incidents import (
    HEALTHY,
    CatalogError,
    CatalogReader,
    GuiltyRecord,
    IncidentRecord,
    Offender,
    StoredIncident,
    Window,
    iso_utc,
    open_catalog,
    record_incident,
    records_fingerprint,
)

PREFIX = "frtools history"
OUTPUT_KIND = "frtools-history"
OUTPUT_VERSION = "1.0"
OFFENDER_LIMIT = 1000  # hosts / GPUs read per ranking
SHOWN_OFFENDERS = 15  # rows of each ranking on a terminal
JOB_ID_LIMIT = 256

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- recording a verdict (called by `frtools analyze --history`) ---------------------------


def _clean(text: Any, limit: int = JOB_ID_LIMIT) -> str | None:
    """A short printable text from a field a dump wrote (hostile until proven otherwise)."""
    if not isinstance(text, str):
        return None
    text = "".join(c for c in text if c.isprintable()).strip()[:limit]
    return text or None


def job_identity(path: Path, trace: Any) -> tuple[str, str]:
    """``(job id, where it came from)``: the dump folder's manifest (``frtools dump``), else
    a black box's identity (the recorder's job id), else the analyzed path itself."""
    from frtools.formats.manifest import MANIFEST_NAME, ManifestError, read_manifest

    folder = path if path.is_dir() else path.parent
    try:
        job = _clean(read_manifest(folder / MANIFEST_NAME).get("job_id"))
    except (ManifestError, OSError):
        job = None
    if job:
        return job, "manifest"

    from frtools.analyze.readers.frtools_snapshot import FORMAT as SNAPSHOT_FORMAT
    from frtools.formats.blackbox import SnapshotError, read_header

    for _rank, info in sorted(trace.ranks.items())[:4]:
        if info.format != SNAPSHOT_FORMAT or not info.source:
            continue
        try:
            job = _clean(read_header(info.source).get("identity", {}).get("job_id"))
        except (SnapshotError, OSError, AttributeError):
            continue
        if job:
            return job, "snapshot"
    return str(path.resolve())[:4096], "path"


def record_identities(trace: Any) -> list[list[Any]]:
    """Each rank's record as its content says who it is: rank, host, pid, how many ops, the
    newest record id and creation time (never where the file lies or when it was copied)."""
    per_rank: dict[int, list[Any]] = {}
    entries = trace.entries
    if entries.num_rows:
        table = entries.select(["rank", "record_id", "time_created_ns"]).group_by("rank")
        stats = table.aggregate(
            [("record_id", "count"), ("record_id", "max"), ("time_created_ns", "max")]
        ).to_pydict()
        for rank, n, last_id, last_ns in zip(
            stats["rank"], stats["record_id_count"], stats["record_id_max"],
            stats["time_created_ns_max"], strict=True,
        ):  # fmt: skip
            per_rank[int(rank)] = [n, last_id, last_ns]
    return [
        [rank, info.host, info.pid, *per_rank.get(rank, [0, None, None])]
        for rank, info in sorted(trace.ranks.items())
    ]


def incident_from(verdict: Any, trace: Any, path: Path) -> IncidentRecord:
    """The catalog's record of one analysis."""
    job_id, source = job_identity(path, trace)
    dump_times = [
        i.dump_time_ns
        for i in trace.ranks.values()
        if isinstance(i.dump_time_ns, int) and i.dump_time_ns > 0
    ]
    pg = verdict.process_group
    guilty = [
        GuiltyRecord(
            rank=g.rank,
            host=g.host,
            device=g.device,
            device_id=g.device_id,
            pid=g.pid,
            local_rank=g.local_rank,
            call_site=g.call_site,
            reason=g.reason,
        )
        for g in verdict.guilty
    ]
    return IncidentRecord(
        fingerprint=records_fingerprint(
            None if source == "path" else job_id,  # a path is where the files are, not what
            record_identities(trace),
            [pg.name if pg else None, verdict.op, verdict.collective_seq_id, verdict.p2p_seq_id],
        ),
        job_id=job_id,
        job_id_source=source,
        path=str(path.resolve()),
        kind=verdict.kind,
        headline=verdict.headline,
        confidence=float(verdict.confidence),
        verdict_document=verdict.to_document(),
        guilty=guilty,
        pg_name=pg.name if pg else None,
        pg_desc=pg.desc if pg else None,
        op=verdict.op,
        collective_seq_id=verdict.collective_seq_id,
        p2p_seq_id=verdict.p2p_seq_id,
        call_site=next((g.call_site for g in guilty if g.call_site), None),
        dump_ns=max(dump_times) if dump_times else None,
    )


def catalog_for(option: Path | None) -> Path | None:
    """``--history PATH``, else ``FRTOOLS_HISTORY``, else None (record nothing)."""
    if option is not None:
        return option
    value = HISTORY.read()
    return Path(value) if value else None


def record_verdict(catalog: Path, verdict: Any, trace: Any, path: Path) -> None:
    """Record the verdict in ``catalog``; a failure is one warning on stderr, nothing more."""
    try:
        record_incident(catalog, incident_from(verdict, trace, path))
    except CatalogError as e:
        click.echo(f"frtools: warning: verdict not recorded: {e}", err=True)
    except Exception as e:  # noqa: BLE001 - the verdict is out already; never fail it here
        click.echo(
            f"frtools: warning: verdict not recorded in {catalog}: "
            f"{type(e).__name__}: {first_line(e)}",
            err=True,
        )


# -- `frtools history` ----------------------------------------------------------------------


def parse_since(text: str, now_ns: int) -> int | None:
    """``7d``, ``12h``, ``30m``, ``2w``, ``90s``, an ISO-8601 date or time (UTC unless it
    says otherwise), or ``all`` (None)."""
    value = text.strip().lower()
    if value in ("all", ""):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", value)
    if m:
        return now_ns - int(float(m.group(1)) * _UNITS[m.group(2)] * 1_000_000_000)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected a duration (7d, 12h, 30m, 2w), an ISO-8601 date or time, or all",
            param_hint="--since",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1_000_000_000)


def _offender_dict(o: Offender, by: str, total: int, min_incidents: int) -> dict[str, Any]:
    named = (
        {"host": o.name} if by == "host" else {"gpu": o.name, "host": o.host, "device": o.device}
    )
    return {
        **named,
        "incidents": o.incidents,
        "share": round(o.incidents / total, 3) if total else None,
        "first_seen": iso_utc(o.first_ns),
        "last_seen": iso_utc(o.last_ns),
        "kinds": o.kinds,
        "drain": o.incidents >= min_incidents,
        "evidence": o.evidence,
        "evidence_truncated": len(o.evidence) < o.incidents,
    }


class _Findings:
    """What one ``frtools history`` question found in the catalog."""

    def __init__(self, catalog: CatalogReader, window: Window, limit: int) -> None:
        self.path = catalog.path
        self.window = window
        self.by_kind = catalog.count_by_kind(window)
        self.total = sum(self.by_kind.values())
        self.healthy = self.by_kind.get(HEALTHY, 0)
        self.in_catalog = catalog.count_all()
        self.hosts = catalog.offenders("host", window, OFFENDER_LIMIT)
        self.gpus = catalog.offenders("gpu", window, OFFENDER_LIMIT)
        self.incidents = catalog.incidents(window, limit)

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

    def document(self, min_incidents: int, hosts: bool, gpus: bool, listing: bool) -> dict:
        def ranked(offenders: list[Offender], by: str) -> list[dict[str, Any]]:
            return [_offender_dict(o, by, self.total, min_incidents) for o in offenders]

        doc: dict[str, Any] = {
            "kind": OUTPUT_KIND,
            "schema_version": OUTPUT_VERSION,
            "tool": {"name": "frtools", "version": __version__},
            "catalog": os.path.abspath(self.path),
            "generated": iso_utc(time.time_ns()),
            "window": {"since": iso_utc(self.window.since_ns), "job": self.window.job},
            "min_incidents": min_incidents,
            "incidents_in_window": self.total,
            "problems": self.problems,
            "healthy": self.healthy,
            "by_kind": self.by_kind,
            "drain": {
                "hosts": [d for d in ranked(self.hosts, "host") if d["drain"]],
                "gpus": [d for d in ranked(self.gpus, "gpu") if d["drain"]],
            },
        }
        if hosts:
            doc["hosts"] = ranked(self.hosts, "host")
        if gpus:
            doc["gpus"] = ranked(self.gpus, "gpu")
        if listing:
            doc["incidents"] = [i.to_dict() for i in self.incidents]
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


def _renderable(found: _Findings, min_incidents: int, hosts: bool, gpus: bool, listing: bool):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    window = found.window_text()
    drain_hosts = [o for o in found.hosts if o.incidents >= min_incidents]
    drain_gpus = [o for o in found.gpus if o.incidents >= min_incidents]
    head = Text()
    if found.total == 0:
        head.append(" NONE ", style="bold white on blue")
        head.append(f" No incidents recorded {window}", style="bold")
        if found.in_catalog:
            head.append(f" ({found.in_catalog} in the catalog: --since all)", style="dim")
    elif (drain_hosts and hosts) or (drain_gpus and gpus):
        offenders, what = (drain_hosts, "host") if drain_hosts and hosts else (drain_gpus, "GPU")
        top = offenders[0]
        text = (
            f"{what} {terminal(top.name)} was guilty in {top.incidents} of {found.total} incidents"
        )
        if len(offenders) > 1:
            text += f", and {len(offenders) - 1} more {what}(s) in {min_incidents} or more"
        head.append(" REPEAT ", style="bold white on red")
        head.append(f" {text} {window}: drain candidate", style="bold red")
    else:
        noun = "host or GPU" if hosts and gpus else "host" if hosts else "GPU"
        head.append(" OK ", style="bold white on green")
        head.append(
            f" No {noun} guilty in {min_incidents} or more of {found.total} incidents {window}",
            style="bold green",
        )
    parts.append(head)
    summary = f"{_count(found.total, 'incident')}: {_count(found.problems, 'problem')}"
    if found.problems:
        summary += f" ({_kinds_text(found.by_kind)})"
    summary += f", {found.healthy} healthy · {terminal(found.path)}"
    parts.append(Text(summary, style="dim"))

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
            row.append(f"{o.incidents} of {found.total}")
            if not gpu:
                row.append(f"{o.incidents / found.total:.0%}")
            row += [_short_time(o.last_ns), ", ".join(o.kinds)]
            cells = [Text(terminal(cell)) for cell in row]  # text, never markup
            table.add_row(*cells, style="red" if o.incidents >= min_incidents else None)
        parts.append(table)
        if len(offenders) > SHOWN_OFFENDERS:
            parts.append(Text(f"  … {len(offenders) - SHOWN_OFFENDERS} more", style="dim"))

    if found.total and hosts:
        ranking(
            f"Hosts by incidents they were guilty in (red: {min_incidents}+)", found.hosts, False
        )
    if found.total and gpus:
        ranking(f"GPUs by incidents they were guilty in (red: {min_incidents}+)", found.gpus, True)
    if found.total and listing:
        parts.append(Text(""))
        parts.append(
            Text(f"Incidents, newest first ({len(found.incidents)} of {found.total})", style="bold")
        )
        for i in found.incidents:
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


def _render_text(renderable: Any, width: int = 100, color: bool = False) -> str:
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


@click.command("history", cls=OneLineCommand)
@click.argument("catalog", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--hosts", "only_hosts", is_flag=True, help="Show the host ranking only.")
@click.option("--gpus", "only_gpus", is_flag=True, help="Show the GPU ranking only.")
@click.option(
    "--since",
    default="7d",
    show_default=True,
    help="The window: incidents recorded in the last 7d, 12h, 30m, 2w, since an ISO-8601 "
    "date or time (UTC), or all.",
)
@click.option("--job", default=None, help="Only the incidents of this job id.")
@click.option(
    "--min-incidents",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="A host or GPU guilty in this many incidents of the window is a drain candidate.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("terminal", "json")),
    default="terminal",
    show_default=True,
    help="terminal, or json: the drain list (hosts and GPUs with their evidence) and the "
    "rankings, for schedulers; times in UTC ISO-8601.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0, max=10_000),
    default=20,
    show_default=True,
    help="Incidents listed, newest first.",
)
@click.option(
    "--incident",
    "incident_id",
    type=click.IntRange(min=1),
    default=None,
    help="Print the verdict document (JSON) stored with incident ID, and nothing else.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write to FILE instead of stdout.",
)
def history(
    catalog: Path | None,
    only_hosts: bool,
    only_gpus: bool,
    since: str,
    job: str | None,
    min_incidents: int,
    fmt: str,
    limit: int,
    incident_id: int | None,
    output: Path | None,
) -> None:
    """List the incidents recorded in CATALOG (default: $FRTOOLS_HISTORY), newest first,
    and rank hosts and GPUs by how often they were guilty.

    Record verdicts with `frtools analyze DIR --history CATALOG` (or FRTOOLS_HISTORY).
    Exit code 0; 2: the catalog cannot be used, or a usage error.
    """
    now_ns = time.time_ns()
    try:
        since_ns = parse_since(since, now_ns)
    except click.BadParameter as e:
        fail(PREFIX, f"error: {e.format_message()}")
    if catalog is None:
        catalog = catalog_for(None)
    if catalog is None:
        fail(PREFIX, "error: no catalog: give CATALOG or set FRTOOLS_HISTORY")
    window = Window(since_ns=since_ns, job=job)
    # --hosts, --gpus: those rankings alone; neither: both rankings and the incidents
    sections = (
        only_hosts or not only_gpus,
        only_gpus or not only_hosts,
        not (only_hosts or only_gpus),
    )
    run_guarded(
        PREFIX,
        lambda: _run(catalog, window, min_incidents, fmt, limit, incident_id, output, sections),
    )


def _run(
    path: Path,
    window: Window,
    min_incidents: int,
    fmt: str,
    limit: int,
    incident_id: int | None,
    output: Path | None,
    sections: tuple[bool, bool, bool],
) -> int:
    import json

    hosts, gpus, listing = sections

    try:
        with open_catalog(path) as catalog:
            if incident_id is not None:
                document = catalog.verdict_document(incident_id)
                if document is None:
                    fail(PREFIX, f"error: {path}: no incident {incident_id}")
                write_text(PREFIX, json.dumps(document, indent=2) + "\n", output)
                return 0
            found = _Findings(catalog, window, limit)
    except CatalogError as e:
        fail(PREFIX, f"error: {first_line(e)}")
    if fmt == "json":
        doc = found.document(min_incidents, hosts, gpus, listing)
        write_text(PREFIX, json.dumps(doc, indent=2) + "\n", output)
        return 0
    renderable = _renderable(found, min_incidents, hosts, gpus, listing)
    if output is None:
        from rich.console import Console

        console = Console()
        width = min(console.width, 100) if sys.stdout.isatty() else 100
        color = console.color_system is not None and not console.no_color
        write_text(PREFIX, _render_text(renderable, width, color), None)
        return 0
    write_text(PREFIX, _render_text(renderable), output)
    return 0
