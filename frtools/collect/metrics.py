"""This host's ranks as Prometheus metrics (``frtools metrics``; docs/monitoring.md).

One ``JobMetrics`` collector reads the boxes (``frtools.collect.live``) at each scrape and
yields metric families for the official ``prometheus-client``: served at ``/metrics``
(OpenMetrics to a client that asks for it, as Prometheus does) or written for
node_exporter's textfile collector. Labels are bounded: job, rank, host, group (at most
``live.MAX_GROUPS`` per rank), op (at most ``live.MAX_OPS`` per rank), state and ending
(closed sets); never a sequence id.

``frtools_ops_total`` is a counter the exporter keeps: each record is counted once, when it
is first seen finished (the ring keeps the last ``FRTOOLS_BUFFER_SIZE`` records; those
overwritten between two scrapes are not counted).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from frtools.collect.live import MAX_OPS, JobLive, RankLive
from frtools.formats.blackbox import SnapshotError

RANK_LABELS = ("job", "rank", "host")
# every name this exporter serves (the dashboard and the alert rules may use these only)
METRIC_NAMES = (
    "frtools_rank_last_completed_seq",
    "frtools_rank_last_issued_seq",
    "frtools_rank_seconds_since_progress",
    "frtools_rank_stalled",
    "frtools_rank_alive",
    "frtools_rank_behind_ops",
    "frtools_ops_total",
    "frtools_job_ranks",
)
ENDINGS = ("running", "clean", "exit", "exception", "os_exit", "signal", "killed", "unknown")


class _OpCounts:
    """One rank's finished records, each counted once: every id up to ``upto`` is counted
    (or gone from the ring), ``above`` holds the counted ids past it."""

    def __init__(self) -> None:
        self.upto = -1
        self.above: set[int] = set()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.names: dict[int, str] = {}  # op string id -> label (ids are stable in a box)

    def _name(self, rank: RankLive, op: int) -> str:
        """The op's label: its name, or ``other`` past ``MAX_OPS`` distinct names."""
        name = self.names.get(op)
        if name is None:
            try:  # the box's own text (hostile: bounded, escaped by the client)
                text = rank.op_name(op)[:64] if rank.op_name is not None else ""
            except SnapshotError:
                text = "other"
            known = set(self.names.values())
            name = text if text in known or len(known) < MAX_OPS else "other"
            self.names[op] = name
        return name

    def update(self, rank: RankLive) -> None:
        finished = rank.finished
        if finished is None or not len(finished):
            return
        # records overwritten since the last scrape are gone: nothing below the ring waits
        if rank.oldest_record - 1 > self.upto:
            self.upto = rank.oldest_record - 1
            self.above = {i for i in self.above if i > self.upto}
        ids = finished["record_id"]
        new = ids > self.upto
        if self.above:
            new &= ~np.isin(ids, np.fromiter(self.above, dtype=np.int64))
        if not new.any():
            return
        fresh = finished[new]
        for (op, failed), n in Counter(
            zip(fresh["op"].tolist(), fresh["failed"].tolist(), strict=True)
        ).items():
            self.counts[(self._name(rank, op), "failed" if failed else "completed")] += n
        self.above.update(int(i) for i in fresh["record_id"])
        while self.upto + 1 in self.above:
            self.upto += 1
            self.above.discard(self.upto)


class JobMetrics(Collector):
    """A collector over ``read()``'s jobs, read afresh at every scrape."""

    def __init__(self, read: Callable[[], list[JobLive]]) -> None:
        self.read = read
        self._ops: dict[tuple[str, int, int | None, str], _OpCounts] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        jobs = self.read()
        g = {
            "completed": GaugeMetricFamily(
                "frtools_rank_last_completed_seq",
                "Last collective sequence id the rank completed, per process group.",
                labels=(*RANK_LABELS, "group"),
            ),
            "issued": GaugeMetricFamily(
                "frtools_rank_last_issued_seq",
                "Last collective sequence id the rank issued, per process group.",
                labels=(*RANK_LABELS, "group"),
            ),
            "since": GaugeMetricFamily(
                "frtools_rank_seconds_since_progress",
                "Seconds since any of the rank's records last changed.",
                labels=RANK_LABELS,
            ),
            "stalled": GaugeMetricFamily(
                "frtools_rank_stalled",
                "1 while the recorder's watchdog flags a stall (an op unfinished too long).",
                labels=RANK_LABELS,
            ),
            "alive": GaugeMetricFamily(
                "frtools_rank_alive",
                "1 while the rank's process runs; 0 once it is gone, with how it ended.",
                labels=(*RANK_LABELS, "ending"),
            ),
            "behind": GaugeMetricFamily(
                "frtools_rank_behind_ops",
                "Ops this rank has not issued that a member of one of its groups on this "
                "host has (the most over its groups).",
                labels=RANK_LABELS,
            ),
            "ranks": GaugeMetricFamily(
                "frtools_job_ranks", "Rank boxes of the job on this host.", labels=("job",)
            ),
        }
        ops = CounterMetricFamily(
            "frtools_ops",
            "Ops the rank finished, by op and how they ended.",
            labels=(*RANK_LABELS, "op", "state"),
        )
        seen: set[tuple[str, int, int | None, str]] = set()
        now = None
        for job in jobs:
            g["ranks"].add_metric([job.job], len(job.ranks))
            for rank in job.ranks.values():
                if rank.error is not None or rank.alive is None and not rank.groups:
                    continue  # unreadable, or a rank of another host (job-wide)
                labels = [job.job, str(rank.rank), rank.host or ""]
                for grp in rank.groups:
                    g["completed"].add_metric([*labels, grp.name], grp.last_completed)
                    g["issued"].add_metric([*labels, grp.name], grp.last_issued)
                since = rank.seconds_since_progress(now)
                if since is not None:
                    g["since"].add_metric(labels, since)
                alive = rank.alive is not False
                g["stalled"].add_metric(labels, int(rank.stalled and alive))
                ending = rank.ending if rank.ending in ENDINGS else "unknown"
                g["alive"].add_metric([*labels, ending], int(alive))
                g["behind"].add_metric(labels, max((x.behind for x in rank.groups), default=0))
                key = (job.job, rank.rank, rank.pid, rank.path)
                seen.add(key)
                counts = self._ops.setdefault(key, _OpCounts())
                counts.update(rank)
                for (op, state), n in sorted(counts.counts.items()):
                    ops.add_metric([*labels, op, state], n)
        for key in set(self._ops) - seen:  # a box removed, or a rank restarted
            del self._ops[key]
        yield from g.values()
        yield ops


def registry_for(read: Callable[[], list[JobLive]]) -> CollectorRegistry:
    """A registry holding only frtools' metrics (no process or platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobMetrics(read))
    return registry


def write_textfile(registry: CollectorRegistry, path: str | os.PathLike[str]) -> Path:
    """The metrics in the text format node_exporter's textfile collector reads, written
    atomically (a new 0600 file renamed over ``path``: a scrape never sees half a file)."""
    from prometheus_client.exposition import generate_latest

    from frtools.formats.private_files import write_new

    return write_new(path, generate_latest(registry))
