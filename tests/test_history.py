"""The incident catalog and `frtools history`: repeat-offender hosts are named, concurrent
writers lose nothing, a failing catalog never costs the verdict, a hostile file is refused.

The end-to-end tests run real `frtools analyze --history` processes over `frtools synth`
dump sets in frtools' snapshot format, whose hosts and GPUs are known (8 ranks a host).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from frtools.formats.incidents import (
    CatalogError,
    GuiltyRecord,
    IncidentRecord,
    Window,
    gpu_identity,
    integrity_problems,
    open_catalog,
    record_incident,
)

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_dumps" / "missing"
DAY_NS = 86_400 * 10**9


def frtools(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def incident(
    n: int, *, host: str | None = "node1", kind: str = "missing", **extra
) -> IncidentRecord:
    guilty = [] if kind == "healthy" else [GuiltyRecord(rank=n % 8, host=host, device="cuda:0")]
    fields = {
        "fingerprint": f"dumps-{n}",
        "job_id": f"job-{n}",
        "job_id_source": "path",
        "path": f"/dumps/{n}",
        "kind": kind,
        "headline": f"incident {n}",
        "verdict_document": {"verdict": {"kind": kind}},
        "guilty": guilty,
        **extra,
    }
    return IncidentRecord(**fields)


def history_json(catalog: Path, *args: str) -> dict:
    p = frtools("history", str(catalog), "--format", "json", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the answer: a host guilty in 3 of 5 incidents ------------------------------------------

# (seed, fault, faulty rank): ranks 8-15 run on node00001, ranks 0-7 on node00000
INCIDENTS = [
    (1, "missing", 9),
    (2, "stuck", 12),
    (3, "missing", 3),
    (4, "healthy", 0),
    (5, "mismatch-size", 10),
]


@pytest.fixture(scope="module")
def five_incidents(tmp_path_factory) -> tuple[Path, list[Path], list[subprocess.CompletedProcess]]:
    """Five jobs finish at once: five `frtools analyze --history` processes, one catalog."""
    from frtools.synth import synthesize

    root = tmp_path_factory.mktemp("history")
    dirs = []
    for seed, fault, rank in INCIDENTS:
        out = root / f"job{seed}"
        synthesize(
            out, 16, fault=fault, fault_ranks=[rank], seed=seed, steps=2, workers=1,
            format="frtools",
        )  # fmt: skip
        dirs.append(out)
    catalog = root / "incidents.sqlite"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "frtools", "analyze", str(d), "--history", str(catalog)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in dirs
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return catalog, dirs, done


def test_five_concurrent_analyses_are_five_incidents_and_keep_their_verdicts(five_incidents):
    catalog, _, runs = five_incidents
    assert [r.returncode for r in runs] == [1, 1, 1, 0, 1]
    assert all(r.stderr == "" for r in runs), [r.stderr for r in runs]
    assert all(r.stdout.strip() for r in runs)
    assert integrity_problems(catalog) == []
    with open_catalog(catalog) as c:
        assert sum(c.count_by_kind(Window()).values()) == 5


def test_history_names_the_host_guilty_in_3_of_5_incidents(five_incidents):
    catalog, _, _ = five_incidents
    p = frtools("history", str(catalog))
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert "REPEAT" in first and "node00001 was guilty in 3 of 5 incidents" in first
    assert "4 problems" in p.stdout and "1 healthy" in p.stdout


def test_json_drain_list_has_the_host_with_its_evidence(five_incidents):
    catalog, _, _ = five_incidents
    doc = history_json(catalog)
    assert doc["incidents_in_window"] == 5 and doc["healthy"] == 1
    assert [h["host"] for h in doc["drain"]["hosts"]] == ["node00001"]
    host = doc["drain"]["hosts"][0]
    assert host["incidents"] == 3 and host["share"] == 0.6
    assert sorted(host["kinds"]) == ["mismatch", "missing", "stuck"]
    assert sorted(e["ranks"][0] for e in host["evidence"]) == [9, 10, 12]
    assert all(
        e["time"].endswith("Z") and e["job_id"].startswith("synth-") for e in host["evidence"]
    )
    # every GPU was guilty once: none to drain at the default threshold
    assert doc["drain"]["gpus"] == []
    assert {g["host"] for g in doc["gpus"]} == {"node00000", "node00001"}
    listed = doc["incidents"]
    assert [i["time"] for i in listed] == sorted((i["time"] for i in listed), reverse=True)
    assert {i["job_id_source"] for i in listed} == {"snapshot"}


def test_min_incidents_and_job_narrow_the_drain_list(five_incidents):
    catalog, _, _ = five_incidents
    assert history_json(catalog, "--min-incidents", "4")["drain"]["hosts"] == []
    one = history_json(catalog, "--job", "synth-3")
    assert one["incidents_in_window"] == 1
    assert [h["host"] for h in one["hosts"]] == ["node00000"]


def test_hosts_flag_shows_the_host_ranking_alone(five_incidents):
    catalog, _, _ = five_incidents
    p = frtools("history", str(catalog), "--hosts")
    assert p.returncode == 0, p.stderr
    assert "node00001" in p.stdout and "3 of 5" in p.stdout
    assert "GPU" not in p.stdout and "Incidents, newest first" not in p.stdout
    doc = history_json(catalog, "--gpus")
    assert "gpus" in doc and "hosts" not in doc and "incidents" not in doc


def test_the_same_dumps_analyzed_again_stay_one_incident(five_incidents, tmp_path):
    _, dirs, _ = five_incidents
    catalog = tmp_path / "again.sqlite"
    for _ in range(2):  # the second through the environment variable
        env = {"FRTOOLS_HISTORY": str(catalog)} if _ else None
        args = ["analyze", str(dirs[0])] + ([] if _ else ["--history", str(catalog)])
        assert frtools(*args, env=env).returncode == 1
    doc = history_json(catalog)
    assert doc["incidents_in_window"] == 1
    assert doc["incidents"][0]["analyses"] == 2
    assert doc["drain"]["hosts"] == []  # one incident, however often it was analyzed


def test_stored_verdict_document_can_be_read_back(five_incidents):
    catalog, _, _ = five_incidents
    newest = history_json(catalog)["incidents"][0]
    p = frtools("history", str(catalog), "--incident", str(newest["id"]))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["verdict"]["kind"] == newest["kind"]
    assert doc["tool"]["name"] == "frtools"


def test_history_reads_without_writing(five_incidents):
    catalog, _, _ = five_incidents
    before = digest(catalog)
    assert frtools("history", str(catalog)).returncode == 0
    assert digest(catalog) == before


# -- concurrency -----------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, time
    from frtools.formats.incidents import GuiltyRecord, IncidentRecord, record_incident
    path, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    start = time.monotonic()
    for i in range(n):
        record_incident(path, IncidentRecord(
            fingerprint=f"w{worker}-{i}", job_id=f"job-{worker}", job_id_source="path",
            path=f"/dumps/{worker}/{i}", kind="missing", headline=f"{worker}/{i}",
            verdict_document={"worker": worker, "i": i},
            guilty=[GuiltyRecord(rank=i, host=f"node{worker}", device="cuda:0")]))
    print(time.monotonic() - start)
    """
)


def test_eight_writer_processes_lose_no_record(tmp_path):
    catalog = tmp_path / "shared.sqlite"  # created by whichever writer comes first
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(catalog), str(w), "25"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for w in range(8)
    ]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    assert integrity_problems(catalog) == []
    conn = sqlite3.connect(catalog)
    try:
        assert conn.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 200
        assert (
            conn.execute("SELECT COUNT(DISTINCT fingerprint) FROM incidents").fetchone()[0] == 200
        )
        assert conn.execute("SELECT COUNT(*) FROM guilty").fetchone()[0] == 200
        per_worker = conn.execute(
            "SELECT job_id, COUNT(*) FROM incidents GROUP BY job_id"
        ).fetchall()
        assert sorted(n for _, n in per_worker) == [25] * 8
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_a_writer_locked_out_past_its_timeout_gives_up_and_readers_go_on(tmp_path):
    catalog = tmp_path / "busy.sqlite"
    record_incident(catalog, incident(1))
    holder = sqlite3.connect(catalog, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer, mid-transaction
    try:
        start = time.monotonic()
        with pytest.raises(CatalogError, match="locked"):
            record_incident(catalog, incident(2), timeout_s=0.3)
        assert time.monotonic() - start < 5
        with open_catalog(catalog) as c:  # WAL: a reader does not wait for the writer
            assert c.count_by_kind(Window()) == {"missing": 1}
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_reader_without_write_access_to_the_folder_still_reads():
    """A scheduler with read access only cannot create the WAL's -shm file beside the
    catalog; with no writer at work the file alone is read."""
    folder = Path(tempfile.mkdtemp(prefix="frtools-ro-"))
    try:
        catalog = folder / "incidents.sqlite"
        record_incident(catalog, incident(1))
        catalog.chmod(0o644)
        folder.chmod(0o555)  # root ignores it: the child reads as nobody then
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                with open_catalog(catalog) as c:
                    code = 0 if c.count_by_kind(Window()) == {"missing": 1} else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


# -- a catalog that fails never costs the verdict ---------------------------------------------


def test_unwritable_catalog_is_one_warning_and_the_exit_code_stays(tmp_path):
    not_a_catalog = tmp_path / "notes.txt"
    not_a_catalog.write_text("my notes\n")
    before = digest(not_a_catalog)
    p = frtools("analyze", str(SAMPLE), "--history", str(not_a_catalog))
    assert p.returncode == 1
    assert "MISSING" in p.stdout.splitlines()[0]
    assert p.stderr.splitlines() == [
        f"frtools: warning: verdict not recorded: {not_a_catalog}: "
        "not an SQLite file, so not an frtools incident catalog"
    ]
    assert digest(not_a_catalog) == before

    nowhere = tmp_path / "no" / "such" / "dir" / "incidents.sqlite"
    p = frtools("analyze", str(SAMPLE), "--format", "json", "--history", str(nowhere))
    assert p.returncode == 1
    assert json.loads(p.stdout)["verdict"]["kind"] == "missing"
    assert len(p.stderr.splitlines()) == 1 and "cannot create the catalog" in p.stderr


def test_somebody_elses_database_is_never_written(tmp_path):
    foreign = tmp_path / "app.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    before = digest(foreign)
    with pytest.raises(CatalogError, match="not an frtools incident catalog"):
        record_incident(foreign, incident(1))
    assert digest(foreign) == before


# -- `frtools history` refuses what it cannot use, in one line --------------------------------


def _newer_catalog(path: Path) -> None:
    record_incident(path, incident(1))
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (99, 'frtools-incident-catalog', 0, '9.0')")
    conn.commit()
    conn.close()


def _truncated_catalog(path: Path) -> None:
    record_incident(path, incident(1))
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")  # fold the WAL into the file
    conn.close()
    data = path.read_bytes()
    path.write_bytes(data[:100] + b"\xff" * (len(data) - 100))


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b""), "empty file"),
        (lambda p: p.write_text("hello\n"), "not an SQLite file"),
        (lambda p: sqlite3.connect(p).execute("CREATE TABLE t (x)"), "not an frtools incident"),
        (_newer_catalog, "written by a newer frtools (catalog schema 99"),
        (_truncated_catalog, "corrupt"),
    ],
    ids=["missing", "empty", "text", "foreign", "newer", "corrupt"],
)
def test_history_refuses_an_unusable_catalog_in_one_line(tmp_path, make, reason):
    catalog = tmp_path / "catalog.sqlite"
    make(catalog)
    p = frtools("history", str(catalog))
    assert p.returncode == 2
    assert p.stdout == ""
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"frtools history: error: {catalog}: ")
    assert reason in p.stderr


def test_history_without_a_catalog_is_a_usage_error():
    env = {"FRTOOLS_HISTORY": ""}
    p = frtools("history", env=env)
    assert p.returncode == 2 and "FRTOOLS_HISTORY" in p.stderr


def test_hostile_texts_and_views_are_bounded_or_refused(tmp_path):
    catalog = tmp_path / "hostile.sqlite"
    record_incident(catalog, incident(1, host="h" * 1_000_000))
    record_incident(catalog, incident(2, host="h" * 1_000_000))
    doc = history_json(catalog)
    assert doc["drain"]["hosts"] == []  # not a host name: stored as unknown, never ranked
    with sqlite3.connect(catalog) as conn:
        reasons = [r for (r,) in conn.execute("SELECT reason FROM guilty")]
    assert all("not a valid name, stored as unknown: host" in r for r in reasons), reasons

    viewed = tmp_path / "viewed.sqlite"
    record_incident(viewed, incident(1))
    conn = sqlite3.connect(viewed)
    conn.executescript("DROP TABLE guilty; CREATE VIEW guilty AS SELECT * FROM incidents;")
    conn.close()
    p = frtools("history", str(viewed))
    assert p.returncode == 2 and "no table guilty" in p.stderr


# -- the window, GPUs, healthy incidents -------------------------------------------------------


def test_a_huge_verdict_document_is_kept_short_and_still_json(tmp_path):
    catalog = tmp_path / "big.sqlite"
    document = {
        "schema_version": "1.1",
        "verdict": {"kind": "missing", "headline": "h", "waiting": list(range(10))},
        "inputs": [{"path": "x" * 100, "status": "ok"}] * 200_000,  # ~24 MB
    }
    record_incident(catalog, incident(1, verdict_document=document))
    with open_catalog(catalog) as c:
        kept = c.verdict_document(1)
    assert kept["verdict"]["kind"] == "missing" and "inputs" not in kept
    assert "truncated" in kept


def test_since_counts_only_the_window(tmp_path):
    catalog = tmp_path / "window.sqlite"
    now = time.time_ns()
    for n in range(3):  # three old incidents on node1, ten days ago
        record_incident(catalog, incident(n, analyzed_ns=now - 10 * DAY_NS))
    record_incident(catalog, incident(10, host="node2"))
    record_incident(catalog, incident(11, kind="healthy"))
    week = history_json(catalog)  # --since 7d
    assert week["incidents_in_window"] == 2
    assert week["drain"]["hosts"] == []
    assert week["window"]["since"].endswith("Z")
    everything = history_json(catalog, "--since", "all")
    assert [h["host"] for h in everything["drain"]["hosts"]] == ["node1"]
    assert everything["drain"]["hosts"][0]["share"] == 0.6
    dated = history_json(
        catalog, "--since", time.strftime("%Y-%m-%d", time.gmtime(now / 1e9 - 20 * 86400))
    )
    assert dated["incidents_in_window"] == 5
    p = frtools("history", str(catalog))
    assert p.stdout.startswith(" OK ")
    p = frtools("history", str(catalog), "--since", "yesterday-ish")
    assert p.returncode == 2 and "--since" in p.stderr


def test_gpus_are_known_by_id_else_by_host_and_device(tmp_path):
    assert gpu_identity("n1", "cuda:3", "GPU-abc") == "GPU-abc"
    assert gpu_identity("n1", "cuda:3", None) == "n1/cuda:3"
    assert gpu_identity("n1", "cpu", None) is None
    assert gpu_identity(None, "cuda:3", None) is None
    catalog = tmp_path / "gpus.sqlite"
    for n, host in enumerate(["n1", "n2"]):  # the same GPU, the host name changed
        g = GuiltyRecord(rank=3, host=host, device="cuda:3", device_id="GPU-abc")
        record_incident(catalog, incident(n, guilty=[g]))
    doc = history_json(catalog)
    assert [g["gpu"] for g in doc["drain"]["gpus"]] == ["GPU-abc"]
    assert doc["drain"]["gpus"][0]["incidents"] == 2
    assert sorted(h["host"] for h in doc["hosts"]) == ["n1", "n2"]


def test_an_empty_window_says_so(tmp_path):
    catalog = tmp_path / "old.sqlite"
    record_incident(catalog, incident(1, analyzed_ns=time.time_ns() - 30 * DAY_NS))
    p = frtools("history", str(catalog))
    assert p.returncode == 0
    assert "No incidents recorded since" in p.stdout and "1 in the catalog" in p.stdout
