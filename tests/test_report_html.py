"""``frtools report``: one self-contained HTML file, the verdict first, maps of every
group's progress and every rank's last ops, stacks, inputs; small at thousands of ranks.
(The page as a browser draws it is tested in test_report_browser.py.)"""

from __future__ import annotations

import base64
import hashlib
import html as html_text
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trace_builder import STOP, megatron8, simulate, training

from frtools.analyze.align import align
from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import load_trace
from frtools.analyze.reporters import html, views
from frtools.model.trace import InputFile

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_dumps"
JOB = megatron8()


def _stop(rank, step):
    def fault(r, s, ops):
        return [STOP] if (r, s) == (rank, step) else ops

    return fault


def _render(trace, **kw):
    alignment = align(trace)
    verdict = diagnose(trace, alignment)
    return verdict, html.render(verdict, trace, alignment, **kw)


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="frtools-data">(.*?)</script>', page, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))


def frtools(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frtools", *args], capture_output=True, text=True, timeout=250
    )


def test_page_is_self_contained_and_forbids_every_request():
    trace = simulate(JOB, training(JOB, 2, _stop(5, 1)))
    _, page = _render(trace)
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    assert csp and "default-src &#x27;none&#x27;" in csp.group(1)
    # the one inline script runs by its hash, never by 'unsafe-inline'
    policy = html_text.unescape(csp.group(1))
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in policy
    assert "'unsafe-inline'" not in policy.split("script-src", 1)[1].split(";")[0]
    # nothing fetched: no external src/href, stylesheet, import or font
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<link" not in page and "@import" not in page and "@font-face" not in page
    assert not re.search(r"url\(\s*['\"]?(?!data:)", page)
    assert re.findall(r"<script[^>]*\ssrc=", page) == []
    _data(page)  # the embedded data parses


def test_verdict_comes_first_with_the_guilty_rank_and_its_call_site():
    trace = simulate(JOB, training(JOB, 2, _stop(5, 1)))
    verdict, page = _render(trace, source="dumps/")
    body = page[page.index("<main>") :]
    first = body[: body.index("</section>")]
    assert 'id="verdict"' in first
    assert f">{verdict.headline}<" in first
    assert '<td class="rank">5</td>' in first and "node1" in first
    assert "train.py:" in first  # where rank 5 stands
    assert "waiting (7): <span>0-4,6-7</span>" in first
    order = [body.index(f'id="{s}"') for s in ("verdict", "map", "timeline", "inputs")]
    assert order == sorted(order)


def test_progress_map_marks_the_group_members_behind_and_waiting():
    trace = simulate(JOB, training(JOB, 2, _stop(5, 1)))
    alignment = align(trace)
    pmap = views.progress_map(trace, alignment)
    tp = {g.name: g for g in pmap.groups}["tp2"]  # ranks 4, 5: rank 5 stopped
    states = dict(zip(tp.members, tp.states, strict=True))
    assert states[5] == views.BEHIND and states[4] == views.PENDING
    assert tp.latest == 3 and tp.last_issued == [3, 2]
    assert {r.desc for r in pmap.rows} >= {"default_pg"}
    # each row holds groups of one kind whose members do not overlap
    for row in pmap.rows:
        seen: list[int] = []
        for i in row.groups:
            seen += list(pmap.groups[i].members)
        assert len(seen) == len(set(seen))


def test_timeline_slices_end_at_completion_or_stay_open_to_the_dump():
    trace = simulate(JOB, training(JOB, 2, _stop(5, 1)), completion="nccl")
    alignment = align(trace)
    verdict = diagnose(trace, alignment)
    point = views.hang_point(trace, alignment, verdict)
    ops = views.recent_ops(trace, alignment, 3, point.end_ns)
    assert ops.groupby("rank").size().max() == 3
    done = ops[ops["completion"] == views.COMPLETED]
    assert len(done) and done["end_known"].all()
    assert (done["end_ns"] == done["time_completed_ns"]).all()
    pending = ops[ops["completion"] == views.NOT_COMPLETED]
    assert len(pending) and (pending["end_ns"] == point.end_ns).all()
    assert point.hang_ns is not None and point.hang_ns <= point.end_ns


def test_inputs_and_stacks_sections_list_what_a_person_needs():
    trace = simulate(JOB, training(JOB, 2, _stop(5, 1)))
    alignment = align(trace)
    verdict = diagnose(trace, alignment)
    verdict.inputs = [
        InputFile("d/rank_0.pkl", "ok", rank=0, format="torch-pickle"),
        InputFile("d/rank_1.pkl", "error", "truncated pickle (EOF at byte 812)", 1),
        InputFile("d/notes.txt", "skipped", "not a dump"),
    ]
    page = html.render(verdict, trace, alignment)
    inputs = page[page.index('id="inputs"') :]
    assert "1 file(s) used (1 torch-pickle); 2 not used." in inputs
    assert "<code>d/rank_1.pkl</code></td><td>error</td><td>1</td>" in inputs
    assert "truncated pickle (EOF at byte 812)" in inputs

    trace = load_trace(SAMPLES / "missing-stacks")
    _, page = _render(trace)
    stacks = page[page.index('id="stacks"') :]
    assert "rank 1 main thread" in stacks and "faulty_job.py:212 in stall" in stacks
    assert stacks.count('class="outlier"') >= 1


def test_straggler_report_shows_per_rank_lateness():
    trace = simulate(JOB, training(JOB, 4), delay_ms={6: 40})
    verdict, page = _render(trace)
    assert verdict.kind == "straggler"
    late = _data(page)["lateness"]
    worst = late["ranks"][late["median"].index(max(late["median"]))]
    assert worst == 6 and max(late["median"]) > 20
    assert 'id="lateness"' in page and "<tr class=guilty-row><td>6</td>" in page


def test_healthy_report_says_so():
    _, page = _render(simulate(JOB, training(JOB, 2)))
    assert '<body class="kind-healthy"' in page
    assert "Every group is in step" in page


def test_a_record_without_ops_still_gives_a_page_and_a_trace():
    import io

    from frtools.analyze.reporters import trace_events
    from frtools.model.trace import ProcessGroup, RankInfo, Trace, entries_table

    trace = Trace(
        entries=entries_table([]),
        ranks={0: RankInfo(0), 1: RankInfo(1)},
        process_groups={"0": ProcessGroup("0", "default_pg", (0, 1))},
        world_size=2,
    )
    verdict, page = _render(trace)
    assert _data(page)["timeline"]["ops"] is None
    buf = io.StringIO()
    assert trace_events.write(buf, verdict, trace, align(trace)) == 0
    assert json.loads(buf.getvalue())["traceEvents"][-1]["name"].startswith("verdict: ")


@pytest.mark.parametrize("case", sorted(p.name for p in SAMPLES.iterdir() if p.is_dir()))
def test_report_and_timeline_work_on_every_sample(case, tmp_path):
    """Exit codes as ``analyze``; the page and the trace file are written and readable."""
    expected = 0 if case == "healthy" or case.endswith("-healthy") else 1  # sample_dumps/README
    report = frtools("report", str(SAMPLES / case), "-o", str(tmp_path / "r.html"))
    assert report.returncode == expected, report.stderr
    page = (tmp_path / "r.html").read_text()
    assert _data(page)["kind"] == ("healthy" if expected == 0 else _data(page)["kind"])
    assert report.stderr.startswith(f"{tmp_path / 'r.html'} (")
    timeline = frtools("timeline", str(SAMPLES / case), "-o", str(tmp_path / "t.json"))
    assert timeline.returncode == expected, timeline.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert any(e["ph"] == "X" for e in doc["traceEvents"])


def test_report_exit_2_on_unusable_input(tmp_path):
    p = frtools("report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"frtools report: error: {tmp_path / 'nope'}: no such file or directory"
    ]
    assert not (tmp_path / "r.html").exists()


def test_report_to_stdout():
    p = frtools("report", str(SAMPLES / "missing"), "-o", "-")
    assert p.returncode == 1
    assert p.stdout.startswith("<!DOCTYPE html>") and p.stdout.rstrip().endswith("</html>")


@pytest.mark.slow
def test_report_of_a_thousand_ranks_stays_small(tmp_path):
    """At scale every rank keeps a few ops, the groups go as columns: the file stays well
    under a megabyte per thousand ranks."""
    from frtools.synth import synthesize

    synthesize(tmp_path / "job", 1024, tp=8, pp=4, fault="missing", buffer_size=300, seed=1)
    p = frtools("report", str(tmp_path / "job"), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 1, p.stderr
    size = (tmp_path / "r.html").stat().st_size
    assert size < 1_500_000, size
    data = _data((tmp_path / "r.html").read_text())
    assert data["ranks"] == {"n": 1024}
    assert len(data["timeline"]["ops"]["r"]) <= html.OPS_BUDGET + html.FOCUS_RANKS * html.FOCUS_OPS
    truth = json.loads((tmp_path / "job" / "truth.json").read_text())
    assert [i for i, c in enumerate(data["roles"]) if c == "g"] == truth["guilty"]
