"""`python -m frtools analyze` as a user runs it: exit codes 0/1/2, one-line errors, formats.

Dumps are PyTorch Flight Recorder 2.10 pickles (Gloo shape) written from small simulated jobs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from trace_builder import STOP, megatron8, simulate, training, write_fr_pickles

# generous: on a loaded 2-core CI machine one `frtools analyze` (imports included) can take
# tens of seconds, and some tests run it three times
pytestmark = pytest.mark.timeout(300)

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "verdict.schema.json").read_text())
JOB = megatron8()


def analyze(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dumps")

    def stop5(r, s, ops):
        return [STOP] if (r, s) == (5, 1) else ops

    healthy = root / "healthy"
    write_fr_pickles(simulate(JOB, training(JOB, 2)), healthy)
    hang = root / "hang"
    write_fr_pickles(simulate(JOB, training(JOB, 2, stop5)), hang)
    damaged = root / "damaged"
    write_fr_pickles(simulate(JOB, training(JOB, 2, stop5)), damaged, skip=(6,))
    data = (damaged / "rank_0.pkl").read_bytes()
    (damaged / "rank_0.pkl").write_bytes(data[: len(data) // 2])
    (damaged / "notes.txt").write_text("not a dump\n")
    empty = root / "empty"
    empty.mkdir()
    junk = root / "junk"
    junk.mkdir()
    (junk / "rank_0.pkl").write_bytes(b"\x80\x04garbage")
    return {"healthy": healthy, "hang": hang, "damaged": damaged, "empty": empty, "junk": junk}


def test_healthy_job_exits_0(dumps):
    p = analyze(str(dumps["healthy"]))
    assert p.returncode == 0, p.stderr
    assert "HEALTHY" in p.stdout.splitlines()[0]
    assert p.stderr == ""


def test_hang_exits_1_and_names_the_guilty_rank_first(dumps):
    p = analyze(str(dumps["hang"]))
    assert p.returncode == 1, p.stderr
    first = p.stdout.splitlines()[0]
    assert "MISSING" in first and "Rank 5" in first


def test_a_reader_that_leaves_the_pipe_is_not_an_error(dumps):
    """`frtools analyze DIR --format json | head -0`: exit 0 and no traceback, also now that
    the command's own process ends at once after the verdict (exit_at_once)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "frtools", "analyze", str(dumps["hang"]), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the verdict is written
    try:
        _, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert b"Traceback" not in err and b"Exception ignored" not in err


def test_json_output_is_valid_and_says_who(dumps):
    p = analyze(str(dumps["hang"]), "--format", "json")
    assert p.returncode == 1
    doc = json.loads(p.stdout)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    assert doc["verdict"]["kind"] == "missing"
    assert [g["rank"] for g in doc["verdict"]["guilty"]] == [5]
    assert doc["verdict"]["process_group"]["ranks"] == [4, 5]
    assert doc["verdict"]["guilty"][0]["call_site"].startswith("train.py:")


def test_output_file_and_markdown(dumps, tmp_path):
    out = tmp_path / "summary.md"
    p = analyze(str(dumps["hang"]), "--format", "markdown", "-o", str(out))
    assert p.returncode == 1 and p.stdout == ""
    assert out.read_text().startswith("## ❌ frtools: `missing`")


def test_damaged_inputs_still_give_a_verdict_and_are_listed(dumps):
    p = analyze(str(dumps["damaged"]), "--format", "json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert [g["rank"] for g in doc["verdict"]["guilty"]] == [5]
    status = {Path(i["path"]).name: i["status"] for i in doc["inputs"]}
    assert status["rank_0.pkl"] == "error"
    assert status["notes.txt"] == "skipped"
    assert 6 in doc["ranks"]["missing"]
    text = analyze(str(dumps["damaged"])).stdout
    assert "Inputs" in text and "rank_0.pkl" in text


@pytest.mark.parametrize(
    ("case", "needle"),
    [("missing", "no such file"), ("empty", ""), ("junk", "")],
)
def test_unusable_input_exits_2_with_one_line(dumps, tmp_path, case, needle):
    path = tmp_path / "nope" if case == "missing" else dumps[case]
    p = analyze(str(path))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("frtools: error:")
    assert needle in lines[0]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args", [["--format", "html", "DIR"], ["--workers", "0", "DIR"], []])
def test_usage_errors_exit_2_with_one_line(dumps, args):
    p = analyze(*[str(dumps["healthy"]) if a == "DIR" else a for a in args])
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("frtools analyze: error:")


def test_unwritable_output_is_one_line(dumps, tmp_path):
    p = analyze(str(dumps["hang"]), "-o", str(tmp_path / "no" / "dir" / "x.txt"))
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1
    assert "cannot write" in p.stderr


def test_analyze_runs_without_torch(dumps):
    # A CI runner that only reads dumps has no torch: importing it must fail loudly here.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from frtools.cli import main\n"
        f"main(['analyze', {str(dumps['hang'])!r}, '--format', 'json'])\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["verdict"]["kind"] == "missing"


SAMPLES = Path(__file__).parent.parent / "sample_dumps"


def test_report_shows_where_the_guilty_rank_stands_and_groups_all_stacks():
    """A real Gloo hang whose ranks left faulthandler stacks: the terminal report shows the
    guilty rank's main-thread frames (user code first) and marks its stack as an outlier;
    the JSON carries the same under the schema's ``stacks``."""
    terminal = analyze(str(SAMPLES / "missing-stacks"))
    assert terminal.returncode == 1, terminal.stderr
    text = terminal.stdout
    stacks = text[text.index("Stacks") :]
    assert "rank 1 main thread:" in stacks
    assert "faulty_job.py:212 in stall" in stacks.splitlines()[2]
    outliers = [line for line in stacks.splitlines() if "<- outlier" in line]
    assert any(" 1  " in line and "in stall" in line for line in outliers), stacks

    report = analyze(str(SAMPLES / "missing-stacks"), "--format", "json")
    doc = json.loads(report.stdout)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    assert [g["rank"] for g in doc["stacks"]["guilty"]] == [1]
    assert doc["stacks"]["guilty"][0]["user_frames"][0]["name"] == "stall"
    stall_group = [g for g in doc["stacks"]["groups"] if g["ranks"] == [1]]
    assert stall_group and stall_group[0]["outlier"] is True


def test_world_size_reveals_a_dead_highest_rank(tmp_path):
    """Gloo dumps do not state the world size: with the highest rank's dump lost, the
    survivors look like a whole job. ``--world-size`` names the lost rank as dead."""
    src = SAMPLES / "missing"  # rank 1 hung in compute; 0, 2, 3 wait in the world all_reduce
    # keep the three waiting ranks as ranks 0-2 of the world group; the hung one is lost
    for new, old in ((0, 0), (1, 3), (2, 2)):
        (tmp_path / f"rank_{new}.pkl").write_bytes((src / f"rank_{old}.pkl").read_bytes())

    # Without it, the groups shorter than their siblings (tensor-/data-parallel) still show
    # that a rank is missing: the survivors do not read as a whole, healthy job.
    blind = json.loads(analyze(str(tmp_path), "--format", "json").stdout)
    assert blind["verdict"]["kind"] != "healthy"
    assert blind["ranks"]["expected"] == 4

    told = analyze(str(tmp_path), "--format", "json", "--world-size", "4")
    assert told.returncode == 1, told.stderr
    doc = json.loads(told.stdout)
    assert doc["verdict"]["kind"] == "dead"
    assert [g["rank"] for g in doc["verdict"]["guilty"]] == [3]
    assert doc["verdict"]["waiting"] == [0, 1, 2]
    assert doc["ranks"]["missing"] == [3]

    too_small = analyze(str(tmp_path), "--world-size", "2")
    assert too_small.returncode == 2
    assert too_small.stderr.count("\n") == 1 and "rank 2" in too_small.stderr


def test_a_peer_that_lags_in_noticing_a_finished_collective_is_not_blamed(tmp_path):
    """Real Gloo race: rank 2 died; survivor rank 1 dumped a moment before Gloo's callback
    marked its finished data-parallel all_reduce retired, while its peer rank 3 shows it
    done. Rank 1 only lags in noticing: the verdict still blames rank 2 alone."""
    import pickle

    for f in (SAMPLES / "dead").glob("rank_*.pkl"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    dump = pickle.loads((tmp_path / "rank_1.pkl").read_bytes())  # our own sample file
    last_dp = [e for e in dump["entries"] if e["process_group"][0] == "4"][-1]
    last_dp["retired"] = False
    (tmp_path / "rank_1.pkl").write_bytes(pickle.dumps(dump))

    doc = json.loads(analyze(str(tmp_path), "--format", "json").stdout)
    assert doc["verdict"]["kind"] == "dead"
    assert [g["rank"] for g in doc["verdict"]["guilty"]] == [2]
    assert doc["verdict"]["waiting"] == [0, 1, 3]
