"""The incident catalog: every verdict ``frtools analyze --history FILE`` gave, in one SQLite
file, so that ``frtools history`` can name the hosts and GPUs that keep being guilty.

SQLite (standard library), not DuckDB: several jobs may finish at once and each ``analyze``
writes its record from its own process. SQLite serializes writer processes with file locks
(``BEGIN IMMEDIATE`` and a busy timeout: a writer waits for the one before it) and, in WAL
mode, lets readers go on while one writes; DuckDB allows one writing process per file.
The catalog lives on a local file system: WAL needs shared memory between the processes that
open it, which network file systems do not give.

Schema version 2 (``SCHEMA_VERSION``; docs/history.md shows the whole schema):

* ``schema_version`` — one row per schema version applied to the file, with the catalog's
  kind (``CATALOG_KIND``). The file's version is the highest. A later frtools migrates a
  file forward inside the writer's transaction (``_MIGRATIONS``); a file of a newer version
  is refused, never rewritten.
* ``incidents`` — one row per analyzed dump set: the job, the times, the verdict's kind,
  headline, group, op, call site, the frtools version and the verdict document (JSON).
  A dump set analyzed again stays one incident — wherever its files lie: the
  ``fingerprint`` is a digest of the records themselves (the job id, every rank's record
  identity, the hung op; ``records_fingerprint``), not of paths or mtimes — its verdict is
  replaced by the newest and ``analyses`` counts the runs, so ``analyze`` and ``report`` of
  the same dumps, or of a copy of them, do not make a host look twice as guilty.
* ``guilty`` — one row per guilty rank of an incident: rank, host, device, device_id, the
  GPU identity ``frtools history`` ranks by (``gpu_identity``), pid, call site, reason.
  A host, device or device id that is not a valid name (``valid_host``, ``valid_device``) is
  stored as unknown (NULL: never ranked), the reason saying so; an incident of more than
  ``GUILTY_LIMIT`` guilty ranks is refused by name, never stored in part.
* ``findings`` (version 2) — what was abnormal on a guilty rank's host, GPU or NIC (the
  verdict's device findings: source, code, text, whether it counts as hardware evidence),
  up to ``FINDINGS_LIMIT`` per incident; and ``incidents.action``, the verdict's next action
  (docs/actions.md), so that ``frtools history`` says why a host is to be drained.

A catalog is data another process wrote: readers open it read-only (``mode=ro``), refuse a
file that is not SQLite or not a catalog of a known version, use no function or view its
schema may declare, cut every text they read (``TEXT_LIMIT``; a list is read as JSON, never
as cut text) and stop when their queries together run longer than ``QUERY_SECONDS``, each
question being a fixed number of queries, so a catalog whose indexes are gone is slow at
worst, never unbounded. A writer puts back missing indexes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import socket
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frtools import __version__
from frtools.formats.limits import strict_int

CATALOG_KIND = "frtools-incident-catalog"
SCHEMA_VERSION = 2
APPLICATION_ID = 0x46524943  # "FRIC" in the SQLite header: `file` and tools can tell
SQLITE_MAGIC = b"SQLite format 3\x00"

BUSY_TIMEOUT_S = 10.0  # a writer waits this long for the one before it
QUERY_SECONDS = 20.0  # a reader gives up when its queries together run longer (hostile file)
TEXT_LIMIT = 512  # characters kept of any text field a reader lists
DOCUMENT_LIMIT = 16 << 20  # bytes of a stored verdict document
GUILTY_LIMIT = 10_000  # guilty ranks stored per incident
FINDINGS_LIMIT = 1_000  # device findings stored per incident (the rest are left out)
FINDINGS_PER_EVIDENCE = 10  # findings a reader lists per incident of a host's evidence

HEALTHY = "healthy"

_SCHEMA_V1 = (
    """CREATE TABLE schema_version (
        version INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        applied_ns INTEGER NOT NULL,
        frtools_version TEXT NOT NULL
    )""",
    """CREATE TABLE incidents (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        fingerprint TEXT NOT NULL UNIQUE,
        job_id TEXT NOT NULL,
        job_id_source TEXT NOT NULL,
        path TEXT NOT NULL,
        recorded_ns INTEGER NOT NULL,
        analyzed_ns INTEGER NOT NULL,
        analyses INTEGER NOT NULL DEFAULT 1,
        dump_ns INTEGER,
        analyzed_on TEXT,
        kind TEXT NOT NULL,
        headline TEXT NOT NULL,
        confidence REAL,
        pg_name TEXT,
        pg_desc TEXT,
        op TEXT,
        collective_seq_id INTEGER,
        p2p_seq_id INTEGER,
        call_site TEXT,
        frtools_version TEXT NOT NULL,
        verdict_json TEXT NOT NULL
    )""",
    "CREATE INDEX incidents_by_time ON incidents (recorded_ns)",
    "CREATE INDEX incidents_by_job ON incidents (job_id)",
    """CREATE TABLE guilty (
        incident_id INTEGER NOT NULL REFERENCES incidents (id) ON DELETE CASCADE,
        rank INTEGER NOT NULL,
        host TEXT,
        device TEXT,
        device_id TEXT,
        gpu TEXT,
        pid INTEGER,
        local_rank INTEGER,
        call_site TEXT,
        reason TEXT,
        PRIMARY KEY (incident_id, rank)
    )""",
    "CREATE INDEX guilty_by_host ON guilty (host)",
    "CREATE INDEX guilty_by_gpu ON guilty (gpu)",
)

# version 2: the verdict's next action and the guilty ranks' device findings
_SCHEMA_V2 = (
    "ALTER TABLE incidents ADD COLUMN action TEXT",
    """CREATE TABLE findings (
        incident_id INTEGER NOT NULL REFERENCES incidents (id) ON DELETE CASCADE,
        rank INTEGER NOT NULL,
        host TEXT,
        source TEXT NOT NULL,
        code TEXT NOT NULL,
        text TEXT NOT NULL,
        hardware INTEGER NOT NULL,
        gpu INTEGER,
        pci_bus_id TEXT,
        time TEXT
    )""",
    "CREATE INDEX findings_by_incident ON findings (incident_id, rank)",
)
_SCHEMA = _SCHEMA_V1 + _SCHEMA_V2  # what a new file gets

# version -> statements that bring a file of the version before it up to it
_MIGRATIONS: dict[int, tuple[str, ...]] = {2: _SCHEMA_V2}


@functools.cache
def _schema_columns() -> dict[str, set[str]]:
    """Every table of the current schema and its columns, as SQLite itself reads the schema
    (what a file of this version must have)."""
    conn = sqlite3.connect(":memory:")
    try:
        for statement in _SCHEMA:
            conn.execute(statement)
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        return {t: {str(r[1]) for r in conn.execute(f"PRAGMA table_info({t})")} for t in tables}
    finally:
        conn.close()


class CatalogError(Exception):
    """A catalog that cannot be used; the message is one line that names the file."""


# -- the records ---------------------------------------------------------------------------


def gpu_identity(host: str | None, device: str | None, device_id: str | None) -> str | None:
    """What names one physical GPU across jobs: its UUID / PCI id when known, else
    ``host/device`` (``node7/cuda:3``); ``None`` when neither says which GPU it was."""
    if device_id:
        return device_id
    if host and device and device != "cpu":
        return f"{host}/{device}"
    return None


@dataclass
class GuiltyRecord:
    rank: int
    host: str | None = None
    device: str | None = None
    device_id: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    call_site: str | None = None
    reason: str = ""

    @property
    def gpu(self) -> str | None:
        return gpu_identity(self.host, self.device, self.device_id)


@dataclass(frozen=True, kw_only=True)
class FindingRecord:
    """One device finding of a guilty rank, as the catalog stores it (the verdict's
    ``DeviceFinding``)."""

    rank: int
    host: str | None
    source: str
    code: str
    text: str
    hardware: bool
    gpu: int | None = None
    pci_bus_id: str | None = None
    time: str | None = None


@dataclass
class IncidentRecord:
    """One analysis of one dump set, as the catalog stores it."""

    fingerprint: str  # which records (records_fingerprint): the same records are one incident
    job_id: str
    job_id_source: str  # "manifest", "snapshot" or "path"
    path: str  # the analyzed path
    kind: str
    headline: str
    verdict_document: dict[str, Any]
    confidence: float | None = None
    guilty: list[GuiltyRecord] = field(default_factory=list)
    pg_name: str | None = None
    pg_desc: str | None = None
    op: str | None = None
    collective_seq_id: int | None = None
    p2p_seq_id: int | None = None
    call_site: str | None = None
    dump_ns: int | None = None  # when the dumps were taken, as the ranks' clocks said
    action: str | None = None  # the verdict's next action (docs/actions.md)
    findings: list[FindingRecord] = field(default_factory=list)
    analyzed_ns: int = field(default_factory=time.time_ns)
    analyzed_on: str = field(default_factory=socket.gethostname)
    frtools_version: str = __version__


def records_fingerprint(
    job_id: str | None, ranks: Iterable[Sequence[Any]], hung: Sequence[Any]
) -> str:
    """A digest of what the records are: the job id (None when only a path names it), every
    rank's record identity (rank, host, pid, how many ops, the newest record id and time),
    and the hung op (group, op, sequence ids). The same dumps, analyzed again or from a
    copied folder, give the same fingerprint; later or other records give another."""
    payload = {"job": job_id, "ranks": sorted(list(r) for r in ranks), "hung": list(hung)}
    text = json.dumps(payload, separators=(",", ":"), default=str, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._/-]{0,127}")


def valid_host(text: Any) -> str | None:
    """``text`` when it is a host name by RFC 1123's grammar (at most 253 characters), else
    None: a dump's host field is whatever its writer put there."""
    if not isinstance(text, str) or not 0 < len(text) <= 253:
        return None
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    return text if all(_HOST_LABEL.fullmatch(label) for label in labels) else None


def valid_device(text: Any) -> str | None:
    """A device (``cuda:3``) or device id (``GPU-…`` UUID, PCI bus id) of plain characters,
    else None."""
    return text if isinstance(text, str) and _DEVICE.fullmatch(text) else None


def _checked(g: GuiltyRecord) -> GuiltyRecord:
    """``g`` with names that are not names stored as unknown, and said so in the reason."""
    host, device, device_id = valid_host(g.host), valid_device(g.device), valid_device(g.device_id)
    checked = (("host", g.host, host), ("device", g.device, device), ("id", g.device_id, device_id))
    wrong = [
        f"{what} {json.dumps(str(raw)[:80])}"
        for what, raw, ok in checked
        if raw not in (None, "") and ok is None
    ]
    if not wrong:
        return g
    note = f"not a valid name, stored as unknown: {', '.join(wrong)}"
    return dataclasses.replace(
        g,
        host=host,
        device=device,
        device_id=device_id,
        reason=f"{g.reason} ({note})" if g.reason else note,
    )


def iso_utc(ns: int | None) -> str | None:
    """``2026-11-30T18:07:35Z`` (UTC, ISO-8601, seconds) or None."""
    if ns is None:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))
    except (OverflowError, OSError, ValueError):
        return None


# -- writing -------------------------------------------------------------------------------


def record_incident(
    path: str | os.PathLike[str], incident: IncidentRecord, *, timeout_s: float = BUSY_TIMEOUT_S
) -> int:
    """Add ``incident`` to the catalog at ``path`` (created when absent); its id.

    One transaction per record, serialized with other writer processes by SQLite's lock
    (waiting up to ``timeout_s``). ``CatalogError`` when the file cannot take it: not SQLite,
    somebody else's database, a newer catalog version, locked past the timeout, read-only,
    disk full.
    """
    path = Path(path)
    if len(incident.guilty) > GUILTY_LIMIT:
        raise CatalogError(
            f"{path}: an incident of {len(incident.guilty):,} guilty ranks is beyond the "
            f"limit of {GUILTY_LIMIT:,} (GUILTY_LIMIT); not recorded"
        )
    _refuse_non_catalog_file(path, creating=True)
    _create_private(path)
    try:
        conn = sqlite3.connect(str(path), timeout=timeout_s, isolation_level=None)
    except sqlite3.Error as e:
        raise CatalogError(_reason(path, e)) from None
    try:
        conn.execute("PRAGMA trusted_schema = OFF")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = _catalog_version(conn, path)
            if version is None:
                _create_schema(conn)
            elif version < SCHEMA_VERSION:
                _migrate(conn, version)
            _restore_indexes(conn)
            incident_id = _upsert(conn, incident)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        _use_wal(conn)
        return incident_id
    except sqlite3.Error as e:
        raise CatalogError(_reason(path, e)) from None
    finally:
        conn.close()


def _create_private(path: Path) -> None:
    """Create the catalog file for this user alone (0600) if it does not exist yet."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as e:
        raise CatalogError(f"{path}: cannot create the catalog: {e.strerror or e}") from None
    os.close(fd)


def _create_schema(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA:
        conn.execute(statement)
    conn.execute(
        "INSERT INTO schema_version VALUES (?, ?, ?, ?)",
        (SCHEMA_VERSION, CATALOG_KIND, time.time_ns(), __version__),
    )
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _restore_indexes(conn: sqlite3.Connection) -> None:
    """Put back an index of the schema that the file lost (readers cannot: read-only)."""
    for statement in _SCHEMA:
        if statement.startswith("CREATE INDEX "):
            conn.execute(statement.replace("CREATE INDEX ", "CREATE INDEX IF NOT EXISTS ", 1))


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in _MIGRATIONS[target]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_version VALUES (?, ?, ?, ?)",
            (target, CATALOG_KIND, time.time_ns(), __version__),
        )
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _use_wal(conn: sqlite3.Connection) -> None:
    """WAL: readers never wait for a writer. Set once per file, by whoever can; a writer that
    finds the file busy leaves it to the next."""
    try:
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
    except sqlite3.Error:
        pass


def _document_text(document: dict[str, Any]) -> str:
    """The verdict document as compact JSON, under ``DOCUMENT_LIMIT``: a job of many
    thousand ranks lists its inputs and waiting ranks, which the verdict can do without."""
    text = json.dumps(document, separators=(",", ":"), default=str)
    if len(text) <= DOCUMENT_LIMIT:
        return text
    verdict = document.get("verdict") if isinstance(document.get("verdict"), dict) else {}
    slim = {
        **{k: v for k, v in document.items() if k not in ("inputs", "verdict")},
        "verdict": {k: v for k, v in verdict.items() if k not in ("waiting", "groups")},
        "truncated": "inputs, waiting ranks and rank groups left out (too large)",
    }
    text = json.dumps(slim, separators=(",", ":"), default=str)
    if len(text) <= DOCUMENT_LIMIT:
        return text
    return json.dumps(
        {
            "schema_version": document.get("schema_version"),
            "verdict": {"kind": verdict.get("kind"), "headline": verdict.get("headline")},
            "truncated": "the verdict document was too large to keep",
        },
        default=str,
    )


def _upsert(conn: sqlite3.Connection, incident: IncidentRecord) -> int:
    values = {
        "job_id": incident.job_id,
        "job_id_source": incident.job_id_source,
        "path": incident.path,
        "analyzed_ns": incident.analyzed_ns,
        "dump_ns": incident.dump_ns,
        "analyzed_on": incident.analyzed_on,
        "kind": incident.kind,
        "headline": incident.headline,
        "confidence": incident.confidence,
        "pg_name": incident.pg_name,
        "pg_desc": incident.pg_desc,
        "op": incident.op,
        "collective_seq_id": incident.collective_seq_id,
        "p2p_seq_id": incident.p2p_seq_id,
        "call_site": incident.call_site,
        "frtools_version": incident.frtools_version,
        "verdict_json": _document_text(incident.verdict_document),
        "action": incident.action,
    }
    row = conn.execute(
        "SELECT id FROM incidents WHERE fingerprint = ?", (incident.fingerprint,)
    ).fetchone()
    if row is None:
        columns = ["fingerprint", "recorded_ns", *values]
        conn.execute(
            f"INSERT INTO incidents ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' * len(columns))})",
            (incident.fingerprint, incident.analyzed_ns, *values.values()),
        )
        incident_id = int(conn.execute("SELECT last_insert_rowid()").fetchone()[0])
    else:  # the same dumps again: one incident, its newest verdict
        incident_id = int(row[0])
        conn.execute(
            f"UPDATE incidents SET {', '.join(f'{k} = ?' for k in values)}, "
            "analyses = analyses + 1 WHERE id = ?",
            (*values.values(), incident_id),
        )
        conn.execute("DELETE FROM guilty WHERE incident_id = ?", (incident_id,))
        conn.execute("DELETE FROM findings WHERE incident_id = ?", (incident_id,))
    guilty = [_checked(g) for g in incident.guilty]
    conn.executemany(
        "INSERT OR IGNORE INTO guilty VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (incident_id, g.rank, g.host, g.device, g.device_id, g.gpu, g.pid, g.local_rank)
            + (g.call_site, g.reason)
            for g in guilty
        ],
    )
    conn.executemany(
        "INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (incident_id, f.rank, valid_host(f.host), f.source[:64], f.code[:128])
            + (f.text[:TEXT_LIMIT], int(bool(f.hardware)), f.gpu, f.pci_bus_id, f.time)
            for f in incident.findings[:FINDINGS_LIMIT]
        ],
    )
    return incident_id


# -- checking a file -----------------------------------------------------------------------


def _reason(path: Path, error: BaseException) -> str:
    """One line for an SQLite error, naming the file."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    lowered = text.lower()
    if "locked" in lowered or "busy" in lowered:
        text = "locked by another process (gave up waiting)"
    elif "readonly" in lowered or "read-only" in lowered:
        text = "read-only (cannot write the catalog)"
    elif "not a database" in lowered:
        text = "not an SQLite database (corrupt or encrypted header)"
    elif "malformed" in lowered:
        text = "corrupt SQLite file (database disk image is malformed)"
    elif "interrupted" in lowered:
        text = f"a query ran longer than {QUERY_SECONDS:.0f} s (too large or hostile)"
    elif "full" in lowered:
        text = "disk full"
    return f"{path}: {text}"


def _refuse_non_catalog_file(path: Path, *, creating: bool) -> None:
    """Refuse, before SQLite touches it, a path that is not a regular file holding SQLite.
    An empty file is a catalog yet to be created, when ``creating``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if creating:
            return
        raise CatalogError(f"{path}: no such file") from None
    except OSError as e:
        raise CatalogError(f"{path}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CatalogError(f"{path}: not a regular file")
    if st.st_size == 0:
        if creating:
            return
        raise CatalogError(f"{path}: empty file, not an frtools incident catalog")
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise CatalogError(f"{path}: cannot read: {e.strerror or e}") from None
    if head != SQLITE_MAGIC:
        raise CatalogError(f"{path}: not an SQLite file, so not an frtools incident catalog")


def _catalog_version(conn: sqlite3.Connection, path: Path) -> int | None:
    """The file's schema version; None for an empty database (a new catalog).
    ``CatalogError`` for somebody else's database or a version this frtools does not know."""
    objects = {
        str(name): str(kind)
        for name, kind in conn.execute(
            "SELECT name, type FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' LIMIT 1000"
        )
    }
    if not objects:
        return None
    if objects.get("schema_version") != "table":
        raise CatalogError(f"{path}: an SQLite database, but not an frtools incident catalog")
    rows = conn.execute("SELECT kind, version FROM schema_version LIMIT 1000").fetchall()
    if not rows or any(kind != CATALOG_KIND for kind, _ in rows):
        raise CatalogError(f"{path}: an SQLite database, but not an frtools incident catalog")
    versions = [v for _, v in rows]
    if not all(isinstance(v, int) for v in versions):
        raise CatalogError(f"{path}: corrupt catalog: schema versions {versions[:5]!r}")
    version = max(versions)
    if version > SCHEMA_VERSION:
        raise CatalogError(
            f"{path}: written by a newer frtools (catalog schema {version}; "
            f"this frtools knows up to {SCHEMA_VERSION})"
        )
    if version < 1:
        raise CatalogError(f"{path}: corrupt catalog: schema version {version}")
    if version == SCHEMA_VERSION:
        for table, needed in _schema_columns().items():
            if objects.get(table) != "table":
                raise CatalogError(f"{path}: corrupt catalog: no table {table}")
            have = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}
            if not needed <= have:
                missing = ", ".join(sorted(needed - have)[:5])
                raise CatalogError(f"{path}: corrupt catalog: {table} lacks {missing}")
    return version


# -- reading -------------------------------------------------------------------------------


@dataclass
class Window:
    """Which incidents a question is about: recorded at or after ``since_ns`` (None: all),
    of job ``job`` (None: every job)."""

    since_ns: int | None = None
    job: str | None = None

    def where(self, alias: str = "i") -> tuple[str, list[Any]]:
        clauses, params = ["1"], []
        if self.since_ns is not None:
            clauses.append(f"{alias}.recorded_ns >= ?")
            params.append(self.since_ns)
        if self.job is not None:
            clauses.append(f"{alias}.job_id = ?")
            params.append(self.job)
        return " AND ".join(clauses), params


@dataclass
class StoredGuilty:
    rank: int
    host: str | None
    device: str | None
    device_id: str | None
    gpu: str | None
    call_site: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "device": self.device,
            "device_id": self.device_id,
            "gpu": self.gpu,
            "call_site": self.call_site,
        }


@dataclass
class StoredIncident:
    """One incident as a reader lists it (texts cut at ``TEXT_LIMIT``)."""

    id: int
    recorded_ns: int
    analyzed_ns: int
    analyses: int
    dump_ns: int | None
    job_id: str
    job_id_source: str
    path: str
    kind: str
    headline: str
    confidence: float | None
    pg_name: str | None
    pg_desc: str | None
    op: str | None
    collective_seq_id: int | None
    p2p_seq_id: int | None
    call_site: str | None
    frtools_version: str
    guilty: list[StoredGuilty] = field(default_factory=list)
    guilty_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "time": iso_utc(self.recorded_ns),
            "last_analyzed": iso_utc(self.analyzed_ns),
            "analyses": self.analyses,
            "dump_time": iso_utc(self.dump_ns),
            "job_id": self.job_id,
            "job_id_source": self.job_id_source,
            "path": self.path,
            "kind": self.kind,
            "headline": self.headline,
            "confidence": self.confidence,
            "process_group": None
            if self.pg_name is None
            else {"name": self.pg_name, "desc": self.pg_desc},
            "op": self.op,
            "collective_seq_id": self.collective_seq_id,
            "p2p_seq_id": self.p2p_seq_id,
            "call_site": self.call_site,
            "guilty": [g.to_dict() for g in self.guilty],
            "guilty_total": self.guilty_total,
            "frtools_version": self.frtools_version,
        }


@dataclass
class Offender:
    """A host or a GPU and the incidents of the window that blamed it."""

    name: str  # the host name, or the GPU identity
    incidents: int
    first_ns: int
    last_ns: int
    kinds: list[str]
    host: str | None = None  # for a GPU: its host and device, as last seen
    device: str | None = None
    evidence: list[dict[str, Any]] = field(default_factory=list)
    drain_actions: int = 0  # incidents whose verdict asked to drain it (catalog version 2)
    hardware_incidents: int = 0  # incidents with hardware evidence against it


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > TEXT_LIMIT:
        return value[: TEXT_LIMIT - 1] + "…"
    if isinstance(value, bytes):  # a hostile file may put blobs where text belongs
        return _cut(value.decode("utf-8", "replace"))
    return value


def _int(value: Any) -> int | None:
    return strict_int(value)  # the one rule for an int read from a file


def _rank_list(text: Any) -> list[int]:
    """The ranks of a ``json_group_array``, whole (a hostile file's non-integers left out)."""
    try:
        values = json.loads(text) if isinstance(text, str) else []
    except ValueError:
        return []
    ranks = values if isinstance(values, list) else []
    return sorted(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))


class CatalogReader:
    """A catalog opened read-only. Every method reads a bounded amount."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self._deadline = time.monotonic() + QUERY_SECONDS  # all its queries together
        # a version-1 file (read-only: never migrated here) has no actions and no findings
        self.has_findings = bool(
            self._rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'findings'")
        ) and "action" in {str(r[1]) for r in self._rows("PRAGMA table_info(incidents)")}

    def host_incidents(
        self, hosts: Sequence[str], window: Window, *, other_than: str | None = None
    ) -> dict[str, int]:
        """For each of ``hosts``, the incidents of the window it was guilty in, the incident
        of fingerprint ``other_than`` (the one being analyzed) left out."""
        where, params = window.where()
        rows = self._rows(
            "SELECT g.host, COUNT(DISTINCT i.id) FROM guilty g JOIN incidents i "
            f"ON i.id = g.incident_id WHERE {where} AND g.host IN "
            "(SELECT value FROM json_each(?)) AND i.fingerprint IS NOT ? GROUP BY g.host",
            [*params, json.dumps(list(hosts)[:GUILTY_LIMIT]), other_than],
        )
        return {str(host): int(n) for host, n in rows if isinstance(n, int)}

    def _rows(
        self, sql: str, params: Sequence[Any] = (), *, cut: bool = True
    ) -> list[tuple[Any, ...]]:
        deadline = self._deadline
        self._conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        try:
            rows = self._conn.execute(sql, params)
            return [tuple(_cut(v) for v in row) for row in rows] if cut else rows.fetchall()
        except sqlite3.Error as e:
            raise CatalogError(_reason(self.path, e)) from None
        finally:
            self._conn.set_progress_handler(None, 0)

    def count_by_kind(self, window: Window) -> dict[str, int]:
        where, params = window.where()
        rows = self._rows(
            f"SELECT kind, COUNT(*) FROM incidents i WHERE {where} "
            "GROUP BY kind ORDER BY COUNT(*) DESC LIMIT 100",
            params,
        )
        return {str(kind): int(n) for kind, n in rows}

    def count_all(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM incidents")[0][0])

    def incidents(self, window: Window, limit: int, guilty_limit: int = 16) -> list[StoredIncident]:
        """The newest ``limit`` incidents of the window, newest first, with up to
        ``guilty_limit`` guilty ranks each."""
        where, params = window.where()
        rows = self._rows(
            "SELECT id, recorded_ns, analyzed_ns, analyses, dump_ns, job_id, job_id_source, "
            "path, kind, headline, confidence, pg_name, pg_desc, op, collective_seq_id, "
            "p2p_seq_id, call_site, frtools_version, "
            "(SELECT COUNT(*) FROM guilty g WHERE g.incident_id = i.id) "
            f"FROM incidents i WHERE {where} ORDER BY recorded_ns DESC, id DESC LIMIT ?",
            [*params, limit],
        )
        found = []
        for row in rows:
            (iid, rec, ana, n, dump, job, job_src, path, kind, head, conf, pg, desc, op, cseq,
             pseq, site, version, total) = row  # fmt: skip
            found.append(
                StoredIncident(
                    id=int(iid),
                    recorded_ns=int(rec),
                    analyzed_ns=int(ana),
                    analyses=int(n),
                    dump_ns=_int(dump),
                    job_id=str(job),
                    job_id_source=str(job_src),
                    path=str(path),
                    kind=str(kind),
                    headline=str(head),
                    confidence=conf if isinstance(conf, float | int) else None,
                    pg_name=pg,
                    pg_desc=desc,
                    op=op,
                    collective_seq_id=_int(cseq),
                    p2p_seq_id=_int(pseq),
                    call_site=site,
                    frtools_version=str(version),
                    guilty_total=int(total),
                )
            )
        for incident in found:
            incident.guilty = [
                StoredGuilty(_int(r[0]) or 0, r[1], r[2], r[3], r[4], r[5])
                for r in self._rows(
                    "SELECT rank, host, device, device_id, gpu, call_site FROM guilty "
                    "WHERE incident_id = ? ORDER BY rank LIMIT ?",
                    (incident.id, guilty_limit),
                )
            ]
        return found

    def offenders(
        self, by: str, window: Window, limit: int, evidence_limit: int = 20
    ) -> list[Offender]:
        """Hosts (``by="host"``) or GPUs (``by="gpu"``) by how many incidents of the window
        blamed them, most first (then most recent); each with up to ``evidence_limit`` of
        those incidents, newest first."""
        if by not in ("host", "gpu"):
            raise ValueError(by)
        where, params = window.where()
        v2 = self.has_findings
        drains = "COUNT(DISTINCT CASE WHEN i.action = 'drain' THEN i.id END)" if v2 else "0"
        hardware = (
            "COUNT(DISTINCT CASE WHEN EXISTS (SELECT 1 FROM findings f WHERE f.incident_id = "
            "i.id AND f.rank = g.rank AND f.hardware = 1) THEN i.id END)"
            if v2
            else "0"
        )
        rows = self._rows(
            f"SELECT g.{by}, COUNT(DISTINCT i.id) AS n, MIN(i.recorded_ns), "
            f"MAX(i.recorded_ns) AS last, {drains}, {hardware} FROM guilty g JOIN incidents i "
            f"ON i.id = g.incident_id WHERE {where} AND g.{by} IS NOT NULL AND g.{by} != '' "
            f"GROUP BY g.{by} ORDER BY n DESC, last DESC, g.{by} LIMIT ?",
            [*params, limit],
        )
        found = {
            str(name): Offender(
                name=str(name),
                incidents=int(n),
                first_ns=int(first),
                last_ns=int(last),
                kinds=[],
                drain_actions=_int(d) or 0,
                hardware_incidents=_int(hw) or 0,
            )
            for name, n, first, last, d, hw in rows
        }
        if not found:
            return []
        # the same three queries whatever the number of offenders: bounded also without the
        # indexes (a scan each), and the names go in as a table, not as 1,000 parameters
        names = json.dumps(list(found))
        picked = f"g.{by} IN (SELECT value FROM json_each(?))"
        for name, kind in self._rows(
            f"SELECT DISTINCT g.{by}, i.kind FROM guilty g JOIN incidents i "
            f"ON i.id = g.incident_id WHERE {where} AND {picked} ORDER BY i.kind",
            [*params, names],
        ):
            kinds = found[str(name)].kinds if str(name) in found else []
            if len(kinds) < 20:
                kinds.append(str(kind))
        evidence = self._rows(
            f"SELECT name, iid, kind, rec, job, ranks, host, device, action FROM (SELECT g.{by} "
            "AS name, i.id AS iid, i.kind AS kind, i.recorded_ns AS rec, i.job_id AS job, "
            f"{'i.action' if v2 else 'NULL'} AS action, "
            "json_group_array(g.rank) AS ranks, MAX(g.host) AS host, MAX(g.device) AS device, "
            f"ROW_NUMBER() OVER (PARTITION BY g.{by} ORDER BY i.recorded_ns DESC, i.id DESC) "
            "AS k FROM guilty g JOIN incidents i ON i.id = g.incident_id "
            f"WHERE {where} AND {picked} GROUP BY g.{by}, i.id) WHERE k <= ? "
            "ORDER BY name, k",
            [*params, names, evidence_limit],
            cut=False,
        )
        for name, iid, kind, rec, job, ranks, host, device, action in evidence:
            offender = found.get(_cut(str(name)))
            if offender is None:
                continue
            if offender.host is None:
                offender.host, offender.device = _cut(host), _cut(device)
            offender.evidence.append(
                {
                    "incident": int(iid),
                    "kind": _cut(str(kind)),
                    "time": iso_utc(_int(rec)),
                    "job_id": _cut(str(job)),
                    "ranks": _rank_list(ranks),
                    "action": _cut(action) if isinstance(action, str) else None,
                    "findings": [],
                }
            )
        if v2:
            self._attach_findings(by, found, where, params, picked, names)
        return list(found.values())

    def _attach_findings(
        self,
        by: str,
        found: dict[str, Offender],
        where: str,
        params: list[Any],
        picked: str,
        names: str,
    ) -> None:
        """Each evidence incident's device findings on the offender (hardware first), at most
        ``FINDINGS_PER_EVIDENCE`` each: one query, however many offenders."""
        listed = {(o.name, e["incident"]): e for o in found.values() for e in o.evidence}
        if not listed:
            return
        rows = self._rows(
            "SELECT name, iid, source, code, text, hardware, gpu, pci, t, host FROM (SELECT "
            f"g.{by} AS name, f.incident_id AS iid, f.source AS source, f.code AS code, "
            "f.text AS text, f.hardware AS hardware, f.gpu AS gpu, f.pci_bus_id AS pci, "
            f"f.time AS t, f.host AS host, ROW_NUMBER() OVER (PARTITION BY g.{by}, f.incident_id "
            "ORDER BY f.hardware DESC, f.rowid) AS k FROM findings f JOIN guilty g ON "
            "g.incident_id = f.incident_id AND g.rank = f.rank JOIN incidents i ON i.id = "
            f"f.incident_id WHERE {where} AND {picked}) WHERE k <= ? LIMIT ?",
            [*params, names, FINDINGS_PER_EVIDENCE, FINDINGS_PER_EVIDENCE * len(listed)],
        )
        for name, iid, source, code, text, hardware, gpu, pci, when, host in rows:
            entry = listed.get((str(name), _int(iid)))
            if entry is None:
                continue
            entry["findings"].append(
                {
                    "host": host if isinstance(host, str) else None,
                    "source": str(source),
                    "code": str(code),
                    "text": str(text),
                    "hardware": hardware == 1,
                    "gpu": _int(gpu),
                    "pci_bus_id": pci if isinstance(pci, str) else None,
                    "time": when if isinstance(when, str) else None,
                }
            )

    def verdict_document(self, incident_id: int) -> dict[str, Any] | None:
        """The verdict document stored with an incident (None: no such incident)."""
        rows = self._rows(
            "SELECT substr(verdict_json, 1, ?) FROM incidents WHERE id = ?",
            (DOCUMENT_LIMIT, incident_id),
            cut=False,
        )
        if not rows:
            return None
        text = rows[0][0]
        try:
            document = json.loads(text if isinstance(text, str) else "")
        except ValueError:
            raise CatalogError(
                f"{self.path}: incident {incident_id}: the stored verdict is not JSON"
            ) from None
        if not isinstance(document, dict):
            raise CatalogError(f"{self.path}: incident {incident_id}: no verdict document")
        return document


def _connect_read_only(path: Path, timeout_s: float, immutable: bool) -> sqlite3.Connection:
    """A read-only connection whose first queries have checked that the file is a catalog."""
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    conn = sqlite3.connect(
        uri + ("&immutable=1" if immutable else ""),
        uri=True,
        timeout=timeout_s,
        isolation_level=None,
    )
    try:
        deadline = time.monotonic() + QUERY_SECONDS
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        conn.execute("PRAGMA trusted_schema = OFF")
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA cell_size_check = ON")
        if _catalog_version(conn, path) is None:
            raise CatalogError(f"{path}: an empty SQLite database, not an incident catalog")
        conn.set_progress_handler(None, 0)
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def open_catalog(
    path: str | os.PathLike[str], *, timeout_s: float = 5.0
) -> Iterator[CatalogReader]:
    """The catalog at ``path``, read-only; ``CatalogError`` when it is missing, not SQLite,
    not a catalog, of a newer version, corrupt or locked."""
    path = Path(path)
    _refuse_non_catalog_file(path, creating=False)
    try:
        try:
            conn = _connect_read_only(path, timeout_s, immutable=False)
        except sqlite3.OperationalError as e:
            # A WAL file read by a user who may not create its -shm beside it (a scheduler
            # with read access only): when no writer has a WAL open, the file alone is whole.
            wal = Path(f"{path}-wal")
            if "readonly" not in str(e) and "unable to open" not in str(e):
                raise
            if wal.exists() and wal.stat().st_size > 0:
                raise CatalogError(
                    f"{path}: being written, and reading it needs write access to its folder "
                    "(SQLite's -shm file)"
                ) from None
            conn = _connect_read_only(path, timeout_s, immutable=True)
    except sqlite3.Error as e:
        raise CatalogError(_reason(path, e)) from None
    try:
        yield CatalogReader(path, conn)
    finally:
        conn.close()


def integrity_problems(path: str | os.PathLike[str]) -> list[str]:
    """``PRAGMA integrity_check`` of a catalog (an empty list: intact)."""
    with open_catalog(path) as catalog:
        rows = catalog._rows("PRAGMA integrity_check(100)")
    return [str(r[0]) for r in rows if r[0] != "ok"]
