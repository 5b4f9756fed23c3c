"""The two summary encodings agree (docs/summary-format.md): one entry field list that the JSON
and packed codecs and the reader derive from, one keep rule that every summary writer
applies, and a summary that reads back equal through either encoding."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from frtools.analyze.summarize import summarize_path
from frtools.formats import summary as js
from frtools.formats import summary_packed as pk
from frtools.formats.blackbox import read_snapshot
from frtools.synth import synthesize

pytestmark = pytest.mark.timeout(240)


def _entry(k: int, **change) -> js.SummaryEntry:
    base = js.SummaryEntry(
        record_id=10 + k,
        group=k % 2,
        collective_seq_id=3 + k,
        p2p_seq_id=0,
        is_p2p=False,
        op="gloo:all_to_all_single",
        peer=None,
        input_sizes="[[12]]",
        output_sizes="[[12]]",
        input_dtypes="Float",
        output_dtypes="Float",
        state="completed",
        time_created_ns=1_000_000 * (k + 1),
        time_started_ns=1_000_000 * (k + 1) + 5,
        time_completed_ns=1_000_000 * (k + 1) + 90,
        duration_ms=0.25,
        thread_id="4242",
        thread_name="MainThread",
        stack="train.py:10 in step\nmodel.py:3 in forward",
        error="",
        retired=1,
        timeout_ms=600_000,
        call_site="train.py:10 in step",
        splits="3,9/9,3",
    )
    return dataclasses.replace(base, **change)


def _summary(rank: int) -> js.RankSummary:
    """A rank summary that sets every field, nulls and the unusual values included."""
    entries = [
        _entry(0),
        _entry(1, state="started", time_completed_ns=None, duration_ms=None, retired=0),
        _entry(2, is_p2p=True, op="gloo:send", peer=rank ^ 1, p2p_seq_id=7, splits=""),
        _entry(3, state="scheduled", time_started_ns=None, time_completed_ns=None,
               duration_ms=None, retired=None, timeout_ms=None, error="Connection reset",
               call_site="", group=-1),
    ]  # fmt: skip
    groups = [
        js.SummaryGroup("0", "default_pg", (0, 1, 2, 3), 9, -1, 8, 4, 3),
        js.SummaryGroup("1", "pp", tuple(sorted((rank, rank ^ 1))), 2, 2, 1, local_peers=True),
    ]
    return js.RankSummary(
        rank=rank,
        world_size=4,
        identity={"host": "node0", "pid": 100 + rank, "local_rank": rank, "device": "cpu"},
        groups=groups,
        entries=entries,
        taken_ns=7_000_000_000,
        heartbeat_ns=6_000_000_000,
        stalled=True,
        alive=False,
        wrapped=True,
        records_written=40,
        omitted=36,
        exit_kind="signal",
        exit_detail="SIGKILL",
        stacks='Thread 0x1 (most recent call first):\n  File "train.py", line 10 in step\n',
        notes=["a note"],
        dump_time_ns=6_500_000_000,
        startup_phase=None,
    )


def test_a_summary_reads_back_equal_through_json_and_packed() -> None:
    summaries = [_summary(r) for r in range(2)]
    via_json = js.decode(js.encode_host(summaries, "node0"))
    via_packed = pk.to_summaries(pk.decode_packed(pk.encode_packed(summaries, "node0")))
    assert via_json == summaries
    assert via_packed == summaries
    # one rank alone too
    assert js.decode(js.encode(summaries[1])) == [summaries[1]]


def _packed_header(data: bytes) -> dict:
    raw = zlib.decompress(data[len(pk.MAGIC) :])
    (n,) = struct.unpack_from("<I", raw)
    return json.loads(raw[4 : 4 + n])


def test_both_encodings_list_the_entry_fields_of_one_list() -> None:
    names = tuple(f.name for f in dataclasses.fields(js.SummaryEntry))
    assert names == js.ENTRY_FIELDS
    assert tuple(name for name, _ in js.ENTRY_COLUMNS) == names
    assert tuple(name for name, _ in pk.COLUMNS) == names
    assert set(pk.STRING_COLUMNS) | set(pk.NUMBER_COLUMNS) == set(names)
    assert not set(pk.STRING_COLUMNS) & set(pk.NUMBER_COLUMNS)
    # the string fields are strings in both encodings
    assert (
        tuple(name for name, kind in js.ENTRY_COLUMNS if kind == "s" and name != "state")
        == pk.STRING_COLUMNS
    )
    # and what each file says it holds is that list
    summary = _summary(0)
    assert tuple(json.loads(js.encode(summary))["columns"]) == names
    header = _packed_header(pk.encode_packed([summary]))
    assert tuple(name for name, _ in header["columns"]) == names


def test_the_keep_rule_keeps_old_pending_ops_then_the_window() -> None:
    done = np.array([True, False, True, False, True, True, False, True])
    kept = js.kept_positions(len(done), 3, lambda older: done[older])
    assert kept.tolist() == [1, 3, 5, 6, 7]
    # fewer ops than the window: all of them, completion never asked
    assert js.kept_positions(2, 3, lambda older: pytest.fail("asked")).tolist() == [0, 1]


def test_completed_ops_reads_state_retired_and_the_group_frontier() -> None:
    state = np.array([True, False, False, False, False])
    retired = np.array([False, True, False, False, False])
    is_p2p = np.array([False, False, False, True, False])
    seq = np.array([1, 2, 3, 3, 5])
    last = np.array([4, 4, 4, 4, 4])
    assert js.completed_ops(state).tolist() == [True, False, False, False, False]
    got = js.completed_ops(
        state, retired=retired, is_p2p=is_p2p, collective_seq_id=seq, last_completed=last
    )
    # seq 3 of a collective at or under the frontier completed; a P2P op is not counted
    # by the collective frontier; seq 5 is past it
    assert got.tolist() == [True, True, True, False, False]


def test_every_summary_writer_keeps_the_same_ops(tmp_path: Path) -> None:
    """A black box summarized in the rank (``formats.summary.summarize``), by ``frtools
    summarize`` (the readers' record) and by the simulator from its model keeps the same
    ops: one keep rule."""
    layout = {"world_size": 8, "tp": 2, "pp": 2, "fault": "missing", "seed": 1, "workers": 1}
    boxes = tmp_path / "boxes"
    synthesize(boxes, format="frtools", **layout)
    window = 2
    synth = tmp_path / "synth"
    synthesize(synth, format="summary", window=window, **layout)
    (simulated,) = sorted(synth.glob("*.summary"))
    by_model = {s.rank: s for s in pk.to_summaries(pk.decode_packed(simulated.read_bytes()))}
    by_reader = {s.rank: s for s in summarize_path(boxes, window=window, workers=1).summaries}
    older_pending = 0
    for path in sorted(boxes.glob("rank_*.frt")):
        in_rank = js.summarize(read_snapshot(path), window=window)
        ids = [e.record_id for e in in_rank.entries]
        assert ids == [e.record_id for e in by_reader[in_rank.rank].entries], path.name
        assert ids == [e.record_id for e in by_model[in_rank.rank].entries], path.name
        older_pending += len(ids) - window
    assert older_pending > 0  # some rank kept a pending op older than its window
