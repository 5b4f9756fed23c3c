"""The recorder on a shared host (issue #11, recorder side): real jobs, real files, and, where
root, a second local user.

Each test is one finding of the security review; each failed on the code before the fix:

* a symlink at ``rank_0.frt`` made the job truncate and overwrite the file it points to;
* a box file another user created was opened and truncated in place (they kept it mapped);
* a job folder another user made was written into;
* header fields written through a second mapping (string-table usage and size, capacity,
  cursor, process-group table) crashed the process (SIGSEGV) or wrote out of bounds;
* a FIFO at ``rank_0.stacks`` hung the training process;
* a job-wide request chose the folder every rank writes into;
* the temporary files of a job-wide dump had predictable names: a planted symlink was
  followed;
* every request copied every rank's box again (20 requests, 20 copies);
* boxes, stacks and folders were world-readable (0644 / 0755);
* a second user's job on the same host could not record (``/dev/shm/frtools`` was the
  first user's).

Tests that need a second user run only as root (they create ``frtools-other`` and
``frtools-victim`` when missing, and run their steps with ``setpriv``/``runuser``).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pwd
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import free_port, rank_env, stop, wait_ranks

import frtools
from frtools.formats.blackbox import read_snapshot

ROOT = Path(frtools.__file__).resolve().parent.parent
ATTACKER = "frtools-other"
VICTIM = "frtools-victim"
PRECIOUS = b"precious bytes that no job may touch\n"

JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    import frtools.recorder as recorder

    if not os.environ.get("FRTOOLS_RECORD"):  # (frtools run enables it by itself)
        recorder.enable()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    markers = os.environ.get("SEC_MARKERS")
    if markers:  # tell the test we run, wait for it to act
        open(os.path.join(markers, f"ready_{rank}"), "w").close()
        deadline = time.time() + 90
        while not os.path.exists(os.path.join(markers, "go")) and time.time() < deadline:
            time.sleep(0.02)
    if os.environ.get("SEC_MORE"):  # new strings, a new group, more records
        for i in range(40):
            dist.all_reduce(torch.ones(i + 5))
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(torch.ones(3), group=group)
        dist.broadcast(torch.ones(2, 7), 0, group=group)
    if os.environ.get("SEC_SELF_REQUEST"):  # a job-wide dump, answered by this rank
        from frtools.formats import store_protocol as protocol
        from frtools.recorder.capture.c10d_internals import default_store

        assert recorder.start_job_wide_watcher()
        store = protocol.unwrap_store(default_store())
        seq = protocol.issue_request(store, "frtools/", {"kind": "request", "reason": "test"})
        deadline = time.time() + 30
        while time.time() < deadline and int(store.add(f"frtools/dump/{seq}/answered", 0)) < 1:
            time.sleep(0.05)
    dist.barrier()
    print("done", recorder.output_path(), flush=True)
    dist.destroy_process_group()
    """
)


def default_dir(uid: int) -> str:
    """The per-user default folder, as documented (README: ``/dev/shm/frtools-<uid>``)."""
    return f"/dev/shm/frtools-{uid}"


def _script(tmp: Path) -> Path:
    path = tmp / "job.py"
    path.write_text(JOB)
    path.chmod(0o644)
    return path


def _env(frtools_dir: Path | None, job_id: str, **extra: str) -> dict[str, str]:
    env = {
        "FRTOOLS_JOB_ID": job_id,
        "FRTOOLS_STALL_SECONDS": "0",
        "FRTOOLS_JOBWIDE_POLL": "0.05",
        "PYTHONPATH": str(ROOT),
        **extra,
    }
    if frtools_dir is not None:
        env["FRTOOLS_DIR"] = str(frtools_dir)
    return env


def _start(
    tmp: Path, world: int, env: dict[str, str], user: str | None = None, port: int | None = None
) -> list[subprocess.Popen]:
    port = port or free_port()
    script = _script(tmp)
    procs = []
    for rank in range(world):
        full = rank_env(rank, world, port, env)
        for key in [k for k in full if k.startswith("FRTOOLS_") and k not in env]:
            del full[key]  # only what the test sets (not the outer run's, e.g. pytest --frtools)
        argv = [sys.executable, str(script)]
        if user is not None:
            argv = as_user(user, argv)
            full["HOME"] = pwd.getpwnam(user).pw_dir
        procs.append(
            subprocess.Popen(
                argv,
                env=full,
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def _run(tmp: Path, world: int, env: dict[str, str], user: str | None = None, timeout=90):
    procs = _start(tmp, world, env, user)
    try:
        return wait_ranks(procs, timeout)
    finally:
        stop(procs)


def _assert_completed(result, world: int) -> None:
    assert not result.timed_out, "job hung:\n" + result.output()
    for r in result.ranks:
        assert r.returncode == 0, result.output()
        assert "done" in r.stdout, result.output()
    assert len(result.ranks) == world


def _victim_file(tmp: Path) -> Path:
    victim = tmp / "victim.txt"
    victim.write_bytes(PRECIOUS)
    return victim


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- a second local user -------------------------------------------------------------------


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
        return
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip(f"needs a second local user ({name}) and there is no useradd")
    subprocess.run(["useradd", "-m", name], check=True, capture_output=True)


def as_user(user: str, argv: list[str]) -> list[str]:
    """``argv`` run as ``user``. With setpriv, it keeps CAP_DAC_READ_SEARCH (read and search
    only: it still cannot write what it does not own), so that it can run this interpreter
    and this checkout wherever they live (e.g. under a 0700 /root)."""
    pw = pwd.getpwnam(user)
    if shutil.which("setpriv"):
        return [
            "setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--", *argv,
        ]  # fmt: skip
    return ["runuser", "-u", user, "--", *argv]


@pytest.fixture(scope="module")
def users() -> dict[str, pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("needs root: creates and acts as a second local user (frtools-other)")
    for name in (ATTACKER, VICTIM):
        _ensure_user(name)
    probe = subprocess.run(
        as_user(ATTACKER, [sys.executable, "-c", "import torch, frtools"]),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    if probe.returncode != 0:
        pytest.skip(f"{ATTACKER} cannot run this Python with torch: {probe.stderr.strip()[-300:]}")
    return {name: pwd.getpwnam(name) for name in (ATTACKER, VICTIM)}


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user can reach (pytest's tmp_path is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="frtools-sec-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run_as(user: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(as_user(user, argv), capture_output=True, text=True, timeout=60, **kwargs)


# -- files at the box's path ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_symlink_at_the_box_path_is_not_followed(tmp_path):
    victim = _victim_file(tmp_path)
    job_dir = _private_dir(tmp_path / "frt" / "symlink")
    (job_dir / "rank_0.frt").symlink_to(victim)
    (job_dir / "rank_0.stacks").symlink_to(victim)
    result = _run(tmp_path, 1, _env(tmp_path / "frt", "symlink"))
    _assert_completed(result, 1)
    assert victim.read_bytes() == PRECIOUS
    box = job_dir / "rank_0.frt"
    assert stat.S_ISREG(os.lstat(box).st_mode)
    assert stat.S_ISREG(os.lstat(job_dir / "rank_0.stacks").st_mode)
    assert read_snapshot(box).slots.size >= 3


@pytest.mark.timeout(120)
def test_box_file_created_by_another_user_is_replaced_not_opened(tmp_path, users):
    """A file of another user's at the box's path (say they keep it mapped, to read or change
    the header) is not opened: the recorder unlinks it and creates its own file."""
    job_dir = _private_dir(tmp_path / "frt" / "planted")
    planted = job_dir / "rank_0.frt"
    planted.write_bytes(PRECIOUS)
    os.chown(planted, users[ATTACKER].pw_uid, users[ATTACKER].pw_gid)
    planted.chmod(0o666)
    keep = tmp_path / "their_link"
    os.link(planted, keep)  # the attacker's handle on their inode
    their_inode = os.stat(planted).st_ino
    result = _run(tmp_path, 1, _env(tmp_path / "frt", "planted"))
    _assert_completed(result, 1)
    assert keep.read_bytes() == PRECIOUS  # their inode was never written
    st = os.lstat(planted)
    assert st.st_ino != their_inode and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert read_snapshot(planted).slots.size >= 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["named-dir", "per-user-default"])
def test_job_folder_made_by_another_user_is_refused_and_training_goes_on(shared_tmp, users, where):
    attacker = users[ATTACKER]
    if where == "named-dir":
        # FRTOOLS_DIR names a shared folder (like the old /dev/shm/frtools, mode 1777)
        root = shared_tmp / "shm"
        root.mkdir()
        root.chmod(0o1777)
        user, env_dir = None, root
        job_dir = root / "theirs"
    else:
        # the victim's per-user default, made first by the attacker
        root = Path(default_dir(users[VICTIM].pw_uid))
        shutil.rmtree(root, ignore_errors=True)
        user, env_dir = VICTIM, None
        job_dir = root / "theirs"
    try:
        made = _run_as(
            ATTACKER,
            ["sh", "-c", f'mkdir -p -m 0777 "{job_dir}" && chmod 0777 "{root}" "{job_dir}" '
             f'|| true; printf attacker > "{job_dir}/rank_0.frt"; chmod 0666 "{job_dir}/rank_0.frt"'],
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert os.stat(job_dir).st_uid == attacker.pw_uid
        work = shared_tmp / "work"
        work.mkdir(exist_ok=True)
        work.chmod(0o777)
        result = _run(work, 1, _env(env_dir, "theirs"), user=user)
        _assert_completed(result, 1)
        warnings = [ln for ln in result.ranks[0].stderr.splitlines() if "frtools:" in ln]
        assert len(warnings) == 1, result.output()
        assert "recording disabled" in warnings[0] and "another user" in warnings[0]
        assert (job_dir / "rank_0.frt").read_bytes() == b"attacker"
        assert sorted(p.name for p in job_dir.iterdir()) == ["rank_0.frt"]
    finally:
        if where == "per-user-default":
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(120)
def test_fifo_at_the_stacks_path_does_not_hang_the_job(tmp_path):
    job_dir = _private_dir(tmp_path / "frt" / "fifo")
    os.mkfifo(job_dir / "rank_0.stacks")
    result = _run(tmp_path, 1, _env(tmp_path / "frt", "fifo"), timeout=60)
    _assert_completed(result, 1)
    assert stat.S_ISREG(os.lstat(job_dir / "rank_0.stacks").st_mode)


# -- the header is never trusted back ------------------------------------------------------

# header fields (docs/snapshot-format.md): offset, struct format, value written over them
CORRUPTION = {
    "capacity": (20, "<I", 0xFFFFFFFF),
    "pg_capacity": (28, "<I", 0xFFFFFFFF),
    "strings_bytes": (56, "<Q", 0xFFFFFFF0),
    "next_record_id": (80, "<Q", 0x7FFFFFFFFFFFFF00),
    "strings_used": (88, "<Q", 0xF0000000),
    "pg_count": (96, "<I", 0x7FFFFFF0),
}


@pytest.mark.timeout(180)
def test_corrupted_header_fields_do_not_crash_the_job(tmp_path):
    """Another process writes nonsense into both ranks' headers through its own mapping while
    the job runs; the job then interns new strings, makes a group and records more ops."""
    markers = _private_dir(tmp_path / "markers")
    frt = tmp_path / "frt"
    procs = _start(tmp_path, 2, _env(frt, "corrupt", SEC_MARKERS=str(markers), SEC_MORE="1"))
    try:
        _wait_for(lambda: len(list(markers.glob("ready_*"))) == 2, 90, "both ranks")
        for rank in range(2):
            with open(frt / "corrupt" / f"rank_{rank}.frt", "r+b") as f:
                mm = mmap.mmap(f.fileno(), 4096)
                for offset, fmt, value in CORRUPTION.values():
                    struct.pack_into(fmt, mm, offset, value)
                mm.close()
        (markers / "go").touch()
        result = wait_ranks(procs, 90)
    finally:
        stop(procs)
    _assert_completed(result, 2)


# -- job-wide requests through the store ---------------------------------------------------


@pytest.fixture(scope="module")
def requested_job(tmp_path_factory):
    """A 2-rank job answering job-wide requests; the store is the test's to write, as it is
    anyone's who can reach it. Requests with a ``dir`` of the requester's choosing, symlinks
    planted at the old temporary names, then 20 requests in a second."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from frtools.formats import store_protocol as protocol

    tmp = tmp_path_factory.mktemp("requests")
    markers = _private_dir(tmp / "markers")
    frt = tmp / "frt"
    own_dumps = frt / "req" / "dumps"
    chosen = tmp / "chosen"
    victim = _victim_file(tmp)
    port = free_port()
    env = _env(frt, "req", SEC_MARKERS=str(markers))
    procs = _start(tmp, 2, env, port=port)
    out: dict = {"tmp": tmp, "own_dumps": own_dumps, "chosen": chosen, "victim": victim}
    try:
        _wait_for(lambda: len(list(markers.glob("ready_*"))) == 2, 90, "both ranks")
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        _wait_for(
            lambda: all(store.check([protocol.rank_key("frtools/", r)]) for r in range(2)),
            30,
            "the watchers' registration",
        )
        # symlinks at every temporary name the old code used, in both places it could write
        _private_dir(chosen)
        _private_dir(own_dumps)
        for p in procs:
            for d in (chosen, own_dumps):
                for name in ("stacks", "frt"):
                    for r in range(2):
                        tmp_name = d / f".rank_{r}.{name}.{p.pid}.tmp"
                        tmp_name.symlink_to(victim)
                        Path(f"{tmp_name}.tmp{p.pid}").symlink_to(victim)
        seq = protocol.issue_request(store, "frtools/", {"dir": str(chosen), "reason": "evil"})
        _wait_for(
            lambda: int(store.add(protocol.answered_key("frtools/", seq), 0)) >= 2,
            30,
            "both answers",
        )
        out["answers"] = [
            json.loads(store.get(protocol.answer_key("frtools/", seq, r))) for r in range(2)
        ]
        # 20 requests within a second, each naming a folder of its own
        flood = tmp / "flood"
        first = seq + 1
        t0 = time.monotonic()
        for i in range(20):
            protocol.issue_request(store, "frtools/", {"dir": str(flood / str(i))})
            time.sleep(0.045)
        out["flood_s"] = time.monotonic() - t0
        last = first + 19
        _wait_for(
            lambda: int(store.add(protocol.answered_key("frtools/", last), 0)) >= 2,
            30,
            "the answers to the last request",
        )
        out["flood"] = flood
        (markers / "go").touch()
        out["result"] = wait_ranks(procs, 60)
    finally:
        stop(procs)
    return out


def _copies(root: Path) -> list[Path]:
    return [p for p in root.rglob("rank_*.frt") if p.is_file() and not p.is_symlink()]


@pytest.mark.timeout(240)
def test_job_wide_request_cannot_choose_where_ranks_write(requested_job):
    _assert_completed(requested_job["result"], 2)
    chosen = requested_job["chosen"]
    assert not [p for p in chosen.iterdir() if not p.is_symlink()]
    own = requested_job["own_dumps"]
    assert {p.name for p in _copies(own)} == {"rank_0.frt", "rank_1.frt"}
    for answer in requested_job["answers"]:
        assert answer["dir"] == str(own)


@pytest.mark.timeout(240)
def test_temporary_files_of_a_dump_do_not_follow_planted_symlinks(requested_job):
    assert requested_job["victim"].read_bytes() == PRECIOUS
    own = requested_job["own_dumps"]
    for name in ("rank_0.frt", "rank_0.stacks", "rank_1.frt", "rank_1.stacks"):
        assert stat.S_ISREG(os.lstat(own / name).st_mode), name
    assert "Thread" in (own / "rank_0.stacks").read_text()


@pytest.mark.timeout(240)
def test_twenty_requests_in_a_second_do_not_make_twenty_copies(requested_job):
    assert requested_job["flood_s"] < 1.5
    copies = _copies(requested_job["tmp"])
    live = {requested_job["tmp"] / "frt" / "req" / f"rank_{r}.frt" for r in range(2)}
    copies = [p for p in copies if p not in live]
    assert len(copies) <= 2 * 2, copies  # at most one copy per rank, plus the first request's
    assert not requested_job["flood"].exists()


# -- modes ---------------------------------------------------------------------------------


def _tree_modes(root: Path) -> dict[str, tuple[str, int, int]]:
    modes = {}
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "?"
        modes[str(path.relative_to(root.parent))] = (kind, stat.S_IMODE(st.st_mode), st.st_gid)
    return modes


def _frtools_run(tmp: Path, frt: Path, job: str, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **_env(None, job, SEC_SELF_REQUEST="1", **extra)}
    env.pop("FRTOOLS_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "frtools", "run", "--dir", str(frt), "--",
         sys.executable, str(_script(tmp))],
        env=rank_env(0, 1, free_port(), env),
        capture_output=True, text=True, timeout=120, cwd=tmp,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_frtools_run_leaves_only_private_files_in_private_folders(tmp_path):
    frt = tmp_path / "frt"
    res = _frtools_run(tmp_path, frt, "modes")
    assert res.returncode == 0 and "done" in res.stdout, res.stdout + res.stderr
    modes = _tree_modes(frt)
    assert {"frt/modes/rank_0.frt", "frt/modes/rank_0.stacks", "frt/modes/dumps/rank_0.frt",
            "frt/modes/dumps/rank_0.stacks"} <= set(modes), modes  # fmt: skip
    for name, (kind, mode, _gid) in modes.items():
        assert (kind, mode) in (("dir", 0o700), ("file", 0o600)), (name, oct(mode))


@pytest.mark.timeout(180)
def test_share_group_opens_the_records_to_that_group_only(tmp_path, users):
    gid = users[ATTACKER].pw_gid
    frt = tmp_path / "frt"
    res = _frtools_run(tmp_path, frt, "shared", FRTOOLS_SHARE_GROUP=ATTACKER)
    assert res.returncode == 0 and "done" in res.stdout, res.stdout + res.stderr
    modes = _tree_modes(frt)
    assert "frt/shared/dumps/rank_0.frt" in modes
    for name, (kind, mode, group) in modes.items():
        assert (kind, mode, group) in (("dir", 0o750, gid), ("file", 0o640, gid)), (name, oct(mode))


# -- two users on one host -----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_second_users_job_on_the_same_host_records(shared_tmp, users):
    """One user's job, then another's, both with the default folder: both record, each in
    a folder of its own, and `frtools dump` run by each finds its job with no options."""
    job = f"two-users-{os.getpid()}"
    other = users[ATTACKER]
    mine = Path(default_dir(os.geteuid())) / job
    theirs = Path(default_dir(other.pw_uid)) / job
    work = shared_tmp / "work"
    work.mkdir()
    work.chmod(0o777)
    try:
        first = _run(work, 1, _env(None, job))
        _assert_completed(first, 1)
        second = _run(work, 1, _env(None, job), user=ATTACKER)
        _assert_completed(second, 1)
        assert "recording disabled" not in first.output() + second.output()
        assert os.lstat(mine / "rank_0.frt").st_uid == os.geteuid()
        assert os.lstat(theirs / "rank_0.frt").st_uid == other.pw_uid
        assert stat.S_IMODE(os.lstat(theirs.parent).st_mode) == 0o700
        out = work / "their-dump"
        dumped = _run_as(
            ATTACKER,
            [sys.executable, "-m", "frtools", "dump", job, "-o", str(out)],
            env={**{k: v for k, v in os.environ.items() if not k.startswith("FRTOOLS_")},
                 "PYTHONPATH": str(ROOT), "HOME": other.pw_dir},
            cwd=work,
        )  # fmt: skip
        assert dumped.returncode == 0, dumped.stdout + dumped.stderr
        assert json.loads((out / "manifest.json").read_text())["ranks_found"] == [0]
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)
        with contextlib.suppress(OSError):
            theirs.parent.rmdir()  # the other user's per-user folder, when nothing else is in it


# -- the collector reads only from folders of its own user ---------------------------------


@pytest.mark.timeout(30)
def test_job_wide_collector_reads_no_folder_the_store_names_unless_it_is_its_own(
    tmp_path, monkeypatch
):
    """An answer in the store names the folder a rank wrote into; `frtools dump --job-wide`
    reads from it only when it is the user's own private folder (not through a link, not
    writable by others), and copies only the rank's own file names, never links."""
    from frtools.collect.jobwide import _collect_rank
    from frtools.formats.manifest import RankEntry

    for name in ("FRTOOLS_DUMP_DIR", "FRTOOLS_DIR"):
        monkeypatch.delenv(name, raising=False)
    secret = _victim_file(tmp_path)
    good = _private_dir(tmp_path / "good")
    (good / "rank_0.frt").write_bytes(b"box")
    (good / "rank_0.stacks").symlink_to(secret)  # a link is never copied
    (good / "passwd").write_bytes(b"not a rank file")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (open_dir / "rank_0.frt").write_bytes(b"planted")
    linked = tmp_path / "linked"
    linked.symlink_to(good)

    def collect(where: Path) -> RankEntry:
        out = tmp_path / f"out-{where.name}"
        out.mkdir()
        entry = RankEntry(rank=0, host="h", answered=True)
        _collect_rank(entry, {"dir": str(where), "files": ["passwd", "rank_0.frt"]}, out, None)
        return entry

    entry = collect(good)
    assert entry.files == ["rank_0.frt"]
    assert sorted(p.name for p in (tmp_path / "out-good").iterdir()) == ["rank_0.frt"]
    for bad in (open_dir, linked, tmp_path / "missing", Path("relative")):
        entry = collect(bad)
        assert entry.files == [] and "not readable here" in entry.note
        assert not any((tmp_path / f"out-{bad.name}").iterdir())
