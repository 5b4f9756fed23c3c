"""A job that restarts in its own processes: destroy_process_group, then a new init.

PyTorch's Flight Recorder keeps one buffer per process, and a new init names its groups
"0", "1", ... again: the dump after the second fault holds the first incarnation's ops too,
under the same group names, with their own uid (``pg_id``) and seqs from 1 again. Read by
name, the first incarnation's unfinished op reads as the hang (or as a mismatch with the
new seqs). These dumps come from a real 3-rank Gloo job on torch, with PyTorch's recorder
and under ``frtools run`` (the black box gives each new instance a row of its own).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from jobs import start_ranks, stop, wait_ranks

from frtools.analyze.readers import load_trace
from frtools.formats.torch_fr.normalize import normalize

# Incarnation 1: rank 2 skips the 4th all_reduce of group 1 (ranks 0 and 1 leave it
# unfinished), and rank 1 an all_reduce of group 2 (ranks 0 and 1), which rank 0 leaves
# unfinished. Every rank destroys its groups and initializes again (a new store), creating
# group 1 again but not group 2. In incarnation 2, rank 0 skips the 3rd all_reduce of the
# new group 1: ranks 1 and 2 wait.
JOB = textwrap.dedent(
    """
    import datetime, os, sys, time, torch, torch.distributed as dist
    out, rank, world = sys.argv[1], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def init(generation):
        store = dist.FileStore(f"{out}/store-{generation}", world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        return dist.new_group(list(range(world)))

    x = torch.ones(4)
    group = init(1)
    pair = dist.new_group([0, 1])
    for _ in range(3):
        dist.all_reduce(x, group=group)
    pending = [dist.all_reduce(x.clone(), group=group, async_op=True)] if rank != 2 else []
    if rank == 0:
        pending.append(dist.all_reduce(x.clone(), group=pair, async_op=True))
    time.sleep(1)
    dist.destroy_process_group()

    group = init(2)
    for _ in range(2):
        dist.all_reduce(x, group=group)
    if rank != 0:
        pending.append(dist.all_reduce(x.clone(), group=group, async_op=True))
    time.sleep(1)
    os.makedirs(f"{out}/pkl", exist_ok=True)
    os.makedirs(f"{out}/json", exist_ok=True)
    with open(f"{out}/pkl/nccl_trace_rank_{rank}", "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    j = torch._C._distributed_c10d._dump_fr_trace_json()
    with open(f"{out}/json/nccl_trace_rank_{rank}.json", "w") as f:
        f.write(j if isinstance(j, str) else j.decode())
    # nobody leaves before the test says so: a rank's exit ends its peers' pending ops
    open(f"{out}/dumped-{rank}", "w").close()
    while not os.path.exists(f"{out}/release"):
        time.sleep(0.05)
    os._exit(0)  # the unfinished ops hold the group: no clean shutdown
    """
)


WORLD = 3


def _run(out: Path, recorder: bool, while_held: Callable[[], None] = lambda: None) -> None:
    """Run the job (under ``frtools run`` with ``recorder``); ``while_held`` runs once every
    rank has dumped and waits, then the ranks are let go."""
    script = out / "job.py"
    script.write_text(JOB)
    argv = [sys.executable, str(script), str(out)]
    if recorder:
        # a pending op is in flight, not hung, until its rank's watchdog calls it stalled
        argv = [sys.executable, "-m", "frtools", "run", "--dir", str(out / "frt"),
                "--job-id", "job", "--stall-seconds", "1", "--", *argv]  # fmt: skip
    procs = start_ranks(argv, WORLD, env={"TORCH_FR_BUFFER_SIZE": "2000"})
    try:
        deadline = time.monotonic() + 90
        while not all((out / f"dumped-{r}").exists() for r in range(WORLD)):
            assert time.monotonic() < deadline, wait_ranks(procs, 1).output()
            assert all(p.poll() is None for p in procs), wait_ranks(procs, 1).output()
            time.sleep(0.1)
        while_held()
        (out / "release").touch()
        result = wait_ranks(procs, 30)
        assert not result.timed_out and all(r.returncode == 0 for r in result.ranks), (
            result.output()
        )
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("restarted")
    _run(out, recorder=False)
    return out


def _analyze(folder: Path, within: float = 0) -> dict:
    """The verdict document of ``frtools analyze``, once it finds the hang (asked again for
    ``within`` seconds: a live rank's watchdog needs a moment to call it stalled)."""
    deadline = time.monotonic() + within
    while True:
        proc = subprocess.run(
            [sys.executable, "-m", "frtools", "analyze", "--format", "json", str(folder)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode not in (0, 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert proc.returncode not in (0, 2), proc.stdout + proc.stderr  # a hang; no error
    return json.loads(proc.stdout)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["pkl", "json"])
def test_after_an_in_process_restart_the_verdict_is_the_new_incarnations(
    restarted: Path, fmt: str
) -> None:
    # the buffers do hold both incarnations under one group name (else this proves nothing)
    raw = pickle.loads((restarted / "pkl" / "nccl_trace_rank_0").read_bytes())
    uids = {e["pg_id"] for e in raw["entries"] if e["process_group"][0] == "1"}
    assert len(uids) == 2, raw["entries"]

    doc = _analyze(restarted / fmt)
    verdict = doc["verdict"]
    assert verdict["kind"] == "missing", verdict["headline"]
    assert [g["rank"] for g in verdict["guilty"]] == [0]
    assert verdict["process_group"]["name"] == "1" and verdict["collective_seq_id"] == 3
    assert sorted(verdict["waiting"]) == [1, 2]
    notes = {i["rank"]: i.get("reason") or "" for i in doc["inputs"]}
    # ranks 0 and 1 left the first incarnation's 4th op unfinished; rank 2 never issued it
    assert "process group 1 was created again in this process" in notes[0]
    assert "4 entries of the destroyed instance left out" in notes[0]
    assert "3 entries of the destroyed instance left out" in notes[2]
    # group 2 was not created again: its unfinished op ended with the first incarnation
    assert "process group 2 ended at an in-process restart" in notes[0], notes[0]


@pytest.mark.timeout(240)
def test_the_black_box_tells_the_instances_apart_by_row(tmp_path: Path) -> None:
    got: dict = {}
    _run(tmp_path, recorder=True, while_held=lambda: got.update(_analyze(tmp_path / "frt", 30)))
    verdict = got["verdict"]
    assert verdict["kind"] == "missing", verdict["headline"]
    assert [g["rank"] for g in verdict["guilty"]] == [0]
    assert verdict["process_group"]["name"] == "1" and verdict["collective_seq_id"] == 3
    # waiting: the ranks whose watchdog called them stalled by then
    assert verdict["waiting"] and set(verdict["waiting"]) <= {1, 2}
    notes = " ".join(i.get("reason") or "" for i in got["inputs"] if i.get("rank") == 1)
    assert "process group 1 was created again in this process (table rows" in notes
    assert "4 entries of the destroyed instance left out" in notes
    notes = " ".join(i.get("reason") or "" for i in got["inputs"] if i.get("rank") == 0)
    assert "process group 2 ended at an in-process restart (every op from table row" in notes


@pytest.mark.timeout(240)
def test_the_destroyed_instance_leaves_neither_entries_nor_counters(restarted: Path) -> None:
    trace = load_trace(restarted / "pkl")
    rows = trace.entries.filter(
        [name == "1" for name in trace.entries.column("pg_name").to_pylist()]
    )
    seqs = {}
    for rank, seq in zip(
        rows.column("rank").to_pylist(), rows.column("collective_seq_id").to_pylist(), strict=True
    ):
        seqs.setdefault(rank, []).append(seq)
    assert seqs == {0: [1, 2], 1: [1, 2, 3], 2: [1, 2, 3]}
    # rank 0's unfinished op on group 2, which the new incarnation did not create again: in
    # its dump, not in the trace, nor its counters
    raw = pickle.loads((restarted / "pkl" / "nccl_trace_rank_0").read_bytes())
    pair = [e for e in raw["entries"] if e["process_group"][0] == "2"]
    assert [e["state"] for e in pair] == ["scheduled"], raw["entries"]
    assert "2" not in set(trace.entries.column("pg_name").to_pylist())
    assert "2" not in trace.ranks[0].pg_status
    raw = pickle.loads((restarted / "pkl" / "nccl_trace_rank_1").read_bytes())
    new_uid = max(e["pg_id"] for e in raw["entries"] if e["process_group"][0] == "1")
    newest = {k: v for k, v in raw["pg_status"][str(new_uid)].items() if v >= 0}
    assert trace.ranks[1].pg_status["1"] == newest, raw["pg_status"]


def _entry(i: int, uid: int, seq: int) -> dict:
    return {
        "record_id": i,
        "pg_id": uid,
        "process_group": ("1", "tp"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "profiling_name": "nccl:all_reduce",
        "state": "completed",
        "is_p2p": False,
    }


def test_two_instances_whose_ops_interleave_are_both_kept() -> None:
    """Two backends of one group (its CPU and its GPU ops) record under one name with two
    uids at once: neither replaced the other."""
    entries = [_entry(i, uid=5 + i % 2, seq=i // 2 + 1) for i in range(6)]
    dump = normalize({"version": "2.10", "entries": entries}, name_rank=0)
    assert dump.entries.num_rows == 6
    assert not any("created again" in n for n in dump.notes)


def test_only_the_newest_of_three_instances_stays() -> None:
    entries = [_entry(0, 1, 1), _entry(1, 1, 2), _entry(2, 4, 1), _entry(3, 9, 1)]
    status = {
        # the first incarnation's default group (uid 0, no entry left): not this one's
        "0": {"last_enqueued_collective": 7, "last_completed_collective": 6},
        "1": {"last_enqueued_collective": 2, "last_completed_collective": 1},
        "4": {"last_enqueued_collective": 1, "last_completed_collective": 0},
        "9": {"last_enqueued_collective": 1, "last_completed_collective": 1},
    }
    dump = normalize({"version": "2.10", "entries": entries, "pg_status": status}, name_rank=0)
    assert dump.entries.column("record_id").to_pylist() == [3]
    assert dump.pg_status == {"1": status["9"]}
    assert any("pg_id 1, 4 then 9): 3 entries" in n for n in dump.notes), dump.notes


@pytest.mark.timeout(60)
def test_a_dump_naming_thousands_of_instances_is_read_in_bounded_time_and_words() -> None:
    """Hostile: 5,000 group names, each created 10 times one after the other."""
    entries = [_entry(i, uid=i, seq=1) for i in range(50_000)]
    for i, e in enumerate(entries):
        e["process_group"] = (str(i // 10), "tp")
    dump = normalize({"version": "2.10", "entries": entries}, name_rank=0)
    assert dump.entries.num_rows == 5_000  # each name's newest instance
    replaced = [n for n in dump.notes if "created again" in n]
    assert len(replaced) == 8 and all(len(n) < 300 for n in replaced), replaced
    assert "pg_id 0, 1, 2, 3 and 5 more then 9): 9 entries" in replaced[0], replaced[0]


REAL_GPU = Path(__file__).resolve().parents[2] / "shared" / "real-gpu" / "nvrx"


def _second_incarnation(folder: Path, keep: int, out: Path, with_first: bool) -> Path:
    """Each rank's dump of ``folder`` as a second incarnation: the last ``keep`` entries of
    its ring under new uids (the new communicators), appended to the whole first one when
    ``with_first`` (what one buffer holds after an in-process restart)."""
    out.mkdir()
    for path in folder.glob("_dump_*"):
        first = pickle.loads(path.read_bytes())
        entries, shift = first["entries"], 1000
        if not entries:  # a rank that recorded nothing (lock_gil_1st's rank 9)
            (out / path.name).write_bytes(path.read_bytes())
            continue
        second = [dict(e, pg_id=e["pg_id"] + shift) for e in entries[-keep:]]
        later = max(e["time_created_ns"] for e in entries) + 10**9
        gap = later - min(e["time_created_ns"] for e in second)
        after = max(e["record_id"] for e in entries) + 1 - second[0]["record_id"]
        for e in second:
            e["time_created_ns"] += gap
            e["record_id"] += after
        status = {str(int(uid) + shift): v for uid, v in first["pg_status"].items()}
        dump = dict(first, entries=second, pg_status=status)
        if with_first:
            dump.update(entries=entries + second, pg_status={**first["pg_status"], **status})
        (out / path.name).write_bytes(pickle.dumps(dump))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["gpu_error_1st", "lock_gil_1st"])
def test_real_gpu_rings_after_a_restart_give_the_second_incarnations_verdict(
    case: str, tmp_path: Path
) -> None:
    """The real Megatron MoE dumps as the first incarnation, with a second one in the same
    buffers whose 6-entry rings hold only a few of the groups again: the first incarnation's
    pending ops on the other groups end with it, and the verdict is the one of the second
    incarnation's dumps alone (before: the first incarnation's GPU stop, or its missing ranks)."""
    if not (REAL_GPU / case).is_dir():
        pytest.skip("the real GPU dumps are not beside this checkout")
    alone = _analyze(_second_incarnation(REAL_GPU / case, 6, tmp_path / "alone", False))
    both = _analyze(_second_incarnation(REAL_GPU / case, 6, tmp_path / "both", True))

    def key(doc: dict) -> tuple:
        v = doc["verdict"]
        return v["kind"], [g["rank"] for g in v["guilty"]], v["process_group"], v["op"]

    assert key(both) == key(alone), (both["verdict"]["headline"], alone["verdict"]["headline"])
    assert any("ended at an in-process restart" in (i.get("reason") or "") for i in both["inputs"])
