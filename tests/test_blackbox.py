"""The native black box: ring buffer, crash survival, watchdog (stall flag, dump requests),
CUDA-event bookkeeping (with fake events on CPU)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from jobs import start_ranks, stop, wait_ranks

from frtools.formats.blackbox import (
    HEADER_OFFSETS,
    STRING_FULL,
    dump_acknowledged,
    read_header,
    read_snapshot,
    request_dump,
)
from frtools.recorder.native import load_native

native = load_native()
IDENTITY = {"job_id": "t", "rank": 0, "world_size": 4, "host": "h", "backend": "gloo"}


def make_box(tmp_path: Path, capacity: int = 64, strings: int = 1 << 16, name: str = "rank_0"):
    path = tmp_path / f"{name}.frt"
    box = native.BlackBox(str(path), capacity, strings, json.dumps(IDENTITY))
    return box, path


def record_n(box, n: int, pg: int = 0, first_seq: int = 1) -> list[int]:
    op = box.intern("all_reduce")
    sizes = box.intern("[[4,2]]")
    dtypes = box.intern("Float")
    return [
        box.record(pg, op, first_seq + i, 0, -1, False, sizes, sizes, dtypes, dtypes, 0)
        for i in range(n)
    ]


def wait_for(predicate, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.mark.timeout(10)
def test_ring_keeps_newest_records_and_says_it_wrapped(tmp_path):
    box, path = make_box(tmp_path, capacity=8)
    box.add_process_group("0", "default_pg", [0, 1, 2, 3])
    rids = record_n(box, 20)
    assert rids == list(range(20))
    snap = read_snapshot(path)
    assert snap.slots["record_id"].tolist() == list(range(12, 20))
    assert snap.slots["collective_seq_id"].tolist() == list(range(13, 21))
    assert snap.wrapped
    assert snap.records_written == 20
    box.close()


@pytest.mark.timeout(10)
def test_pending_splits_go_to_this_threads_next_record_only(tmp_path):
    box, path = make_box(tmp_path)
    box.add_process_group("0", "default_pg", [0, 1, 2, 3])
    assert box.pend_splits("6,2/4,4") is False  # nothing was pending
    other: list[int] = []
    worker = threading.Thread(target=lambda: other.extend(record_n(box, 1, first_seq=1)))
    worker.start()
    worker.join()
    mine = record_n(box, 2, first_seq=2)  # the first takes them, the second does not
    assert box.pend_splits("1/1") is False  # they were taken
    assert box.pend_splits(None) is True  # these were not: cleared unused
    last = record_n(box, 1, first_seq=4)
    snap = read_snapshot(path)
    splits = dict(zip(snap.slots["record_id"].tolist(), snap.slots["splits"].tolist(), strict=True))
    assert snap.string(splits[mine[0]]) == "6,2/4,4"
    assert [splits[r] for r in (other[0], mine[1], last[0])] == [0, 0, 0]
    box.close()


@pytest.mark.timeout(10)
def test_small_ring_that_did_not_wrap_is_not_flagged(tmp_path):
    box, path = make_box(tmp_path, capacity=8)
    record_n(box, 8)
    snap = read_snapshot(path)
    assert len(snap.slots) == 8 and not snap.wrapped


@pytest.mark.timeout(10)
def test_intern_and_process_groups_are_idempotent(tmp_path):
    box, path = make_box(tmp_path, strings=128)
    assert box.intern("all_reduce") == box.intern("all_reduce")
    assert box.intern("send") != box.intern("all_reduce")
    assert box.add_process_group("1", "tp", [0, 1]) == 0
    assert box.add_process_group("2", "dp", [0, 2]) == 1
    assert box.add_process_group("1", "tp", [0, 1]) == 0
    # a group created again under its name (after destroy_process_group): a row of its own,
    # which the name finds from then on
    assert box.add_process_group("1", "tp", [0, 1], True) == 2
    assert box.add_process_group("1", "tp", [0, 1]) == 2
    assert box.intern("x" * 200) == STRING_FULL
    snap = read_snapshot(path)
    assert [(g.name, g.desc, g.ranks) for g in snap.groups] == [
        ("1", "tp", (0, 1)),
        ("2", "dp", (0, 2)),
        ("1", "tp", (0, 1)),
    ]
    assert snap.string(STRING_FULL) == "<string table full>"
    assert any("string table was full" in n for n in snap.notes)


@pytest.mark.timeout(10)
def test_states_and_completer_stamp_only_their_own_record(tmp_path):
    box, path = make_box(tmp_path, capacity=4)
    r0, r1 = record_n(box, 2)
    box.mark_started(r0)
    done = box.completer(r1)
    done("any", "arguments", future=None)
    assert done.record_id == r1
    assert (box.state(r0), box.state(r1)) == (2, 3)
    snap = read_snapshot(path)
    state = dict(zip(snap.slots["record_id"].tolist(), snap.slots["state"].tolist(), strict=True))
    assert state == {r0: 2, r1: 3}
    assert snap.slots["time_started_ns"][0] >= snap.slots["time_created_ns"][0] > 0
    assert snap.slots["time_completed_ns"][1] > 0
    # r0's slot is reused by record 4: a late completion of r0 must not touch record 4
    later = record_n(box, 3)
    assert later[-1] == 4
    box.mark_completed(r0)
    assert box.state(4) == 1 and box.state(r0) == 0


@pytest.mark.timeout(30)
def test_two_threads_recording_get_unique_ids_and_no_torn_slot(tmp_path):
    box, path = make_box(tmp_path, capacity=32768)
    results: dict[str, list[int]] = {}

    def worker(name: str) -> None:
        results[name] = record_n(box, 10_000)
        for rid in results[name][::2]:
            box.mark_completed(rid)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ids = results["a"] + results["b"]
    assert len(set(all_ids)) == 20_000
    snap = read_snapshot(path)
    assert snap.torn == 0
    assert len(snap.slots) == 20_000
    assert sorted(snap.slots["record_id"].tolist()) == sorted(all_ids)
    assert len(set(snap.slots["thread_id"].tolist())) == 2


CRASH_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    from frtools.recorder._blackbox import BlackBox
    path, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    box = BlackBox(path, 4096, 1 << 16, json.dumps({"rank": 3, "world_size": 4}))
    pg = box.add_process_group("0", "default_pg", [0, 1, 2, 3])
    op = box.intern("all_reduce")
    for i in range(n):
        rid = box.record(pg, op, i + 1, 0, -1, False, 0, 0, 0, 0, 0)
        if i < n - 1:
            box.mark_completed(rid)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(7)
    """
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how,code", [("kill", -signal.SIGKILL), ("exit", 7)])
def test_records_survive_the_process_dying(tmp_path, how, code):
    path = tmp_path / "rank_3.frt"
    procs = start_ranks([sys.executable, "-c", CRASH_SCRIPT, str(path), "1000", how], 1)
    result = wait_ranks(procs, timeout=20)
    assert result.ranks[0].returncode == code, result.output()
    snap = read_snapshot(path)
    assert snap.identity["rank"] == 3
    assert len(snap.slots) == 1000 and snap.torn == 0
    assert snap.slots["collective_seq_id"].tolist() == list(range(1, 1001))
    assert snap.slots["state"].tolist() == [3] * 999 + [1]


@pytest.mark.timeout(30)
def test_watchdog_flags_a_stall_and_clears_it_when_the_op_completes(tmp_path):
    box, path = make_box(tmp_path)
    box.start_watchdog(20, 0.5, 0)
    first, stuck = record_n(box, 2)
    box.mark_completed(first)
    assert not box.stalled()
    assert wait_for(lambda: read_header(path)["stalled"] == 1, timeout=8)
    header = read_header(path)
    assert box.stalled()
    assert header["stall_record_id"] == stuck
    assert header["stall_time_ns"] > 0 and header["heartbeat_ns"] > 0
    box.mark_completed(stuck)
    assert wait_for(lambda: not box.stalled(), timeout=8)
    box.close()
    assert read_header(path)["watchdog_state"] == 2


@pytest.mark.timeout(10)
def test_stall_detection_is_off_with_zero_seconds(tmp_path):
    box, path = make_box(tmp_path)
    record_n(box, 1)
    box.start_watchdog(10, 0.0, 0)
    time.sleep(0.3)
    assert not box.stalled()
    assert read_header(path)["heartbeat_ns"] > 0
    box.close()


DUMP_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, signal, sys, threading, time
    from frtools.recorder._blackbox import BlackBox
    from frtools.recorder.native import register_stack_signal
    path, stacks, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    out = open(stacks, "a")
    register_stack_signal(signal.SIGUSR2, out)

    def helper_thread_waiting():
        time.sleep(60)

    threading.Thread(target=helper_thread_waiting, daemon=True).start()
    box = BlackBox(path, 64, 1 << 16, json.dumps({"rank": 0}))
    box.start_watchdog(20, 0.0, int(signal.SIGUSR2))

    def main_thread_holding_the_gil():
        ctypes.PyDLL(None).sleep(30)  # libc sleep called with the GIL held

    if mode == "gil":
        main_thread_holding_the_gil()
    else:
        time.sleep(30)
    """
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sleep", "gil"])
def test_dump_request_is_answered_with_every_threads_stack(tmp_path, mode):
    path = tmp_path / "rank_0.frt"
    stacks = tmp_path / "rank_0.stacks"
    procs = start_ranks([sys.executable, "-c", DUMP_SCRIPT, str(path), str(stacks), mode], 1)
    try:

        def watchdog_running() -> bool:
            try:
                return read_header(path)["watchdog_state"] == 1
            except (OSError, ValueError):
                return False

        assert wait_for(watchdog_running, timeout=15), "subprocess never started its watchdog"
        time.sleep(0.2)  # let the main thread reach its sleep
        seq = request_dump(path)
        assert seq == 1
        t0 = time.monotonic()
        # answered within a few watchdog polls (ms); 5 s leaves room for a loaded CI box
        assert wait_for(lambda: dump_acknowledged(path, seq), timeout=5)
        assert time.monotonic() - t0 < 5
        assert read_header(path)["dump_ack_status"] == 1
        text = stacks.read_text()
        assert "helper_thread_waiting" in text
        if mode == "gil":
            assert "main_thread_holding_the_gil" in text
        assert procs[0].poll() is None, "the dump must not kill the process"
        seq2 = request_dump(path)
        assert seq2 == 2 and wait_for(lambda: dump_acknowledged(path, seq2), timeout=8)
    finally:
        stop(procs)


@pytest.mark.timeout(30)
def test_dump_request_without_a_stack_handler_is_acknowledged_and_harmless(tmp_path):
    box, path = make_box(tmp_path)
    # SIGUSR1 left at its default action (terminate): the watchdog must not raise it
    box.start_watchdog(10, 0.0, int(signal.SIGUSR1))
    previous = signal.getsignal(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        seq = request_dump(path)
        assert wait_for(lambda: dump_acknowledged(path, seq), timeout=8)
        assert read_header(path)["dump_ack_status"] == 2
    finally:
        signal.signal(signal.SIGUSR1, previous)
        box.close()


@pytest.mark.timeout(10)
def test_cuda_events_drive_started_completed_and_duration(tmp_path):
    box, path = make_box(tmp_path)
    box._fake_events(True)
    rid, other = record_n(box, 2)
    start, end = 0x1000, 0x2000
    box._fake_event_set(start, False, 0.0)
    box._fake_event_set(end, False, 0.0)
    box.watch_cuda(rid, start, end)
    box._poll_once()
    assert box.state(rid) == 1 and box.cuda_pending() == 1
    box._fake_event_set(start, True, 100.0)
    box._poll_once()
    assert box.state(rid) == 2
    box._fake_event_set(end, True, 112.5)
    box._poll_once()
    assert box.state(rid) == 3 and box.cuda_pending() == 0
    assert box.drain_cuda_done() == [rid]
    assert box.drain_cuda_done() == []
    snap = read_snapshot(path)
    row = snap.slots[snap.slots["record_id"] == rid][0]
    assert row["duration_ms"] == pytest.approx(12.5)
    assert row["flags"] & 1
    assert row["time_started_ns"] <= row["time_completed_ns"]
    assert box.state(other) == 1


@pytest.mark.timeout(30)
def test_cuda_events_polled_by_the_watchdog_thread(tmp_path):
    box, path = make_box(tmp_path)
    box._fake_events(True)
    (rid,) = record_n(box, 1)
    box._fake_event_set(1, True, 5.0)
    box._fake_event_set(2, False, 0.0)
    box.watch_cuda(rid, 1, 2)
    box.start_watchdog(10, 0.0, 0)
    assert wait_for(lambda: box.state(rid) == 2, timeout=8)
    box._fake_event_set(2, True, 7.0)
    assert wait_for(lambda: box.state(rid) == 3, timeout=8)
    box.close()
    row = read_snapshot(path).slots[0]
    assert row["duration_ms"] == pytest.approx(2.0)


@pytest.mark.timeout(10)
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_directory_raises_oserror_naming_the_path(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OSError, match="locked"):
        native.BlackBox(str(locked / "rank_0.frt"), 8, 4096, "{}")


@pytest.mark.timeout(10)
def test_path_under_a_file_raises_oserror_naming_the_path(tmp_path):
    (tmp_path / "plain_file").write_text("")
    target = tmp_path / "plain_file" / "rank_0.frt"
    with pytest.raises(OSError, match="plain_file"):
        native.BlackBox(str(target), 8, 4096, "{}")


@pytest.mark.timeout(10)
def test_missing_directory_raises_oserror_naming_the_path(tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "rank_0.frt"
    with pytest.raises(OSError) as info:
        native.BlackBox(str(target), 8, 4096, "{}")
    assert info.value.filename == str(target)
    assert str(target) in str(info.value)


@pytest.mark.timeout(10)
def test_closed_box_ignores_records_and_keeps_the_file(tmp_path):
    box, path = make_box(tmp_path)
    record_n(box, 3)
    box.close()
    box.close()
    assert box.closed
    assert box.record(0, 8, 4, 0, -1, False, 0, 0, 0, 0, 0) == -1
    with pytest.raises(ValueError, match="closed"):
        box.intern("all_reduce")
    box.mark_completed(0)
    snap = read_snapshot(path)
    assert len(snap.slots) == 3 and snap.header["closed"] == 1


@pytest.mark.timeout(20)
def test_forked_child_does_not_write_into_the_parents_black_box(tmp_path):
    box, path = make_box(tmp_path)
    box.start_watchdog(10, 0.0, 0)
    record_n(box, 2)
    pid = os.fork()
    if pid == 0:  # child: every call is a quiet no-op
        code = 0
        try:
            if box.record(0, 8, 9, 0, -1, False, 0, 0, 0, 0, 0) != -1:
                code = 3
            if box.intern("child-only string") != 0 or not box.closed:
                code = 4
            box.mark_completed(0)
            box.close()
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert record_n(box, 1) == [2]
    assert box.state(0) == 1
    snap = read_snapshot(path)
    assert snap.slots["record_id"].tolist() == [0, 1, 2]
    assert "child-only string" not in snap.strings_blob.decode("utf-8", "replace")
    box.close()
    assert read_header(path)["watchdog_state"] == 2


@pytest.mark.timeout(30)
def test_missing_native_module_is_reported_and_snapshots_still_read(tmp_path):
    box, path = make_box(tmp_path)
    record_n(box, 3)
    box.close()
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # the analyzer runs without torch
        sys.modules["frtools.recorder._blackbox"] = None  # and without a compiler
        from frtools.recorder.native import NativeUnavailable, load_native
        try:
            load_native()
        except NativeUnavailable as e:
            print("unavailable:", e)
        from pathlib import Path
        from frtools.analyze.readers import frtools_snapshot
        print("rows:", frtools_snapshot.read(Path({str(path)!r})).entries.num_rows)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert proc.returncode == 0, proc.stderr
    assert "unavailable: the native black box is not built" in proc.stdout
    assert "rows: 3" in proc.stdout


CHAIN_SCRIPT = textwrap.dedent(
    """
    import json, signal, sys, time
    from frtools.recorder._blackbox import BlackBox
    from frtools.recorder.native import register_stack_signal
    path, stacks = sys.argv[1], sys.argv[2]
    seen = []
    signal.signal(signal.SIGUSR2, lambda *_: seen.append(1))  # the user's own handler
    chained = register_stack_signal(signal.SIGUSR2, open(stacks, "a"))
    box = BlackBox(path, 64, 1 << 16, json.dumps({"rank": 0}))
    box.start_watchdog(20, 0.0, int(signal.SIGUSR2))
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    print("chained", chained, "user handler ran", bool(seen), flush=True)
    """
)


@pytest.mark.timeout(40)
def test_dump_request_still_reaches_the_users_own_signal_handler(tmp_path):
    path = tmp_path / "rank_0.frt"
    stacks = tmp_path / "rank_0.stacks"
    procs = start_ranks([sys.executable, "-c", CHAIN_SCRIPT, str(path), str(stacks)], 1)
    try:

        def watchdog_running() -> bool:
            try:
                return read_header(path)["watchdog_state"] == 1
            except (OSError, ValueError):
                return False

        assert wait_for(watchdog_running, timeout=15)
        seq = request_dump(path)
        assert wait_for(lambda: dump_acknowledged(path, seq), timeout=8)
        result = wait_ranks(procs, timeout=20)
        assert result.ranks[0].returncode == 0, result.output()
        assert "chained True user handler ran True" in result.ranks[0].stdout
        assert "most recent call first" in stacks.read_text()
    finally:
        stop(procs)


# --------------------------------------------------------------------------------------
# Failure facts: failed ops, how the process ended
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_failed_op_keeps_its_state_and_no_completion_comes_after_it(tmp_path):
    box, path = make_box(tmp_path)
    r0, r1, r2 = record_n(box, 3)
    assert box.mark_failed(r0, "Connection closed by peer [127.0.0.1]:4242")
    box.mark_completed(r0)  # a completion inferred later (a newer op completed): ignored
    box.mark_completed(r1)
    assert box.mark_failed(r1, "Timed out waiting 4000ms for recv operation to complete")
    assert not box.mark_failed(r1, "a second failure")  # the first one is kept
    snap = read_snapshot(path)
    slots = snap.slots
    assert slots["state"].tolist() == [1, 2, 1]  # r1's completion was undone: it failed
    assert [snap.string(e) for e in slots["error"]] == [
        "Connection closed by peer [127.0.0.1]:4242",
        "Timed out waiting 4000ms for recv operation to complete",
        "",
    ]
    assert (slots["flags"] & 2).tolist() == [2, 2, 0]
    assert slots["time_failed_ns"][0] >= slots["time_created_ns"][0] > 0
    assert slots["time_completed_ns"][1] == 0 and slots["time_failed_ns"][2] == 0
    assert snap.header["ops_failed"] == 2
    assert box.state(r2) == 1


@pytest.mark.timeout(10)
def test_rank_summary_carries_failed_ops_and_the_recorded_ending(tmp_path):
    """What recovery's agreement reads of a box (formats.summary) keeps its failure facts."""
    from frtools.formats.summary import decode, encode, summarize

    box, path = make_box(tmp_path)
    r0, _ = record_n(box, 2)
    box.mark_failed(r0, "Connection closed by peer [127.0.0.1]:4242\nsecond line")
    box.mark_exit(native.EXIT_EXCEPTION, 1, "RuntimeError: CUDA error: an illegal memory access")
    s = summarize(read_snapshot(path))
    assert [e.error for e in s.entries] == ["Connection closed by peer [127.0.0.1]:4242", ""]
    assert (s.exit_kind, s.exit_detail) == (
        "exception",
        "RuntimeError: CUDA error: an illegal memory access",
    )
    assert decode(encode(s)) == [s]


ENDING = textwrap.dedent(
    """
    import ctypes, json, os, signal, sys
    from frtools.recorder.native import load_native
    from frtools.recorder import exits
    how = sys.argv[2]
    box = load_native().BlackBox(sys.argv[1], 8, 1 << 16, json.dumps({"rank": 0}))
    if how == "faulthandler_first":
        import faulthandler; faulthandler.enable()
    exits.watch(box)
    if how == "faulthandler_after":
        import faulthandler; faulthandler.enable()
    if how == "exception":
        def deep(): raise ValueError("bad value")
        deep()
    elif how == "thread":
        import threading
        def boom(): raise KeyError("k")
        t = threading.Thread(target=boom, name="loader"); t.start(); t.join()
    elif how in ("segv", "faulthandler_first", "faulthandler_after"):
        ctypes.string_at(0)
    elif how == "abort":
        os.abort()
    elif how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "os_exit":
        os._exit(7)
    elif how == "exit":
        sys.exit(5)
    elif how == "fork":  # the child's ending is not its parent's
        pid = os.fork()
        if pid == 0:
            os._exit(9)
        os.waitpid(pid, 0)
        sys.exit(4)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "returncode", "ending"),
    [
        ("clean", 0, ("clean", None)),
        ("exit", 5, ("exit", "exit status 5")),
        ("os_exit", 7, ("os_exit", "exit status 7")),
        ("exception", 1, ("exception", "ValueError: bad value")),
        ("thread", 0, ("clean", None)),
        ("segv", -11, ("signal", "SIGSEGV")),
        ("abort", -6, ("signal", "SIGABRT")),
        ("term", -15, ("signal", "SIGTERM")),
        ("faulthandler_first", -11, ("signal", "SIGSEGV")),
        ("faulthandler_after", -11, ("signal", "SIGSEGV")),
        ("fork", 4, ("exit", "exit status 4")),
    ],
)
def test_how_the_process_ended_is_in_the_header(tmp_path, how, returncode, ending):
    path = tmp_path / "rank_0.frt"
    proc = subprocess.run(
        [sys.executable, "-c", ENDING, str(path), how], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == returncode, proc.stderr
    snap = read_snapshot(path)
    assert snap.exit_watched
    assert snap.ending(alive=False) == ending
    assert snap.header["exit_time_ns"] > 0
    if how == "exception":
        assert snap.exit_stack.splitlines()[0].endswith(" in deep")
        assert "ValueError: bad value" in proc.stderr  # the previous excepthook still ran
    if how == "thread":
        assert snap.thread_error.startswith("loader: KeyError: 'k' (at ")
    if how.startswith("faulthandler"):
        assert "Fatal Python error: Segmentation fault" in proc.stderr  # chained


@pytest.mark.timeout(10)
def test_nothing_recorded_means_running_or_killed_by_liveness(tmp_path):
    box, path = make_box(tmp_path)
    box.close()  # closed, but a version-2 box says "clean" only when its process said so
    snap = read_snapshot(path)
    assert snap.ending(alive=True) == ("running", None)
    assert snap.ending(alive=False) == ("killed", None)
    assert snap.ending(alive=None) == (None, None)


@pytest.mark.timeout(10)
def test_an_open_version_1_box_of_a_gone_process_is_not_called_killed(tmp_path):
    """Version 1 recorded no ending, and its recorder did not always close the box on a
    clean exit: a box left open tells nothing (a healthy job's ranks were read as killed)."""
    box, path = make_box(tmp_path)
    box.close()
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, HEADER_OFFSETS["version"], 1)
    struct.pack_into("<I", data, HEADER_OFFSETS["closed"], 0)  # left open, as it exited
    path.write_bytes(bytes(data))
    snap = read_snapshot(path)
    assert snap.version == 1 and not snap.header["closed"]
    assert snap.ending(alive=False) == (None, None)
    assert snap.ending(alive=True) == ("running", None)


def test_start_up_phases_and_the_restated_identity_read_back(tmp_path):
    """A box opened at process start records each start-up phase once, with its time, and the
    identity restated at the first group (backend, device) wins over the one it opened with;
    the same bytes marked version 2 read as 'phases not recorded'."""
    box, path = make_box(tmp_path)
    box.set_phase(1)
    box.set_phase(3)
    box.set_phase(4)
    box.set_identity(json.dumps({**IDENTITY, "backend": "nccl", "device": "cuda:0"}))
    snap = read_snapshot(path)
    assert snap.version == 3
    assert snap.startup_phase == "connect"
    assert list(snap.phase_times()) == ["started", "rendezvous", "connect"]
    assert (snap.identity["backend"], snap.identity["device"]) == ("nccl", "cuda:0")
    with pytest.raises(ValueError, match="start-up phase 9"):
        box.set_phase(9)
    box.close()

    old = bytearray(path.read_bytes())
    struct.pack_into("<I", old, HEADER_OFFSETS["version"], 2)
    snap2 = read_snapshot(bytes(old))
    assert (snap2.startup_phase, snap2.phase_times()) == (None, {})
    assert snap2.identity["backend"] == "gloo"


def test_an_identity_update_naming_another_rank_is_ignored(tmp_path):
    """The update is data another process wrote: one naming another rank is dropped, noted."""
    box, path = make_box(tmp_path)
    box.set_identity(json.dumps({**IDENTITY, "rank": 3, "backend": "nccl"}))
    box.close()
    snap = read_snapshot(path)
    assert (snap.identity["rank"], snap.identity["backend"]) == (0, "gloo")
    assert any("another rank" in n for n in snap.notes)
