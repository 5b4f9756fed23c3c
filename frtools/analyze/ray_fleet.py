"""A fleet analysis on Ray: summarize on the nodes that hold the records, diagnose here.

``analyze_on_ray`` runs the per-host step (``frtools.analyze.summarize``) as one Ray task
per node, pinned to that node (``NodeAffinitySchedulingStrategy``, not soft: a node's
records are on its own disk), and hears from the tasks as they finish (``ray.wait``). The
summaries themselves stay on the cluster: merge tasks combine them ``fan_in`` at a time
(``formats.summary_packed.merge_packed``: the same partial whatever the order), level after
level, so the driver receives a few partials (at most ``fan_in``) of the whole job and
diagnoses them like any dump folder. ``fan_in=None`` gathers every host summary to the driver instead (flat). Only
summaries travel (~10 KB a host), never a black box (~4.5 MB a rank).

It fits how Ray Train jobs already run: every worker's recorder writes under its node's
``FRTOOLS_DIR`` (``<dir>/<job>/rank_<R>.frt``; PyTorch's own recorder writes
``nccl_trace_rank_<R>`` where ``TORCH_FR_DUMP_TEMP_FILE`` says: a node finds whatever the
analyzer reads, by its sniffing, narrowed by a file-name ``pattern``), and the driver (or
anyone who can reach the cluster) calls ``analyze_on_ray(job=...)``. Which nodes are
asked: every alive node, or those whose host name / IP is in ``nodes``, or that offer the
custom ``resource``, or carry the node ``label`` (``key=value``). A node without records
answers "nothing here"; a node that fails costs its ranks (they show as ranks without a
record), not the analysis.

Ray is an optional dependency (``pip install 'frtools[ray]'``); it is imported only when
``analyze_on_ray`` runs. ``summarize_node`` — what a task does — needs no Ray.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frtools.config import DIR
from frtools.formats.manifest import rank_in_file_name
from frtools.formats.summary_packed import DEFAULT_HOST_WINDOW, host_file_name

__all__ = [
    "DEFAULT_FAN_IN",
    "FleetResult",
    "NodeReport",
    "analyze_on_ray",
    "find_job_dirs",
    "matches",
    "merge_summaries",
    "summarize_node",
]

# summaries (or partials) one merge task combines: 131,072 hosts in five levels
DEFAULT_FAN_IN = 16


class RayUnavailable(RuntimeError):
    """Ray is not installed, or no cluster could be reached; the message says which."""


@dataclass
class NodeReport:
    """What one node's task sent back: its summary (``None``: no records there) and why."""

    node: str  # host name (IP) of the node
    host: str | None = None  # the host name the summary goes by
    data: bytes | None = None
    ranks: list[int] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""
    error: str | None = None


@dataclass
class FleetResult:
    """The verdict of a fleet analysis, its Trace and Alignment, and every node's report."""

    verdict: Any
    trace: Any
    alignment: Any
    reports: list[NodeReport]
    summaries_dir: Path | None
    seconds: float


def matches(name: str, pattern: str | None) -> bool:
    """Whether a file name is one ``pattern`` picks: a glob (``*``, ``?``, ``[``) matches
    the whole name, anything else is a prefix (``nccl_trace_rank_``, as
    ``TORCH_FR_DUMP_TEMP_FILE`` ends); no pattern picks every file."""
    if not pattern:
        return True
    if glob.has_magic(pattern):
        return fnmatch.fnmatchcase(name, pattern)
    return name.startswith(pattern)


def _holds_records(folder: Path, pattern: str | None) -> bool:
    """Whether a file directly in ``folder`` is a record: a recorder box by its name (one
    still being written counts), or any file a reader claims — the sniffing ``frtools
    analyze`` and ``frtools summarize`` read with (``readers.files.classify``)."""
    from frtools.analyze.readers.files import classify

    try:
        files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError:
        return False
    for p in files:
        if not matches(p.name, pattern) or not p.is_file():
            continue
        if rank_in_file_name(p.name) is not None or isinstance(classify(p), tuple):
            return True
    return False


def find_job_dirs(root: Path, pattern: str | None = None) -> dict[str, Path]:
    """Job id -> folder, for ``root`` itself when it holds records, else each folder under
    it that does (the recorder's ``<FRTOOLS_DIR>/<job>`` layout). Records are what the
    analyzer reads: black boxes, PyTorch Flight Recorder dumps (pickle or JSON, any name),
    ``frtools dump`` folders, host summaries; ``pattern`` (``matches``) narrows them to
    the files it picks."""
    if not root.is_dir():
        return {}
    if _holds_records(root, pattern):
        return {root.name: root}
    return {
        child.name: child
        for child in sorted(root.iterdir())
        if child.is_dir() and not child.name.startswith(".") and _holds_records(child, pattern)
    }


def summarize_node(
    root: str | None = None,
    job: str | None = None,
    window: int = DEFAULT_HOST_WINDOW,
    pattern: str | None = None,
) -> NodeReport:
    """The per-host step on this machine: summarize ``job``'s records under ``root``
    (default: this node's ``$FRTOOLS_DIR``); with ``pattern``, only the files it picks
    (``matches``). Never raises: a failure is the report's ``error``."""
    t0 = time.perf_counter()
    node = f"{socket.gethostname()} ({_node_ip()})"
    base = Path(root or DIR.read())
    try:
        jobs = find_job_dirs(base, pattern)
        if job is not None:
            jobs = {k: v for k, v in jobs.items() if k == job}
        if not jobs:
            what = f"no records of job {job!r}" if job else "no records"
            picked = f" matching {pattern!r}" if pattern else ""
            return NodeReport(node, note=f"{what}{picked} under {base}", seconds=_since(t0))
        if len(jobs) > 1:
            return NodeReport(
                node,
                error=f"{len(jobs)} jobs under {base} ({', '.join(jobs)}): name one (job=...)",
                seconds=_since(t0),
            )
        from frtools.analyze.summarize import summarize_path

        job_dir = next(iter(jobs.values()))
        with _picked(job_dir, pattern) as folder:
            result = summarize_path(folder, window=window, workers=1)
        bad = [i for i in result.inputs if i.status == "error"]
        return NodeReport(
            node,
            host=result.host,
            data=result.encode(),
            ranks=[s.rank for s in result.summaries],
            seconds=_since(t0),
            note=f"{job_dir}" + (f"; {len(bad)} unusable file(s)" if bad else ""),
        )
    except Exception as e:  # noqa: BLE001 - one node's failure is a line in the report
        return NodeReport(node, error=f"{type(e).__name__}: {e}", seconds=_since(t0))


def _summarize_apart(
    root: str | None, job: str | None, window: int, pattern: str | None
) -> tuple[NodeReport, bytes | None]:
    """``summarize_node`` as two results: the report (to the driver, small) and the summary
    (to a merge task, where it is)."""
    report = summarize_node(root, job, window, pattern)
    data, report.data = report.data, None
    return report, data


def merge_summaries(names: Sequence[str], *datas: bytes) -> bytes:
    """One partial of packed summaries (a merge task's work; ``names``: what to call each
    in an error). Raises ``SummaryError`` naming the one refused."""
    from frtools.formats.summary import SummaryError
    from frtools.formats.summary_packed import decode_packed_many, merge_packed

    parts = []
    for name, part in zip(names, decode_packed_many(datas), strict=True):
        if isinstance(part, SummaryError):
            raise SummaryError(f"{name}: {part}")
        parts.append(part)
    return merge_packed(parts, list(names))


@contextlib.contextmanager
def _picked(folder: Path, pattern: str | None) -> Iterator[Path]:
    """``folder`` itself, or with a pattern a temporary folder of links to the files it
    picks there (a prefix folder such as /tmp often holds other jobs' files too); the
    summarizer reads a folder, and the records are never copied or touched."""
    if not pattern:
        yield folder
        return
    tmp = Path(tempfile.mkdtemp(prefix="frtools-picked-"))
    try:
        for p in sorted(folder.iterdir()):
            if matches(p.name, pattern) and p.is_file():
                (tmp / p.name).symlink_to(p.resolve())
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _node_ip() -> str:
    """This node's IP as Ray knows it, inside a Ray worker; "?" elsewhere (Ray is never
    imported here: a plain ``frtools summarize`` pays nothing for it)."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - only a label
        pass
    return "?"


def _select_nodes(
    nodes: list[dict[str, Any]],
    names: Sequence[str] | None,
    resource: str | None,
    label: str | None,
) -> list[dict[str, Any]]:
    alive = [n for n in nodes if n.get("Alive")]
    if names:
        wanted = set(names)
        alive = [
            n
            for n in alive
            if n.get("NodeManagerHostname") in wanted
            or n.get("NodeManagerAddress") in wanted
            or n.get("NodeID") in wanted
        ]
    if resource:
        alive = [n for n in alive if (n.get("Resources") or {}).get(resource, 0) > 0]
    if label:
        key, _, value = label.partition("=")
        alive = [
            n
            for n in alive
            if key in (n.get("Labels") or {}) and (not value or n["Labels"][key] == value)
        ]
    return alive


def analyze_on_ray(
    address: str | None = "auto",
    job: str | None = None,
    *,
    root: str | None = None,
    window: int = DEFAULT_HOST_WINDOW,
    pattern: str | None = None,
    nodes: Sequence[str] | None = None,
    resource: str | None = None,
    label: str | None = None,
    summaries_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    world_size: int | None = None,
    on_report: Callable[[NodeReport], None] | None = None,
    fan_in: int | None = DEFAULT_FAN_IN,
) -> FleetResult:
    """Summarize ``job`` on every chosen node of the Ray cluster at ``address`` and
    diagnose the summaries here.

    ``address``: as ``ray.init`` takes it (``"auto"``: the running cluster; ignored when
    this process is already connected, as a Ray Train driver is). ``root``: where the
    records are on each node (default: each node's ``$FRTOOLS_DIR``). ``pattern``: only the
    files whose name it picks (a prefix or a glob: ``matches``). ``summaries_dir``:
    keep the host summaries there (default: a temporary folder, removed). Nodes that have
    not answered after ``timeout_s`` are left out (their ranks have no record).
    ``on_report``: called with each node's report as it arrives. ``fan_in``: summaries a
    merge task combines (the driver receives at most ``fan_in`` partials, each
    ``<first>..<last>.summary`` in ``summaries_dir``); None: every host summary comes to
    the driver (``<host>.summary`` each). A merge that fails (a rank two nodes both hold) falls back to that. Raises
    ``RayUnavailable`` without Ray or a cluster, and ``frtools.analyze.readers
    .UnusableInput`` when no node had a record."""
    t0 = time.perf_counter()
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        raise RayUnavailable("Ray is not installed: pip install 'frtools[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayUnavailable(f"cannot reach a Ray cluster at {address!r}: {e}") from None
    chosen = _select_nodes(ray.nodes(), nodes, resource, label)
    if not chosen:
        raise RayUnavailable("no alive Ray node matches (nodes/resource/label)")
    task = ray.remote(num_cpus=0, max_retries=0, num_returns=2)(_summarize_apart)
    pending = {}
    for n in chosen:
        meta, data = task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(root, job, window, pattern)
        pending[meta] = (n, data)
    if fan_in is not None and fan_in < 2:
        raise ValueError("fan_in must be at least 2 (None: gather every summary)")
    keep = summaries_dir is not None
    out = Path(summaries_dir) if keep else Path(tempfile.mkdtemp(prefix="frtools-fleet-"))
    out.mkdir(parents=True, exist_ok=True)
    reports: list[NodeReport] = []
    answered: list[tuple[NodeReport, dict[str, Any], Any]] = []  # report, node, data ref
    try:
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 5.0))
            for ref in done:
                n, data = pending.pop(ref)
                try:
                    report = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a lost node, a failed worker
                    report = NodeReport(_node_name(n), error=f"{type(e).__name__}: {e}")
                if report.ranks and not report.error:
                    answered.append((report, n, data))
                reports.append(report)
                if on_report is not None:
                    on_report(report)
        for _ref, (n, _data) in pending.items():
            ray.cancel(_ref, force=True)
            reports.append(NodeReport(_node_name(n), error=f"no answer within {timeout_s:.0f} s"))
        if answered and fan_in is not None:
            try:
                _write_partial(ray, answered, fan_in, out, deadline)
            except Exception as e:  # noqa: BLE001 - the flat gather still works
                for p in out.glob("*.summary"):
                    p.unlink()
                reports.append(NodeReport("merge", error=f"{type(e).__name__}: {e}"))
                fan_in = None
        if fan_in is None:
            for report, n, data in answered:
                name = host_file_name(report.host or _node_name(n))
                target = out / name
                if target.exists():  # two nodes that go by one host name
                    target = out / host_file_name(f"{report.host}-{n['NodeID'][:8]}")
                report.data = ray.get(data)
                target.write_bytes(report.data)
        from frtools.analyze.diagnose import align_and_diagnose
        from frtools.analyze.readers import UnusableInput, load_trace

        if not answered:
            lines = "; ".join(f"{r.node}: {r.error or r.note}" for r in reports)
            raise UnusableInput(f"no node of the Ray cluster had records: {lines}")
        trace = load_trace(out, world_size=world_size)
        alignment, verdict = align_and_diagnose(trace)
        return FleetResult(
            verdict, trace, alignment, reports, out if keep else None, time.perf_counter() - t0
        )
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)


def _write_partial(
    ray: Any,
    answered: list[tuple[NodeReport, dict[str, Any], Any]],
    fan_in: int,
    out: Path,
    deadline: float,
) -> None:
    """Merge the answered nodes' summaries on the cluster, ``fan_in`` at a time (hosts in
    name order: a rack's are neighbours), level after level until at most ``fan_in``
    partials are left, and write those into ``out``. The last merge is the central step's
    own read: it decodes the few partials together, one numpy call per column, rather
    than one task merging the whole job alone."""
    merge = ray.remote(num_cpus=0, max_retries=0)(merge_summaries)
    # (first host, last host, ref): a partial's hosts name it
    level = sorted((r.host or _node_name(n), r.host or _node_name(n), d) for r, n, d in answered)
    first = True
    while first or len(level) > fan_in:
        first = False
        level = [
            (
                group[0][0],
                group[-1][1],
                merge.remote([f"{a}..{z}" for a, z, _ in group], *(ref for _, _, ref in group)),
            )
            for group in (level[i : i + fan_in] for i in range(0, len(level), fan_in))
        ]
    timeout = max(1.0, deadline - time.monotonic()) + 60
    for (a, z, _), data in zip(level, ray.get([ref for _, _, ref in level], timeout=timeout),
                               strict=True):  # fmt: skip
        (out / host_file_name(a if a == z else f"{a}..{z}")).write_bytes(data)


def _node_name(n: dict[str, Any]) -> str:
    return f"{n.get('NodeManagerHostname', '?')} ({n.get('NodeManagerAddress', '?')})"
