"""``frtools top`` and ``frtools metrics`` on a real hung Gloo job, scraped by a real
Prometheus whose alert rules (monitoring/frtools-alerts.yml) fire for the stall."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from jobs import free_port, kill_group, rank_env, stop

from frtools.collect.live import read_job
from frtools.collect.metrics import METRIC_NAMES
from frtools.formats import progress as beacon

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "monitoring" / "frtools-alerts.yml"
DASHBOARD = ROOT / "monitoring" / "frtools-dashboard.json"
STALL_S = 3.0
WORLD = 4
HUNG = 3  # the rank that issues an all_reduce nobody else issues

HANG_JOB = """
import time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
rank = dist.get_rank()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if rank == 3:
    dist.all_reduce(t)  # its peers never issue it: rank 3 hangs here
time.sleep(600)  # the others wait in user code, out of any collective
"""


class HungJob:
    def __init__(self, rec: Path, port: int, procs: list[subprocess.Popen]) -> None:
        self.rec, self.port, self.procs = rec, port, procs
        self.dir = rec / "j"


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HungJob]:
    """4 ranks under ``frtools run`` (stall flagged after 3 s); rank 3 hangs in all_reduce
    #4 once all four boxes exist and it entered the op."""
    tmp = tmp_path_factory.mktemp("live")
    script = tmp / "job.py"
    script.write_text(HANG_JOB)
    rec, port = tmp / "rec", free_port()
    argv = [sys.executable, "-m", "frtools", "run", "--dir", str(rec), "--job-id", "j",
            "--stall-seconds", str(STALL_S), "--", sys.executable, str(script)]  # fmt: skip
    procs = [
        subprocess.Popen(argv, env=rank_env(r, WORLD, port), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(WORLD)
    ]  # fmt: skip
    job = HungJob(rec, port, procs)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            live = read_job(job.dir) if job.dir.is_dir() else None
            if live and len(live.ranks) == WORLD and live.ranks[HUNG].pending:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the job never reached its hang")
        yield job
    finally:
        stop(procs)


def frtools(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args], capture_output=True, text=True, timeout=timeout
    )


def rank_line(frame: str, rank: int) -> str:
    return next(line for line in frame.splitlines() if re.match(rf"\s*{rank}\s", line))


@pytest.mark.timeout(120)
def test_top_once_shows_the_hung_rank_stalled_within_threshold_plus_2s(hung_job: HungJob) -> None:
    """The first frame that shows rank 3 stalled is taken at most 2 s after the watchdog's
    threshold: its 'since' column (seconds since the rank's last progress) says so."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        proc = frtools("top", "--once", "--dir", str(hung_job.rec), "j")
        assert proc.returncode == 0, proc.stderr
        if "STALLED" in rank_line(proc.stdout, HUNG):
            break
    else:
        pytest.fail(f"rank {HUNG} never shown stalled:\n{proc.stdout}")
    frame = proc.stdout
    hung = rank_line(frame, HUNG)
    since = float(re.search(r"(\d+\.\d)s", hung).group(1))
    assert since <= STALL_S + 2, frame
    assert "gloo:all_reduce" in hung and "in scheduled" in hung
    assert hung.split()[3:5] == ["0", "4"]  # group 0, sequence id 4
    head = frame.splitlines()[0]
    assert head.startswith("job j  4 rank(s)") and "STALLED since" in head
    assert head.endswith("lagging: 0, 1, 2")  # they never issued all_reduce #4
    for rank in (0, 1, 2):
        line = rank_line(frame, rank)
        assert "STALLED" not in line and "lags on group 0 (1 op behind)" in line


@pytest.mark.timeout(120)
def test_top_job_wide_reads_every_rank_through_the_store(hung_job: HungJob) -> None:
    """--job-wide finds the ranks through the job's TCPStore (read only) and reads the
    boxes of those on this host: the same stall, the same laggards."""
    deadline = time.monotonic() + 30
    while True:
        proc = frtools("top", "--once", "--job-wide", "--store", f"127.0.0.1:{hung_job.port}",
                       "--dir", str(hung_job.rec))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        if "STALLED" in proc.stdout or time.monotonic() > deadline:
            break
    head = proc.stdout.splitlines()[0]
    assert head.startswith("job j  4 rank(s)") and "STALLED since" in head, proc.stdout
    assert "STALLED" in rank_line(proc.stdout, HUNG)
    assert head.endswith("lagging: 0, 1, 2")


@pytest.mark.timeout(120)
def test_top_job_wide_shows_other_hosts_ranks_from_their_beacons(
    hung_job: HungJob, tmp_path: Path
) -> None:
    """Seen from a host that holds none of the boxes (an empty recorder folder), every rank
    comes from the progress beacon its recorder writes into the store: rank 3's op, group,
    sequence id and stall, and the laggards, as the boxes themselves say."""
    elsewhere = tmp_path / "other-host"
    elsewhere.mkdir(mode=0o700)
    deadline = time.monotonic() + 30
    while True:
        proc = frtools("top", "--once", "--job-wide", "--store", f"127.0.0.1:{hung_job.port}",
                       "--dir", str(elsewhere))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        if "STALLED" in proc.stdout or time.monotonic() > deadline:
            break
    hung = rank_line(proc.stdout, HUNG)
    assert "STALLED" in hung and "gloo:all_reduce" in hung, proc.stdout
    assert hung.split()[3:5] == ["0", "4"]  # group 0, sequence id 4, from the beacon
    assert "from its beacon" in proc.stdout
    head = proc.stdout.splitlines()[0]
    assert "STALLED since" in head and head.endswith("lagging: 0, 1, 2"), proc.stdout


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1, 2]",
        b"\xff\xfe",
        b"[" * 20000,
        b'{"seq": true, "state": "rm -rf", "stalled": 1, "groups": [["g", "d", "x", -1, 2]]}',
        b'{"op": "' + b"x" * 20000 + b'"}',
    ],
    ids=["empty", "list", "not-utf8", "deep", "wrong-types", "too-big"],
)
def test_a_hostile_beacon_is_no_beacon_or_its_checked_fields_only(raw: bytes) -> None:
    """The store is not authenticated: a beacon is bounded, its ints strict, its state from
    a closed set, a group row with a bad number dropped."""
    now = beacon.decode(raw)
    if raw.startswith(b'{"seq"'):  # a beacon whose fields are all wrong
        assert now is not None and now.seq is None and now.state is None
        assert now.stalled is False and now.groups == []
    else:
        assert now is None


def test_a_beacon_reads_back_as_written() -> None:
    sent = beacon.Progress(op="gloo:all_reduce", group="0", seq=4, state="scheduled",
                           pending=True, last_progress_ns=5, stalled=True, stall_time_ns=6,
                           time_ns=7, interval_s=5.0,
                           groups=[beacon.GroupProgress(name="0", desc="default_pg",
                                   digest=beacon.members_digest((0, 1, 2, 3)),
                                   last_issued=4, last_completed=3)])  # fmt: skip
    assert beacon.decode(beacon.encode(sent)) == sent


def test_top_job_wide_names_an_unreachable_store_in_one_line() -> None:
    proc = frtools("top", "--once", "--job-wide", "--store", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("frtools top: error: cannot reach the job's")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_top_live_quits_on_q_or_ctrl_c_and_restores_the_terminal(
    hung_job: HungJob, key: bytes
) -> None:
    """On a real terminal (a pty) the view redraws about once a second, and q or Ctrl-C
    ends it with exit code 0 and the terminal's modes as they were (echo, line mode)."""
    import pty
    import select
    import termios

    primary, secondary = pty.openpty()
    modes = termios.ECHO | termios.ICANON
    before = termios.tcgetattr(secondary)[3] & modes
    import fcntl

    proc = subprocess.Popen(
        [sys.executable, "-m", "frtools", "top", "--dir", str(hung_job.rec)],
        stdin=secondary, stdout=secondary, stderr=secondary, start_new_session=True,
        # the pty becomes the controlling terminal: Ctrl-C there is a SIGINT, as for a user
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )  # fmt: skip
    seen = b""

    def read_for(seconds: float) -> None:
        nonlocal seen
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and b"STALLED" not in seen:
            if select.select([primary], [], [], 0.2)[0]:
                seen += os.read(primary, 65536)

    try:
        read_for(60)
        assert b"job j" in seen and b"STALLED" in seen, seen[-2000:]
        time.sleep(1.5)  # at least one redraw, in cbreak mode
        assert termios.tcgetattr(secondary)[3] & modes == 0  # no echo, no line mode meanwhile
        os.write(primary, key)
        assert proc.wait(timeout=20) == 0
        assert termios.tcgetattr(secondary)[3] & modes == before
    finally:
        kill_group(proc)
        proc.wait(timeout=10)
        os.close(primary)
        os.close(secondary)


def wait_serving(url: str, proc: subprocess.Popen, log: Callable[[], str]) -> None:
    """Until ``url`` answers (60 s at most); the server's log if it exits first."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).close()
            return
        assert proc.poll() is None, log()[-2000:]
        time.sleep(0.2)
    pytest.fail(f"{url} never answered")


@contextlib.contextmanager
def exporter(rec: Path) -> Iterator[int]:
    """``frtools metrics`` serving the job's boxes on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frtools", "metrics", "--dir", str(rec), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        wait_serving(f"http://127.0.0.1:{port}/metrics", proc, lambda: proc.stderr.read())
        yield port
    finally:
        kill_group(proc)
        proc.wait(timeout=10)


def scrape(port: int) -> tuple[str, dict[tuple[str, frozenset], float]]:
    """(content type, {(name, labels): value}) of one OpenMetrics scrape."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        ctype, body = response.headers["Content-Type"], response.read().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    return ctype, samples


def by_rank(samples: dict, name: str, **match: str) -> dict[int, float]:
    return {
        int(dict(labels)["rank"]): value
        for (n, labels), value in samples.items()
        if n == name and all(dict(labels).get(k) == v for k, v in match.items())
    }


@pytest.mark.timeout(120)
def test_exporter_shows_frtools_rank_stalled_for_the_hung_rank_only(hung_job: HungJob) -> None:
    with exporter(hung_job.rec) as port:
        deadline = time.monotonic() + 30
        while True:
            ctype, samples = scrape(port)
            stalled = by_rank(samples, "frtools_rank_stalled", job="j")
            if stalled.get(HUNG) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert ctype.startswith("application/openmetrics-text")
    assert stalled == {0: 0, 1: 0, 2: 0, 3: 1}
    host = os.uname().nodename
    assert by_rank(samples, "frtools_rank_alive", ending="running", host=host) == dict.fromkeys(
        range(WORLD), 1
    )
    assert by_rank(samples, "frtools_rank_last_issued_seq", group="0") == {0: 3, 1: 3, 2: 3, 3: 4}
    assert by_rank(samples, "frtools_rank_last_completed_seq", group="0") == dict.fromkeys(
        range(WORLD), 3
    )
    assert by_rank(samples, "frtools_rank_behind_ops") == {0: 1, 1: 1, 2: 1, 3: 0}
    done = by_rank(samples, "frtools_ops_total", op="gloo:all_reduce", state="completed")
    assert done == dict.fromkeys(range(WORLD), 3)  # rank 3's fourth has not finished
    assert by_rank(samples, "frtools_rank_seconds_since_progress")[HUNG] >= STALL_S
    names = {n for n, _ in samples}
    assert names - {"frtools_ops_total"} <= set(METRIC_NAMES)


def test_alert_rules_pass_promtool_and_the_dashboard_uses_exported_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool:
        proc = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SUCCESS: 3 rules found" in proc.stdout
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    used = {m for e in exprs for m in re.findall(r"\bfrtools_[a-z_]+", e)}
    used |= set(re.findall(r"\bfrtools_[a-z_]+", RULES.read_text()))
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)


def test_textfile_is_written_private_for_node_exporter(tmp_path: Path) -> None:
    """--textfile --once writes the exposition format into a new 0600 file (no job yet:
    only the families' help and type lines)."""
    out = tmp_path / "frtools.prom"
    proc = frtools("metrics", "--dir", str(tmp_path / "none"), "--textfile", str(out), "--once")
    assert proc.returncode == 0, proc.stderr
    assert (out.stat().st_mode & 0o777) == 0o600
    text = out.read_text()
    assert "# TYPE frtools_rank_stalled gauge" in text
    assert "# TYPE frtools_ops_total counter" in text
    assert [p.name for p in tmp_path.iterdir()] == ["frtools.prom"]  # no temporary left


@pytest.fixture(scope="module")
def prometheus(hung_job: HungJob, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus on a free loopback port scraping ``frtools metrics`` every second
    and evaluating the repo's alert rules every second (their ``for`` cut to 1 s)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the Prometheus server is not installed (Debian package 'prometheus')")
    tmp = tmp_path_factory.mktemp("prometheus")
    rules = tmp / "rules.yml"
    rules.write_text(re.sub(r"for: \d+[smh]", "for: 1s", RULES.read_text()))
    with exporter(hung_job.rec) as target:
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            "  - job_name: frtools\n"
            "    honor_labels: true\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{target}']}}]\n"
        )
        port = free_port()
        log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_serving(f"{url}/-/ready", proc, lambda: (tmp / "prometheus.log").read_text())
            yield url
        finally:
            kill_group(proc)
            proc.wait(timeout=10)
            log.close()


def firing(url: str, alert: str, timeout: float = 60) -> list[dict]:
    """The labels of ``alert``'s firing alerts, once there are some (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=10) as response:
            alerts = json.load(response)["data"]["alerts"]
        fired = [
            a["labels"]
            for a in alerts
            if a["labels"]["alertname"] == alert and a["state"] == "firing"
        ]
        if fired or time.monotonic() > deadline:
            return fired
        time.sleep(1)


@pytest.mark.timeout(180)
def test_prometheus_fires_the_stall_alerts_naming_rank_and_host(prometheus: str) -> None:
    host = os.uname().nodename
    stalled = firing(prometheus, "FrtoolsRankStalled")
    assert [(a["job"], a["rank"], a["host"]) for a in stalled] == [("j", "3", host)]
    lagging = firing(prometheus, "FrtoolsJobStalledLaggingRank")
    assert sorted((a["job"], a["rank"], a["host"]) for a in lagging) == [
        ("j", str(r), host) for r in (0, 1, 2)
    ]
    assert firing(prometheus, "FrtoolsRankDead", timeout=0) == []


@pytest.mark.timeout(180)
def test_a_killed_rank_is_dead_in_metrics_and_alerts(hung_job: HungJob, prometheus: str) -> None:
    """Last in this module: SIGKILL rank 2 (asleep in user code): frtools_rank_alive goes 0
    with ending="killed" and the dead-rank alert fires for it."""
    pid = read_job(hung_job.dir).ranks[2].pid
    assert pid
    os.kill(pid, signal.SIGKILL)
    dead = firing(prometheus, "FrtoolsRankDead")
    host = os.uname().nodename
    assert [(a["rank"], a["host"], a["ending"]) for a in dead] == [("2", host, "killed")]


def test_a_hostile_box_is_named_and_the_others_still_shown(tmp_path: Path) -> None:
    """A file named like a box that is no box: top names the file and the reason on its
    rank's row, the exporter leaves it out; the readable rank is shown by both."""
    from hostile import valid_snapshot

    job = tmp_path / "rec" / "j"
    job.mkdir(parents=True)
    (job / "rank_0.frt").write_bytes(b"\xff" * 8192)
    (job / "rank_1.frt").write_bytes(valid_snapshot(rank=1, world=2))
    proc = frtools("top", "--once", "--dir", str(tmp_path / "rec"))
    assert proc.returncode == 0, proc.stderr
    assert "unreadable" in rank_line(proc.stdout, 0)
    assert f"rank 0: {job}/rank_0.frt: not an frtools snapshot (bad magic)" in " ".join(
        proc.stdout.split()
    )
    assert "gloo:all_reduce" in rank_line(proc.stdout, 1)
    out = tmp_path / "m.prom"
    proc = frtools("metrics", "--dir", str(tmp_path / "rec"), "--textfile", str(out), "--once")
    assert proc.returncode == 0, proc.stderr
    stalled = [line for line in out.read_text().splitlines() if line.startswith("frtools_rank_")]
    assert stalled and all('rank="1"' in line for line in stalled)
