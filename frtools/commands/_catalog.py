"""The incident catalog as ``frtools analyze --history`` uses it: what the catalog says about
the guilty hosts before the verdict is out (the repeat-offender rule of docs/actions.md), and
recording the verdict after it. A catalog that cannot take the record is one warning on stderr,
never a lost verdict or another exit code.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from frtools.commands._common import first_line
from frtools.config import DRAIN_WINDOW, DURATION_UNITS, HISTORY

if TYPE_CHECKING:  # the catalog (sqlite3) is imported only when there is one: start-up
    from frtools.formats.incidents import IncidentRecord

JOB_ID_LIMIT = 256
T = TypeVar("T")


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


def _fingerprint(verdict: Any, trace: Any, job_id: str, source: str) -> str:
    from frtools.formats.incidents import records_fingerprint

    pg = verdict.process_group
    return records_fingerprint(
        None if source == "path" else job_id,  # a path is where the files are, not what
        record_identities(trace),
        [pg.name if pg else None, verdict.op, verdict.collective_seq_id, verdict.p2p_seq_id],
    )


def _record(cls: type[T], source: Any, **fields: Any) -> T:
    """A catalog record of ``cls`` with the fields of the same names as ``source``'s (a
    verdict's guilty rank or device finding), ``fields`` set."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{n: getattr(source, n) for n in names if n not in fields}, **fields)


def incident_from(verdict: Any, trace: Any, path: Path) -> IncidentRecord:
    """The catalog's record of one analysis."""
    from frtools.formats.incidents import FindingRecord, GuiltyRecord, IncidentRecord

    job_id, source = job_identity(path, trace)
    dump_times = [
        i.dump_time_ns
        for i in trace.ranks.values()
        if isinstance(i.dump_time_ns, int) and i.dump_time_ns > 0
    ]
    pg = verdict.process_group
    guilty = [_record(GuiltyRecord, g) for g in verdict.guilty]
    findings = [
        _record(FindingRecord, f, rank=g.rank, host=f.host or g.host)
        for g in verdict.guilty
        for f in getattr(g, "findings", ())
    ]
    action = getattr(verdict, "action", None)
    return IncidentRecord(
        fingerprint=_fingerprint(verdict, trace, job_id, source),
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
        action=action.kind if action is not None else None,
        findings=findings,
    )


def catalog_for(option: Path | None) -> Path | None:
    """``--history PATH``, else ``FRTOOLS_HISTORY``, else None (record nothing)."""
    if option is not None:
        return option
    value = HISTORY.read()
    return Path(value) if value else None


def duration_text(seconds: float) -> str:
    """``604800`` -> ``7d``; ``43200`` -> ``12h``; ``90`` -> ``90s``."""
    for unit in ("d", "h", "m"):
        size = DURATION_UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def host_history(catalog: Path, verdict: Any, trace: Any, path: Path) -> Any:
    """What the catalog says about the verdict's guilty hosts (``HostHistory``): for each, the
    incidents of the last ``FRTOOLS_DRAIN_WINDOW`` it was guilty in, this one counted once
    however often it was analyzed. A catalog not made yet holds none; one that cannot be read
    says why (recording it then warns too)."""
    from frtools.analyze.action import HostHistory
    from frtools.formats.incidents import CatalogError, Window, open_catalog

    seconds = DRAIN_WINDOW.read()
    window = f"the last {duration_text(seconds)}"
    hosts = sorted({g.host for g in verdict.guilty if g.host})
    if not hosts or not catalog.exists() or catalog.stat().st_size == 0:
        return HostHistory(catalog=str(catalog), window=window, incidents=dict.fromkeys(hosts, 1))
    try:
        job_id, source = job_identity(path, trace)
        this = _fingerprint(verdict, trace, job_id, source)
        since = time.time_ns() - int(seconds * 1e9)
        with open_catalog(catalog) as reader:
            counts = reader.host_incidents(hosts, Window(since_ns=since), other_than=this)
    except (CatalogError, OSError) as e:
        return HostHistory(catalog=str(catalog), window=window, unreadable=first_line(e))
    return HostHistory(
        catalog=str(catalog), window=window, incidents={h: counts.get(h, 0) + 1 for h in hosts}
    )


def record_verdict(catalog: Path, verdict: Any, trace: Any, path: Path) -> None:
    """Record the verdict in ``catalog``; a failure is one warning on stderr, nothing more."""
    from frtools.formats.incidents import CatalogError, record_incident

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
