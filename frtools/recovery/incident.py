"""The incident record: what happened, when, who was dropped, how long recovery took.

Every survivor writes, into its own dump folder (``FRTOOLS_DUMP_DIR``, default
``<FRTOOLS_DIR>/<job>/dumps``), under ``recovery/<attempt>-<key>/``:

* ``verdict.json`` — the verdict the job agreed on (``frtools analyze --format json``'s
  document; ranks in the numbering of the group that hung);
* ``rank_<R>.incident.json`` — this rank's record (``Incident.to_dict``; ``R`` its launch
  rank), times in ns since the epoch and the durations between them in seconds;
* ``summaries/`` — on the rank that decided: the summaries it diagnosed (``frtools analyze``
  of that folder gives the same verdict).

Nothing read from the store chooses a path here: the folder comes from this rank's own
configuration and the agreement's key, which this rank made itself. Folders and files are
made as the recorder makes its own (``recorder.private``): each folder created 0700 (0750
with ``FRTOOLS_SHARE_GROUP``) or checked to be ours, each file created new, never through a
link.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from frtools.config import DUMP_DIR, SHARE_GROUP, ConfigError
from frtools.recorder import private
from frtools.recovery.decision import Decision

INCIDENT_FORMAT = "frtools-incident"
INCIDENT_VERSION = 1


def _seconds(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((b - a) / 1e9, 3)


@dataclass
class Incident:
    """One recovery as this rank lived it. Ranks are launch ranks."""

    key: str
    trigger: str  # "failure" (a collective raised here), "stall", "straggler check"
    rank: int
    new_rank: int | None
    world_size_before: int
    world_size_after: int
    dropped: list[int]
    dropped_hosts: list[str]
    kind: str
    headline: str
    leader: int
    method: str | None  # "reconfigure", "shrink_group"
    error: str | None = None  # what the collective raised here
    onset_ns: int | None = None  # this rank's oldest op the hang held back was issued
    detected_ns: int | None = None  # this rank learned of it (error raised, stall flagged)
    decided_ns: int | None = None
    resumed_ns: int | None = None  # the group was rebuilt; training may go on
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    directory: str | None = None
    decision: Decision | None = None

    @property
    def seconds_to_recover(self) -> float | None:
        """From the onset (or, unknown, the detection) to the rebuilt group."""
        return _seconds(self.onset_ns or self.detected_ns, self.resumed_ns)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.pop("decision")
        return {
            "format": INCIDENT_FORMAT,
            "version": INCIDENT_VERSION,
            **doc,
            "seconds": {
                "onset_to_detected": _seconds(self.onset_ns, self.detected_ns),
                "detected_to_decided": _seconds(self.detected_ns, self.decided_ns),
                "decided_to_resumed": _seconds(self.decided_ns, self.resumed_ns),
                "to_recover": self.seconds_to_recover,
            },
            "reason": self.decision.reason if self.decision else None,
            "members_before": self.decision.members_before if self.decision else None,
            "members_after": self.decision.members_after if self.decision else None,
        }


def access() -> private.Access:
    """The modes the recorder gives its files (``FRTOOLS_SHARE_GROUP``)."""
    try:
        return private.access_for(SHARE_GROUP.read())
    except ConfigError:
        return private.PRIVATE


def incident_dir(dump_dir: str | os.PathLike[str], attempt: int, key: str) -> Path:
    """``<dump_dir>/recovery/<attempt>-<key with / as ->``, every level made ours."""
    mode = access()
    private.prepare_dump_dir(str(dump_dir), mode, named=DUMP_DIR.is_set())
    path = Path(dump_dir)
    for part in ("recovery", f"{attempt}-{key.replace('/', '-')}"):
        path = path / part
        private.prepare_dump_dir(str(path), mode, named=False)
    return path


def write_file(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (a folder of ours): created new under a temporary name, then
    renamed over the old copy, so a reader sees one or the other."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = private.create_file(str(tmp), access())
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    write_file(path, (json.dumps(doc, indent=2) + "\n").encode())


def write(incident: Incident, directory: Path) -> Path:
    """Write the verdict and this rank's record into ``directory``; returns the record."""
    decision = incident.decision
    if decision is not None and decision.verdict is not None:
        _write_json(directory / "verdict.json", decision.verdict)
    incident.directory = str(directory)
    path = directory / f"rank_{incident.rank}.incident.json"
    _write_json(path, incident.to_dict())
    return path
