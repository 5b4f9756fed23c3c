"""``frtools convert --to torch-pickle``: black boxes that PyTorch's own torchfrtrace reads.

The inputs are real black-box files written by the native BlackBox (4 ranks, explicit ops),
so the test needs no distributed job.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from frtools.recorder.native import load_native

WORLD = 4
STACK = "/work/user/train.py:42 in step\n/work/user/train.py:90 in main"


def write_rank(path: Path, rank: int, n_allreduce: int = 3) -> None:
    native = load_native()
    identity = {"job_id": "conv", "rank": rank, "world_size": WORLD, "host": "h", "pid": 1}
    box = native.BlackBox(str(path), 64, 1 << 16, json.dumps(identity))
    pg = box.add_process_group("0", "default_pg", list(range(WORLD)))
    op = box.intern("gloo:all_reduce")
    sizes, dtypes, stack = box.intern("[[4,2]]"), box.intern("Float"), box.intern(STACK)
    for seq in range(1, n_allreduce + 1):
        rid = box.record(pg, op, seq, 0, -1, False, sizes, sizes, dtypes, dtypes, stack)
        box.mark_completed(rid)
    peer_next, peer_prev = (rank + 1) % WORLD, (rank - 1) % WORLD
    send, recv = box.intern("gloo:send"), box.intern("gloo:recv")
    box.mark_completed(box.record(pg, send, 0, 1, peer_next, True, sizes, sizes, dtypes, dtypes, 0))
    box.mark_completed(box.record(pg, recv, 0, 2, peer_prev, True, sizes, sizes, dtypes, dtypes, 0))
    box.close()


@pytest.fixture(scope="module")
def black_boxes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("boxes") / "job"
    d.mkdir()
    for rank in range(WORLD):
        write_rank(d / f"rank_{rank}.frt", rank)
    return d


def convert(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "frtools",
            "convert",
            str(src),
            "--to",
            "torch-pickle",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(60)
def test_convert_writes_pytorch_2_10_dumps(black_boxes: Path, tmp_path: Path) -> None:
    proc = convert(black_boxes, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"rank_{r}" for r in range(WORLD)
    ]
    dump = pickle.loads((tmp_path / "out" / "rank_1").read_bytes())  # our own output
    assert set(dump) == {"version", "pg_config", "pg_status", "comm_lib_version", "entries"}
    assert dump["version"] == "2.10"
    assert dump["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}
    assert dump["pg_status"]["0"]["last_completed_collective"] == 3
    first = dump["entries"][0]
    assert first["profiling_name"] == "gloo:all_reduce"
    assert first["process_group"] == ("0", "default_pg")
    assert first["input_sizes"] == [[4, 2]] and first["input_dtypes"] == ["Float"]
    assert first["state"] == "completed"
    assert first["frames"][0] == {"name": "step", "filename": "/work/user/train.py", "line": 42}
    names = [e["profiling_name"] for e in dump["entries"]]
    assert names[-2:] == ["gloo:send 1->2", "gloo:recv 1<-0"]


@pytest.mark.timeout(120)
def test_torchfrtrace_reads_converted_files(black_boxes: Path, tmp_path: Path) -> None:
    assert convert(black_boxes, tmp_path / "out").returncode == 0
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(tmp_path / "out"),
            "-p",
            "rank_",
            "-o",
            str(tmp_path / "fr_db.pkl"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "fr_db.pkl").stat().st_size > 0  # it built its database


@pytest.mark.timeout(60)
def test_unreadable_file_is_named_and_the_rest_converted(black_boxes: Path, tmp_path: Path) -> None:
    src = tmp_path / "mixed"
    src.mkdir()
    for rank in range(2):
        (src / f"rank_{rank}.frt").write_bytes((black_boxes / f"rank_{rank}.frt").read_bytes())
    (src / "rank_9.frt").write_bytes(b"not a black box at all")
    proc = convert(src, tmp_path / "out")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank_9.frt" in lines[0], proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank_0", "rank_1"]


@pytest.mark.timeout(60)
def test_directory_without_black_boxes_is_an_error(tmp_path: Path) -> None:
    proc = convert(tmp_path, tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"frtools convert: skipped {tmp_path}: no frtools black-box files (*.frt) found"
    ]
