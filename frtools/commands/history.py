"""``frtools history [CATALOG]``: the incidents ``frtools analyze --history`` recorded, and
the hosts and GPUs that keep being guilty or show hardware evidence — the drain list a
scheduler reads (docs/actions.md). The catalog is read here; ``analyze/reporters/history.py``
renders what it holds; recording a verdict is ``commands/_catalog.py``.

Exit codes: 0, or 2 on unusable input (a catalog that is missing, corrupt, locked, not a
catalog) or a usage error: one line on stderr naming the file and the reason.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from frtools.analyze.reporters.history import HistoryView, document, render_text, renderable
from frtools.commands._catalog import catalog_for
from frtools.commands._common import OneLineCommand, fail, first_line, run_guarded, write_text
from frtools.config import DRAIN_INCIDENTS, DURATION_UNITS
from frtools.formats.incidents import CatalogError, CatalogReader, Window, open_catalog

PREFIX = "frtools history"
OFFENDER_LIMIT = 1000  # hosts / GPUs read per ranking

# -- `frtools history` ----------------------------------------------------------------------


def parse_since(text: str, now_ns: int) -> int | None:
    """``7d``, ``12h``, ``30m``, ``2w``, ``90s``, an ISO-8601 date or time (UTC unless it
    says otherwise), or ``all`` (None)."""
    value = text.strip().lower()
    if value in ("all", ""):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", value)
    if m:
        return now_ns - int(float(m.group(1)) * DURATION_UNITS[m.group(2)] * 1_000_000_000)
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


def _gather(catalog: CatalogReader, window: Window, limit: int) -> HistoryView:
    """What the catalog holds for one question: counts, the rankings, the newest incidents."""
    return HistoryView(
        path=str(catalog.path),
        window=window,
        by_kind=catalog.count_by_kind(window),
        in_catalog=catalog.count_all(),
        hosts=catalog.offenders("host", window, OFFENDER_LIMIT),
        gpus=catalog.offenders("gpu", window, OFFENDER_LIMIT),
        incidents=catalog.incidents(window, limit),
    )


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
    default=None,
    help="A host or GPU guilty in this many incidents of the window is a drain candidate "
    "(default: $FRTOOLS_DRAIN_INCIDENTS, 2); one with hardware evidence in any is too.",
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
    min_incidents: int | None,
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
    if min_incidents is None:
        min_incidents = DRAIN_INCIDENTS.read()
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
                stored = catalog.verdict_document(incident_id)
                if stored is None:
                    fail(PREFIX, f"error: {path}: no incident {incident_id}")
                write_text(PREFIX, json.dumps(stored, indent=2) + "\n", output)
                return 0
            found = _gather(catalog, window, limit)
    except CatalogError as e:
        fail(PREFIX, f"error: {first_line(e)}")
    if fmt == "json":
        doc = document(found, min_incidents, hosts, gpus, listing)
        write_text(PREFIX, json.dumps(doc, indent=2) + "\n", output)
        return 0
    view = renderable(found, min_incidents, hosts, gpus, listing)
    if output is None:
        from rich.console import Console

        console = Console()
        width = min(console.width, 100) if sys.stdout.isatty() else 100
        color = console.color_system is not None and not console.no_color
        write_text(PREFIX, render_text(view, width, color), None)
        return 0
    write_text(PREFIX, render_text(view), output)
    return 0
