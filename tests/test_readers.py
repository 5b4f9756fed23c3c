"""Readers: every kind of input file -> one Trace, and every bad file -> one clear reason.

Real dumps come from one 4-rank Gloo job (session fixture); each PyTorch dump version is a
small explicit dict written as a pickle, the way that version's C++ wrote it.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import run_job

from frtools.analyze.readers import UnusableInput, load_trace, rank_from_filename, read_file
from frtools.formats import torch_fr
from frtools.model.ranks import MAX_WORLD_SIZE

JOB = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    out = sys.argv[1]
    dist.init_process_group("gloo")
    r = dist.get_rank()
    g01 = dist.new_group([0, 1])
    g23 = dist.new_group([2, 3])
    tp = g01 if r < 2 else g23
    x = torch.ones(4)
    for i in range(3):
        dist.all_reduce(x)                      # JOB_LINE_ALLREDUCE
        dist.all_reduce(x, group=tp)
    dist.barrier()
    os.makedirs(f"{out}/pkl", exist_ok=True)
    os.makedirs(f"{out}/json", exist_ok=True)
    with open(f"{out}/pkl/rank_{r}.pkl", "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    j = torch._C._distributed_c10d._dump_fr_trace_json()
    with open(f"{out}/json/rank_{r}.json", "w") as f:
        f.write(j if isinstance(j, str) else j.decode())
    dist.destroy_process_group()
    """
)
JOB_LINE_ALLREDUCE = next(
    i for i, line in enumerate(JOB.splitlines(), 1) if "JOB_LINE_ALLREDUCE" in line
)


@pytest.fixture(scope="session")
def gloo_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Flight Recorder dumps (pickle and JSON) of a real 4-rank Gloo job on torch."""
    out = tmp_path_factory.mktemp("gloo_dumps")
    script = out / "job.py"
    script.write_text(JOB)
    result = run_job(
        script, world_size=4, args=[str(out)], env={"TORCH_FR_BUFFER_SIZE": "2000"}, timeout=90
    )
    assert not result.timed_out and all(r.returncode == 0 for r in result.ranks), result.output()
    return out


# --- a tiny FR dump, any version ----------------------------------------------------------


def fr_entry(version: str, i: int, **over: object) -> dict:
    """One entry as PyTorch ``version`` wrote it (see docs/dump-formats.md)."""
    v = tuple(int(x) for x in version.split("."))
    e: dict = {
        "pg_id": 0,
        "profiling_name": "nccl:all_reduce",
        "time_created_ns": 1_000 + i,
        "input_sizes": [[4, 2]],
        "output_sizes": [[4, 2]],
        "state": "completed",
        "time_discovered_started_ns": 1_100 + i,
        "time_discovered_completed_ns": 1_200 + i,
        "retired": True,
        "frames": [
            {
                "filename": "/x/torch/distributed/distributed_c10d.py",
                "line": 1,
                "name": "all_reduce",
            },
            {"filename": "/job/train.py", "line": 42, "name": "step"},
        ],
    }
    if v >= (1, 4):
        e.update(record_id=i, op_id=i + 1)
    if v < (2, 0):
        e["seq_id"] = i + 1
    else:
        e.update(
            process_group=("0", "default_pg"),
            collective_seq_id=i + 1,
            p2p_seq_id=0,
            is_p2p=False,
            input_dtypes=["Float"],
            output_dtypes=["Float"],
        )
    if i % 2 == 0:  # written only once a duration was measured
        e["duration_ms"] = 0.5
    if v >= (2, 2):
        e["timeout_ms"] = 600_000
    if v >= (2, 10):
        e.update(thread_id="140000", thread_name="pt_main_thread")
    e.update(over)
    return e


def fr_dump(version: str, n: int = 3, world: int = 4, **top: object) -> dict:
    v = tuple(int(x) for x in version.split("."))
    d: dict = {"entries": [fr_entry(version, i) for i in range(n)], "version": version}
    if (1, 4) <= v < (2, 0):
        d["pg_config"] = {0: list(range(world))}
    elif v >= (2, 0):
        d["pg_config"] = {
            "0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}
        }
    if v >= (2, 3):
        d["pg_status"] = {
            "0": {
                "last_enqueued_collective": n,
                "last_started_collective": n,
                "last_completed_collective": n,
            }
        }
    if (2, 7) <= v < (2, 10):
        d["nccl_version"] = "2.21.5"
    if v >= (2, 10):
        d["comm_lib_version"] = "2.21.5"
    d.update(top)
    return d


def write_pickle(path: Path, dump: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(dump, protocol=2))
    return path


# --- real Gloo dumps ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_real_gloo_pickles_load_into_one_trace(gloo_dumps: Path) -> None:
    trace = load_trace(gloo_dumps / "pkl")
    assert sorted(trace.ranks) == [0, 1, 2, 3]
    assert trace.world_size == 4 and trace.missing_ranks == []
    assert [i.status for i in trace.inputs] == ["ok"] * 4
    info = trace.ranks[2]
    assert info.format == "torch-pickle" and info.version == "2.10" and not info.wrapped
    # per rank: 3 default-group all-reduces + barrier, 3 sub-group all-reduces
    assert trace.entries.num_rows == 4 * 7
    df = trace.entries.to_pandas()
    r0 = df[(df["rank"] == 0) & (df["pg_name"] == "0")]
    assert list(r0["collective_seq_id"]) == [1, 2, 3, 4]
    assert list(r0["op"]) == ["all_reduce"] * 3 + ["barrier"]
    assert set(df["state"]) == {"scheduled"}  # Gloo never reports more
    site = r0["call_site"].iloc[0]
    assert site.endswith(f"job.py:{JOB_LINE_ALLREDUCE} in <module>"), site
    assert "distributed_c10d.py" in r0["stack"].iloc[0]
    # pg_status is keyed by the group's uid in the dump; here it is keyed by name
    assert trace.ranks[2].pg_status["2"]["last_completed_collective"] == 3


@pytest.mark.timeout(120)
def test_gloo_membership_is_inferred_from_who_recorded_ops(gloo_dumps: Path) -> None:
    trace = load_trace(gloo_dumps / "pkl")
    groups = {name: (g.desc, g.ranks, g.inferred) for name, g in trace.process_groups.items()}
    assert groups == {
        "0": ("default_pg", (0, 1, 2, 3), True),
        "1": ("undefined", (0, 1), True),
        "2": ("undefined", (2, 3), True),
    }


@pytest.mark.timeout(120)
def test_real_gloo_json_dumps_read_like_the_pickles(gloo_dumps: Path) -> None:
    from_json = load_trace(gloo_dumps / "json")
    from_pickle = load_trace(gloo_dumps / "pkl")
    assert from_json.ranks[0].format == "torch-json"
    cols = ["rank", "record_id", "pg_name", "collective_seq_id", "op", "input_sizes", "state"]
    assert from_json.entries.select(cols).equals(from_pickle.entries.select(cols))
    df = from_json.entries.to_pandas()
    assert df["time_started_ns"].isna().all()  # JSON's 0 means "not seen", not 1970
    assert df["call_site"].isna().all()  # the JSON dump carries no frames
    assert from_json.ranks[1].pg_status["0"]["last_enqueued_collective"] >= 4


@pytest.mark.timeout(120)
def test_rank_missing_from_directory_is_reported(gloo_dumps: Path, tmp_path: Path) -> None:
    for r in (0, 2, 3):
        (tmp_path / f"rank_{r}.pkl").write_bytes(
            (gloo_dumps / "pkl" / f"rank_{r}.pkl").read_bytes()
        )
    trace = load_trace(tmp_path)
    assert trace.missing_ranks == [1]


@pytest.mark.timeout(120)
def test_pickle_and_json_of_same_rank_keep_the_one_with_stacks(
    gloo_dumps: Path, tmp_path: Path
) -> None:
    for sub in ("pkl", "json"):
        for f in (gloo_dumps / sub).iterdir():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    trace = load_trace(tmp_path)
    kept = {i.path.rsplit("/", 1)[1] for i in trace.inputs if i.status == "ok"}
    assert kept == {f"rank_{r}.pkl" for r in range(4)}
    dup = next(i for i in trace.inputs if i.path.endswith("rank_3.json"))
    assert dup.status == "duplicate"
    assert dup.reason == f"older dump of rank 3; using {tmp_path / 'rank_3.pkl'}"


# --- versions -----------------------------------------------------------------------------

VERSIONS = ["1.0", "1.1", "1.4", "2.0", "2.2", "2.3", "2.5", "2.7", "2.10", "2.11"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_fr_pickle_version_normalizes_the_same(version: str, tmp_path: Path) -> None:
    trace = load_trace(write_pickle(tmp_path / "nccl_trace_rank_1", fr_dump(version)))
    info = trace.ranks[1]
    assert info.version == version and info.format == "torch-pickle"
    rows = trace.entries.to_pylist()
    assert [r["collective_seq_id"] for r in rows] == [1, 2, 3]
    assert all(r["p2p_seq_id"] == 0 and r["is_p2p"] is False for r in rows)
    assert rows[0]["op"] == "all_reduce" and rows[0]["profiling_name"] == "nccl:all_reduce"
    assert rows[0]["pg_name"] == "0"
    assert rows[0]["input_sizes"] == "[[4,2]]"
    assert rows[0]["state"] == "completed" and rows[0]["time_completed_ns"] == 1200
    assert [r["duration_ms"] for r in rows] == [0.5, None, 0.5]
    assert rows[0]["call_site"] == "/job/train.py:42 in step"
    v = tuple(int(x) for x in version.split("."))
    assert [r["record_id"] for r in rows] == ([0, 1, 2] if v >= (1, 4) else [None] * 3)
    assert rows[0]["pg_desc"] == ("default_pg" if v >= (2, 0) else "")
    assert (rows[0]["input_dtypes"] == "Float") == (v >= (2, 0))
    assert (rows[0]["timeout_ms"] == 600_000) == (v >= (2, 2))
    assert (rows[0]["thread_name"] == "pt_main_thread") == (v >= (2, 10))
    assert (info.comm_lib_version == "2.21.5") == (v >= (2, 7))
    assert bool(info.pg_status) == (v >= (2, 3))
    if v >= (1, 4):
        g = trace.process_groups["0"]
        assert (g.ranks, g.inferred) == ((0, 1, 2, 3), False)
        assert trace.world_size == 4 and trace.missing_ranks == [0, 2, 3]
    else:  # no pg_config: membership is whoever recorded ops
        assert trace.process_groups["0"].inferred


@pytest.mark.parametrize("version", VERSIONS)
def test_version_table_names_the_keys_each_version_writes(version: str) -> None:
    """formats/torch_fr's table agrees with the dumps above, version by version."""
    assert set(fr_entry(version, 0)) == set(torch_fr.entry_keys(version))
    assert set(fr_dump(version)) == set(torch_fr.top_level_keys(version))


def test_member_lists_beyond_the_largest_world_are_refused() -> None:
    parse = torch_fr.parse_member_list
    assert parse("[3, 1, 2]") == (1, 2, 3) and parse([0, 1]) == (0, 1) and parse("all") == "all"
    assert parse(f"[0, {MAX_WORLD_SIZE - 1}]") == (0, MAX_WORLD_SIZE - 1)
    assert parse(f"[0, {MAX_WORLD_SIZE}]") is None
    assert parse("[-1, 0]") is None
    assert parse(list(range(MAX_WORLD_SIZE + 1))) is None
    assert parse("[" + "0, " * (MAX_WORLD_SIZE * 4) + "0]") is None  # too long to be one


@pytest.mark.timeout(30)
def test_group_listing_a_rank_beyond_the_largest_world_is_inferred(tmp_path: Path) -> None:
    dump = fr_dump("2.10")
    dump["pg_config"]["0"]["ranks"] = f"[0, 1, 2, {MAX_WORLD_SIZE * 8}]"
    trace = load_trace(write_pickle(tmp_path / "rank_1.pkl", dump))
    assert trace.process_groups["0"].inferred and trace.world_size == 2


@pytest.mark.timeout(30)
def test_unversioned_dump_with_only_pg_id_and_seq_id(tmp_path: Path) -> None:
    dump = fr_dump("1.1")
    del dump["version"]
    for e in dump["entries"]:
        e["pg_id"] = 3
    trace = load_trace(write_pickle(tmp_path / "rank_0.pkl", dump))
    assert trace.ranks[0].version == "unversioned"
    assert set(trace.entries.column("pg_name").to_pylist()) == {"3"}
    assert trace.entries.column("collective_seq_id").to_pylist() == [1, 2, 3]


@pytest.mark.timeout(30)
def test_unknown_future_version_reads_what_it_recognizes(tmp_path: Path) -> None:
    dump = fr_dump("2.10", new_top_level={"x": 1})
    dump["version"] = "3.2"
    for e in dump["entries"]:
        e["new_field"] = [1, 2]
        e["state"] = "started"
    trace = load_trace(write_pickle(tmp_path / "rank_0.pkl", dump))
    assert trace.ranks[0].version == "3.2"
    assert trace.entries.column("state").to_pylist() == ["started"] * 3


@pytest.mark.timeout(30)
def test_old_shared_seq_id_goes_to_p2p_seq_for_p2p_ops(tmp_path: Path) -> None:
    dump = fr_dump("1.4")
    dump["entries"][1]["profiling_name"] = "nccl:send 0->1"
    trace = load_trace(write_pickle(tmp_path / "rank_0.pkl", dump))
    rows = trace.entries.to_pylist()
    assert [(r["collective_seq_id"], r["p2p_seq_id"], r["is_p2p"]) for r in rows] == [
        (1, 0, False),
        (0, 2, True),
        (3, 0, False),
    ]


# --- P2P peers, coalesced ops, wrap ------------------------------------------------------


@pytest.mark.timeout(30)
def test_p2p_peers_are_mapped_from_group_local_to_global(tmp_path: Path) -> None:
    dump = fr_dump("2.10", n=0)
    dump["pg_config"]["5"] = {"name": "5", "desc": "PIPELINE", "ranks": "[2, 6]"}
    dump["entries"] = [
        fr_entry(
            "2.10",
            0,
            process_group=("5", "PIPELINE"),
            profiling_name="nccl:send 0->1",
            collective_seq_id=0,
            p2p_seq_id=1,
            is_p2p=True,
        ),
        fr_entry(
            "2.10",
            1,
            process_group=("5", "PIPELINE"),
            profiling_name="nccl:recv 0<-1",
            collective_seq_id=0,
            p2p_seq_id=2,
            is_p2p=True,
        ),
    ]
    trace = load_trace(write_pickle(tmp_path / "rank_2.pkl", dump))
    rows = trace.entries.to_pylist()
    assert [(r["op"], r["peer"], r["p2p_seq_id"]) for r in rows] == [("send", 6, 1), ("recv", 6, 2)]


@pytest.mark.timeout(30)
def test_p2p_peer_mapped_with_membership_from_another_rank(tmp_path: Path) -> None:
    # rank 6's file does not list group 5's members; rank 2's file does
    knows = fr_dump("2.10")
    knows["pg_config"]["5"] = {"name": "5", "desc": "PIPELINE", "ranks": "[2, 6]"}
    blind = fr_dump("2.10", n=0, pg_config={})
    blind["entries"] = [
        fr_entry(
            "2.10",
            0,
            process_group=("5", "PIPELINE"),
            profiling_name="nccl:recv 1<-0",
            collective_seq_id=0,
            p2p_seq_id=1,
            is_p2p=True,
        )
    ]
    write_pickle(tmp_path / "rank_2.pkl", knows)
    write_pickle(tmp_path / "rank_6.pkl", blind)
    trace = load_trace(tmp_path)
    df = trace.entries.to_pandas()
    assert df[df["rank"] == 6]["peer"].tolist() == [2]


@pytest.mark.timeout(30)
def test_coalesced_ops_keep_one_seq_id_per_group(tmp_path: Path) -> None:
    dump = fr_dump("2.10", n=0)
    dump["entries"] = [
        fr_entry("2.10", 0, profiling_name="nccl:all_reduce", collective_seq_id=1, op_id=1),
        fr_entry("2.10", 1, profiling_name="nccl:all_reduce", collective_seq_id=1, op_id=2),
        fr_entry("2.10", 2, profiling_name="nccl:coalesced", collective_seq_id=1, op_id=3),
        fr_entry("2.10", 3, profiling_name="nccl:ALLREDUCE_coalesced", collective_seq_id=2),
    ]
    trace = load_trace(write_pickle(tmp_path / "rank_0.pkl", dump))
    rows = trace.entries.to_pylist()
    assert [(r["op"], r["collective_seq_id"]) for r in rows] == [
        ("all_reduce", 1),
        ("all_reduce", 1),
        ("coalesced", 1),
        ("ALLREDUCE_coalesced", 2),
    ]


@pytest.mark.timeout(30)
def test_ring_buffer_wrap_is_flagged(tmp_path: Path) -> None:
    dump = fr_dump("2.10", n=0)
    dump["entries"] = [fr_entry("2.10", i, collective_seq_id=i + 1) for i in range(500, 503)]
    write_pickle(tmp_path / "rank_0.pkl", dump)
    write_pickle(tmp_path / "rank_1.pkl", fr_dump("2.10"))
    trace = load_trace(tmp_path)
    assert trace.ranks[0].wrapped and not trace.ranks[1].wrapped


# --- identity from file names and content -------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("name", "rank", "host"),
    [
        ("rank_3.pkl", 3, None),
        ("rank3", 3, None),
        ("rank-3.json", 3, None),
        ("nccl_trace_rank_7", 7, None),
        ("comm_lib_trace_rank_0", 0, None),
        ("fr_trace_rank_2.pkl.gz", 2, None),
        ("trace_dump_12", 12, None),
        ("_dump_12", 12, None),
        ("host-a_rank_5.pkl", 5, "host-a"),
        ("node01-rank-5", 5, "node01"),
        ("node01.cluster_nccl_trace_rank_11.json", 11, "node01.cluster"),
        ("gpu-node-3_rank12.pkl.gz", 12, "gpu-node-3"),
        ("trace_4.pkl", 4, None),
        ("dump.pkl", None, None),
        ("manifest.json", None, None),
    ],
)
def test_rank_and_host_from_file_name(name: str, rank: int | None, host: str | None) -> None:
    assert rank_from_filename(name) == (rank, host)


@pytest.mark.timeout(30)
def test_rank_and_host_in_content_win_over_the_name(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "dump.pkl", fr_dump("2.10", rank=9, host="gpu17"))
    trace = load_trace(path)
    assert list(trace.ranks) == [9] and trace.ranks[9].host == "gpu17"


@pytest.mark.timeout(30)
def test_host_from_file_name_reaches_rank_info(tmp_path: Path) -> None:
    write_pickle(tmp_path / "host-a_rank_1.pkl", fr_dump("2.10"))
    assert load_trace(tmp_path).ranks[1].host == "host-a"


@pytest.mark.timeout(30)
def test_dump_without_a_rank_is_an_error_naming_why(tmp_path: Path) -> None:
    write_pickle(tmp_path / "dump.pkl", fr_dump("2.10"))
    write_pickle(tmp_path / "rank_0.pkl", fr_dump("2.10"))
    trace = load_trace(tmp_path)
    bad = next(i for i in trace.inputs if i.path.endswith("dump.pkl"))
    assert bad.status == "error" and "cannot tell which rank" in bad.reason


# --- safety -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_pickle_that_would_run_a_command_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}".encode()
    # protocol 2: PROTO, GLOBAL os.system, the command, TUPLE1, REDUCE, STOP
    evil = b"\x80\x02cos\nsystem\nX" + len(cmd).to_bytes(4, "little") + cmd + b"\x85R."
    (tmp_path / "rank_0.pkl").write_bytes(evil)
    write_pickle(tmp_path / "rank_1.pkl", fr_dump("2.10"))
    trace = load_trace(tmp_path)
    bad = next(i for i in trace.inputs if i.path.endswith("rank_0.pkl"))
    assert bad.status == "error"
    assert bad.reason == "refused: the pickle tries to load os.system; a dump is data, never code"
    assert not marker.exists()
    assert list(trace.ranks) == [1]


@pytest.mark.timeout(30)
def test_pickled_object_of_any_class_is_refused(tmp_path: Path) -> None:
    class Sneaky:
        def __reduce__(self) -> tuple:
            return (print, ("hello",))

    (tmp_path / "rank_0.pkl").write_bytes(pickle.dumps({"entries": [Sneaky()]}, protocol=4))
    result = read_file(tmp_path / "rank_0.pkl")
    assert result.input.status == "error"
    assert result.input.reason.startswith("refused: the pickle tries to load builtins.print")


@pytest.mark.timeout(30)
def test_pickle_of_garbage_opcodes_is_an_error_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "rank_0.pkl").write_bytes(b"\x80\x02" + b"]" * 100_000 + b"\xff.")
    (tmp_path / "rank_1.pkl").write_bytes(b"\x80\x02" + b"h\x07.")  # BINGET of nothing
    for r in (0, 1):
        result = read_file(tmp_path / f"rank_{r}.pkl")
        assert result.input.status == "error"
        assert result.input.reason.startswith("corrupt pickle"), result.input.reason


# --- bad files ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_bad_files_each_get_a_reason_and_the_rest_loads(tmp_path: Path) -> None:
    good = pickle.dumps(fr_dump("2.10"), protocol=2)
    (tmp_path / "rank_0.pkl").write_bytes(good)
    (tmp_path / "rank_1.pkl").write_bytes(good[: len(good) // 2])
    (tmp_path / "rank_2.pkl").write_bytes(b"")
    (tmp_path / "rank_3.pkl").write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    (tmp_path / "rank_4.pkl").write_bytes(pickle.dumps({"version": "2.10"}, protocol=2))
    (tmp_path / "rank_5.json").write_text(json.dumps(fr_dump("2.10"))[:300])
    (tmp_path / "rank_6.pkl.gz").write_bytes(gzip.compress(good)[:200])
    (tmp_path / "README.txt").write_text("dumps of the job\n")
    (tmp_path / "manifest.json").write_text('{"job": "x", "ranks": 8}')  # not frtools'.
    (tmp_path / "rank_0.stacks").write_text("Thread 0x1 (most recent call first):\n")
    (tmp_path / "noise.bin").write_bytes(bytes(range(256)))
    trace = load_trace(tmp_path)
    got = {Path(i.path).name: (i.status, i.reason) for i in trace.inputs}
    assert got["rank_0.pkl"] == ("ok", "")
    assert got["rank_1.pkl"] == ("error", "truncated pickle (data ends before the dump does)")
    # an unusable dump still says whose it was, so a report can say why a rank is missing
    assert next(i.rank for i in trace.inputs if i.path.endswith("rank_1.pkl")) == 1
    assert got["rank_2.pkl"] == ("error", "empty file (0 bytes)")
    assert got["rank_3.pkl"] == (
        "error",
        "not a Flight Recorder dump: top level is list, not a dict",
    )
    assert got["rank_4.pkl"][0] == "error" and "no 'entries' key" in got["rank_4.pkl"][1]
    assert got["rank_5.json"][0] == "error" and got["rank_5.json"][1].startswith("truncated JSON")
    assert got["rank_6.pkl.gz"][0] == "error" and "gzip" in got["rank_6.pkl.gz"][1]
    for side in ("README.txt", "manifest.json", "noise.bin"):
        assert got[side][0] == "skipped", (side, got[side])
    # side files of `frtools dump` are applied by the loader: rank 0's stacks are attached
    assert got["rank_0.stacks"] == ("ok", "Python stacks of rank 0")
    assert trace.ranks[0].stacks.startswith("Thread 0x1")
    assert list(trace.ranks) == [0]


@pytest.mark.timeout(30)
def test_malformed_entries_are_skipped_and_counted(tmp_path: Path) -> None:
    dump = fr_dump("2.10")
    dump["entries"][1:1] = ["garbage", {"no_profiling_name": 1}]
    dump["entries"][0]["collective_seq_id"] = "not a number"
    trace = load_trace(write_pickle(tmp_path / "rank_0.pkl", dump))
    note = trace.inputs[0]
    assert note.status == "ok" and "2 malformed entries skipped" in note.reason
    assert trace.entries.column("collective_seq_id").to_pylist() == [None, 2, 3]


@pytest.mark.timeout(30)
def test_gzipped_pickle_and_json_are_read(tmp_path: Path) -> None:
    (tmp_path / "rank_0.pkl.gz").write_bytes(gzip.compress(pickle.dumps(fr_dump("2.10"))))
    (tmp_path / "rank_1.json.gz").write_bytes(gzip.compress(json.dumps(fr_dump("2.10")).encode()))
    trace = load_trace(tmp_path)
    assert {r: i.format for r, i in trace.ranks.items()} == {0: "torch-pickle", 1: "torch-json"}


@pytest.mark.timeout(30)
def test_newest_dump_of_a_rank_wins(tmp_path: Path) -> None:
    old = fr_dump("2.10", n=2)
    new = fr_dump("2.10", n=3)
    write_pickle(tmp_path / "a" / "rank_1.pkl", new)
    write_pickle(tmp_path / "b" / "rank_1.pkl", old)
    trace = load_trace(tmp_path)
    assert trace.ranks[1].source == str(tmp_path / "a" / "rank_1.pkl")
    dup = next(i for i in trace.inputs if i.status == "duplicate")
    assert dup.path == str(tmp_path / "b" / "rank_1.pkl")
    assert dup.reason == f"older dump of rank 1; using {tmp_path / 'a' / 'rank_1.pkl'}"
    assert trace.entries.num_rows == 3


@pytest.mark.timeout(30)
def test_nothing_usable_raises_unusable_input(tmp_path: Path) -> None:
    with pytest.raises(UnusableInput, match="no such file or directory"):
        load_trace(tmp_path / "nope")
    (tmp_path / "rank_0.pkl").write_bytes(b"")
    with pytest.raises(UnusableInput, match=r"no usable Flight Recorder dump among 1 file; "):
        load_trace(tmp_path)


@pytest.mark.timeout(60)
def test_worker_processes_give_the_same_trace(tmp_path: Path) -> None:
    for r in range(6):
        write_pickle(tmp_path / f"rank_{r}.pkl", fr_dump("2.10", n=5, world=6))
    serial = load_trace(tmp_path, workers=1)
    parallel = load_trace(tmp_path, workers=2, progress=True)
    assert parallel.entries.equals(serial.entries)
    assert [i.to_dict() for i in parallel.inputs] == [i.to_dict() for i in serial.inputs]


@pytest.mark.timeout(30)
def test_a_few_large_files_are_read_by_worker_processes(tmp_path: Path) -> None:
    """Many files, or a few whose bytes are worth a worker each (merged fleet partials of
    ~30 MB); a single file or a few small ones stay in-process."""
    from frtools.analyze.readers.parallel import PARALLEL_MIN_BYTES, _worth_workers

    def sized(name: str, size: int) -> Path:
        path = tmp_path / name
        with open(path, "wb") as f:
            f.truncate(size)  # sparse: the size is what counts
        return path

    big = [sized(f"p{i}.summary", PARALLEL_MIN_BYTES // 2) for i in range(2)]
    assert _worth_workers(big)
    assert not _worth_workers(big[:1] + [sized("small", 1024)])
    assert not _worth_workers([sized("huge", 4 * PARALLEL_MIN_BYTES)])  # one file: no split
    assert _worth_workers([sized(f"r{i}", 10) for i in range(65)])
    assert not _worth_workers(big[:1] + [tmp_path / "gone"])  # unreadable: its reader says


@pytest.mark.timeout(60)
def test_the_spool_of_a_killed_analysis_is_removed_by_the_next(tmp_path: Path) -> None:
    import subprocess
    import sys

    from frtools.analyze.readers import loader

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"frtools-read-{int(gone.stdout)}-abc"
    stale.mkdir()
    (stale / "t.arrow").write_bytes(b"x" * 100)
    mine = tmp_path / f"frtools-read-{os.getpid()}-def"
    mine.mkdir()
    loader._remove_stale_spools(str(tmp_path))
    assert not stale.exists()  # its process is gone: removed
    assert mine.exists()  # a live analysis keeps its spool


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_spool_its_table_hands_it_over_by_pipe(tmp_path: Path) -> None:
    from frtools.analyze.readers.loader import _read_chunk_to_spool

    path = tmp_path / "rank_0.pkl"
    write_pickle(path, fr_dump("2.10", n=5, world=2))
    serial = load_trace(tmp_path, workers=1)
    # a spool directory that cannot take the file (full or gone): the table stays in-band
    (result,), table_path, _ = _read_chunk_to_spool(([str(path)], str(tmp_path / "gone")))
    assert table_path is None
    assert result.dump is not None and result.dump.entries.equals(serial.entries)
    # and one that can: the file is written, the in-band table dropped
    spool = tmp_path / "spool"
    spool.mkdir()
    (result,), table_path, rows = _read_chunk_to_spool(([str(path)], str(spool)))
    assert table_path is not None and Path(table_path).parent == spool
    assert result.dump is not None and result.dump.entries is None and rows == [[(0, 5)]]


@pytest.mark.timeout(30)
def test_a_spool_file_leaves_its_constant_columns_to_the_parent(tmp_path: Path) -> None:
    """A worker's table goes to the spool without the columns that hold one value in every
    row (nulls, or one int or bool): the parent puts them back as slices of one array per
    value, which every chunk shares, and the table is the worker's, dictionaries and
    schema included."""
    import pyarrow as pa

    from frtools.analyze.readers.parallel import _spool_table, _unspool

    n = 1000
    table = pa.table(
        {
            "varies": pa.array(range(n), pa.int64()),
            "zero": pa.array([0] * n, pa.int64()),
            "flag": pa.array([False] * n),
            "none": pa.nulls(n, pa.int64()),
            # all null, over a dictionary of two values, which it keeps
            "codes": pa.DictionaryArray.from_arrays(pa.nulls(n, pa.int32()), ["x", "y"]),
            "splits": pa.nulls(n, pa.list_(pa.int64())),
            "text": pa.DictionaryArray.from_arrays(pa.array([i % 2 for i in range(n)]), ["a", "b"]),
            "nearly": pa.array([None] + [1] * (n - 1), pa.int64()),
        }
    )
    table = table.cast(table.schema.with_metadata({"k": "v"}))
    runs: dict = {}
    back = []
    for k in range(2):
        path = tmp_path / f"{k}.arrow"
        with open(path, "wb") as f:
            _spool_table(table.slice(0, n - k), f)
        assert pa.ipc.open_file(path).read_all().column_names == ["varies", "text", "nearly"]
        back.append(_unspool(str(path), runs))
        assert not path.exists()  # the mapping holds the pages
    assert back[0].equals(table) and back[1].equals(table.slice(0, n - 1))
    assert back[0].schema.equals(table.schema, check_metadata=True)
    assert back[1]["codes"].chunk(0).dictionary.to_pylist() == ["x", "y"]
    for name in ("zero", "flag", "none"):  # one array per value, which both slice
        first, second = (b[name].chunk(0).buffers()[-1] for b in back)
        assert first.address == second.address
    # a table whose every column is constant keeps its rows; an all-null column over a big
    # dictionary stays in the file (its dictionary is not copied into the metadata)
    constant = table.select(["zero", "flag", "none"])
    big = pa.DictionaryArray.from_arrays(pa.nulls(n, pa.int32()), [str(i) for i in range(2000)])
    for kept, spooled in ((constant, []), (pa.table({"big": big}), ["big"])):
        path = tmp_path / "all.arrow"
        with open(path, "wb") as f:
            _spool_table(kept, f)
        assert pa.ipc.open_file(path).read_all().column_names == spooled
        assert _unspool(str(path), runs).equals(kept)
    # an empty table, or an IPC file of the plain table, reads back as it is
    for kept, path in ((table.slice(0, 0), tmp_path / "empty"), (table, tmp_path / "plain")):
        with open(path, "wb") as f:
            if path.name == "empty":
                _spool_table(kept, f)
            else:
                with pa.ipc.new_file(f, kept.schema) as w:
                    w.write_table(kept)
        assert _unspool(str(path)).equals(kept)


@pytest.mark.timeout(30)
def test_analyzer_side_imports_without_torch(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from frtools.analyze.readers import load_trace\n"
        f"print(len(load_trace({str(write_pickle(tmp_path / 'rank_0.pkl', fr_dump('2.10')))!r}).ranks))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


@pytest.mark.timeout(60)
def test_garbage_anywhere_in_a_dump_never_escapes_as_an_exception(tmp_path: Path) -> None:
    import random

    rnd = random.Random(0)
    junk = [None, "x", -1, 2**70, 1.5, float("nan"), [], {}, [[1, "a"]], {"a": 1}, ("t",), True]
    path = tmp_path / "rank_0.pkl"
    statuses = set()
    for _ in range(300):
        dump = fr_dump(rnd.choice(VERSIONS), n=4)
        for _ in range(rnd.randint(1, 4)):
            if rnd.random() < 0.3:
                dump[rnd.choice([*dump, "pg_status", "pg_config", "rank"])] = rnd.choice(junk)
            elif isinstance(dump.get("entries"), list) and dump["entries"]:
                e = rnd.choice(dump["entries"])
                if isinstance(e, dict):
                    e[rnd.choice([*e, "frames", "process_group"])] = rnd.choice(junk)
        path.write_bytes(pickle.dumps(dump, protocol=2))
        result = read_file(path)  # must not raise
        statuses.add(result.input.status)
        if result.input.status == "error":
            assert "reader failed" not in result.input.reason, result.input.reason
    assert statuses == {"ok", "error"}


@pytest.mark.timeout(30)
def test_files_disagreeing_on_membership_are_noted(tmp_path: Path) -> None:
    for r in range(3):
        write_pickle(tmp_path / f"rank_{r}.pkl", fr_dump("2.10", world=3 if r != 2 else 4))
    trace = load_trace(tmp_path)
    assert trace.process_groups["0"].ranks == (0, 1, 2) and trace.world_size == 3
    odd = next(i for i in trace.inputs if i.path.endswith("rank_2.pkl"))
    assert odd.status == "ok"
    assert (
        odd.reason
        == "lists process group 0 as [0, 1, 2, 3]; other files as [0, 1, 2], which is used"
    )


@pytest.mark.timeout(120)
def test_manifest_world_size_reveals_a_missing_last_gloo_rank(
    gloo_dumps: Path, tmp_path: Path
) -> None:
    # Gloo dumps do not say how many ranks the job had: without rank 3's file the loader
    # could only guess 3; the manifest of `frtools dump` knows 4
    for r in (0, 1, 2):
        (tmp_path / f"rank_{r}.pkl").write_bytes(
            (gloo_dumps / "pkl" / f"rank_{r}.pkl").read_bytes()
        )
    assert load_trace(tmp_path).world_size == 3
    manifest = {"kind": "frtools-dump-manifest", "world_size": 4, "ranks": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    trace = load_trace(tmp_path)
    assert trace.world_size == 4 and trace.missing_ranks == [3]
    assert trace.process_groups["0"].ranks == (0, 1, 2, 3)


@pytest.mark.timeout(30)
def test_pg_status_keyed_by_uid_is_named_even_after_the_buffer_dropped_the_group(
    tmp_path: Path,
) -> None:
    # Gloo numbering: uid 1 is this rank's second group, named "4"; the buffer kept only
    # ops of group "4", so uid 0 (always the default group "0") and uid 2 have no entry
    dump = fr_dump("2.10", n=0)
    dump["entries"] = [fr_entry("2.10", 7, pg_id=1, process_group=("4", "dp"))]
    dump["pg_status"] = {
        "0": {
            "last_enqueued_collective": 2,
            "last_started_collective": -1,
            "last_completed_collective": 2,
        },
        "1": {
            "last_enqueued_collective": 8,
            "last_started_collective": -1,
            "last_completed_collective": 8,
        },
        "2": {
            "last_enqueued_collective": 5,
            "last_started_collective": -1,
            "last_completed_collective": 5,
        },
    }
    trace = load_trace(write_pickle(tmp_path / "rank_1.pkl", dump))
    assert trace.ranks[1].pg_status == {
        "0": {"last_enqueued_collective": 2, "last_completed_collective": 2},
        "4": {"last_enqueued_collective": 8, "last_completed_collective": 8},
        "pg_id:2": {"last_enqueued_collective": 5, "last_completed_collective": 5},
    }


@pytest.mark.timeout(60)
def test_cli_says_in_one_line_why_a_directory_is_unusable(tmp_path: Path) -> None:
    import subprocess

    (tmp_path / "rank_0.pkl").write_bytes(b"")
    out = subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"frtools: error: {tmp_path}: no usable Flight Recorder dump among 1 file; "
        f"e.g. {tmp_path / 'rank_0.pkl'}: empty file (0 bytes)"
    ]


@pytest.mark.timeout(30)
def test_default_group_written_as_all_ranks_is_known_not_inferred(tmp_path: Path) -> None:
    for r in (0, 1, 2, 3, 5):
        dump = fr_dump("2.10")
        dump["pg_config"]["0"]["ranks"] = "all"
        write_pickle(tmp_path / f"rank_{r}.pkl", dump)
    trace = load_trace(tmp_path)
    g = trace.process_groups["0"]
    assert (g.ranks, g.inferred) == ((0, 1, 2, 3, 4, 5), False)
    assert trace.missing_ranks == [4]


@pytest.mark.timeout(30)
def test_deeply_nested_json_is_refused_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "rank_0.json").write_text('{"entries": ' + "[" * 200_000 + "]" * 200_000 + "}")
    result = read_file(tmp_path / "rank_0.json")
    assert result.input.status == "error"
    assert result.input.reason == "JSON nests too deeply to be a dump; refused"


@pytest.mark.timeout(30)
def test_dump_without_collectives_still_gives_the_rank_and_its_group_status(
    tmp_path: Path,
) -> None:
    dump = fr_dump("2.10")
    del dump["entries"]  # _dump_fr_trace(includeCollectives=False)
    write_pickle(tmp_path / "rank_2.pkl", dump)
    write_pickle(tmp_path / "rank_0.pkl", fr_dump("2.10"))
    trace = load_trace(tmp_path)
    assert trace.ranks[2].pg_status["0"]["last_completed_collective"] == 3
    note = next(i for i in trace.inputs if i.path.endswith("rank_2.pkl"))
    assert note.status == "ok" and "includeCollectives=False" in note.reason


# --- torch 2.15: hook recorder names, Gloo's placeholder pg_config -------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("profiling_name", "op"),
    [
        ("nccl2:all_reduce", "all_reduce"),  # nccl2 through c10d's FlightRecorderHook
        ("c10d:all_to_all", "all_to_all"),  # the hook's fallback prefix
        ("gloo:reduce_scatter", "reduce_scatter"),
        ("nccl2:send 0->1", "send"),
    ],
)
def test_torch_2_15_op_names_read_as_the_op(profiling_name: str, op: str, tmp_path: Path) -> None:
    dump = fr_dump("2.10", n=1)
    dump["entries"][0]["profiling_name"] = profiling_name
    rows = load_trace(write_pickle(tmp_path / "rank_0.pkl", dump)).entries.to_pylist()
    assert rows[0]["op"] == op and rows[0]["profiling_name"] == profiling_name


@pytest.mark.timeout(30)
def test_torch_2_15_gloo_placeholder_membership_is_not_believed(tmp_path: Path) -> None:
    """torch 2.15's Gloo dumps carry ``{'': {'ranks': '[0, 1]'}}`` on every rank of any world
    (2.13 wrote '[]'): a nameless placeholder, never a group's membership."""
    for rank in range(4):
        dump = fr_dump("2.10", n=2)
        dump["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}
        write_pickle(tmp_path / f"rank_{rank}.pkl", dump)
    trace = load_trace(tmp_path)
    assert "" not in trace.process_groups
    world = trace.process_groups["0"]
    assert world.inferred and world.ranks == (0, 1, 2, 3)


def _recorder_files(root: Path, rank: int, tp_ops: int) -> None:
    """One rank as ``frtools dump --torch-sockets`` collects it from torch 2.15 on mixed
    groups: Gloo's recorder (world group), the nccl2 recorder c10d's hook fills (its
    tensor-parallel group), and ProcessGroupNCCL's, empty."""
    world = fr_dump("2.10", n=3)
    world["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}  # 2.15 Gloo
    for e in world["entries"]:
        e["profiling_name"] = "gloo:all_reduce"
    (root / f"rank_{rank}.json").write_text(json.dumps(world))
    tp_name = "1" if rank < 2 else "2"
    tp = fr_dump("2.10", n=tp_ops)
    tp["pg_config"] = {
        tp_name: {"name": tp_name, "desc": "tensor_parallel", "ranks": str([rank & ~1, rank | 1])}
    }
    for e in tp["entries"]:
        e.update(profiling_name="nccl2:all_gather", pg_id=1, process_group=(tp_name, "tp"))
        e["time_created_ns"] += 10_000
    if tp["entries"]:
        tp["entries"][-1].update(state="started", retired=False)
    (root / f"rank_{rank}.nccl2.json").write_text(json.dumps(tp))
    empty = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}
    write_pickle(root / f"rank_{rank}.pkl", empty)


@pytest.mark.timeout(30)
def test_records_of_one_rank_from_several_recorders_are_merged(tmp_path: Path) -> None:
    for rank in range(4):
        _recorder_files(tmp_path, rank, tp_ops=2 if rank == 3 else 3)
    trace = load_trace(tmp_path)
    rows = trace.entries.to_pylist()
    assert {(r["rank"], r["pg_name"]) for r in rows} == {
        (r, g) for r in range(4) for g in ("0", "1" if r < 2 else "2")
    }
    assert len(rows) == 4 * 3 + 3 * 3 + 2
    assert trace.process_groups["2"].ranks == (2, 3) and not trace.process_groups["2"].inferred
    by_path = {Path(i.path).name: i for i in trace.inputs}
    kept = Path(trace.ranks[3].source).name  # the newest: nccl2's
    other = ({"rank_3.json", "rank_3.nccl2.json"} - {kept}).pop()
    assert by_path[kept].status == by_path[other].status == "ok"
    assert by_path[other].reason == f"another recorder of rank 3, merged with {tmp_path / kept}"
    assert by_path["rank_3.pkl"].status == "duplicate"
    assert "nothing beyond the other record of rank 3" in by_path["rank_3.pkl"].reason

    from frtools.analyze.diagnose import diagnose

    verdict = diagnose(trace)
    assert verdict.kind == "missing", verdict.headline
    assert [g.rank for g in verdict.guilty] == [3] and verdict.process_group.name == "2"
