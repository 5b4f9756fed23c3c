"""The HTML report in a real browser (headless Chromium): the verdict is in the rendered
DOM, the scripts drew the maps without an error and answer a hover and a click, a
screenshot shows a page, and the page made no network request."""

from __future__ import annotations

import html as html_text
import json
import re
from pathlib import Path

import pytest
from browser import chromium, dump_dom, page_requests, png_size, run, screenshot

from frtools.analyze.align import align
from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import load_trace
from frtools.analyze.reporters import html

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(chromium() is None, reason="needs chromium (apt-get install chromium)"),
]

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"


def _report(case_dir: Path, out: Path) -> tuple[Path, object]:
    trace = load_trace(case_dir)
    alignment = align(trace)
    verdict = diagnose(trace, alignment)
    out.write_text(html.render(verdict, trace, alignment, source=str(case_dir)), encoding="utf-8")
    return out, verdict


def _attr(dom: str, name: str) -> str | None:
    m = re.search(rf"<body[^>]*\s{name}=\"([^\"]*)\"", dom)
    return html_text.unescape(m.group(1)) if m else None


def test_rendered_page_shows_the_verdict_and_made_no_request(tmp_path):
    page, verdict = _report(SAMPLES / "missing-stacks", tmp_path / "report.html")
    netlog = tmp_path / "netlog.json"
    dom = dump_dom(page, tmp_path, netlog=netlog)
    assert _attr(dom, "data-ready") == "1", "the scripts did not finish"
    assert _attr(dom, "data-error") is None, _attr(dom, "data-error")
    headline = re.search(r'<span id="headline">(.*?)</span>', dom).group(1)
    assert html_text.unescape(headline) == verdict.headline
    assert "Rank 1 never issued all_reduce #3" in headline
    # drawn by the scripts: the zoom on the verdict's group and the timeline's groupings
    assert "group 0 (default_pg) · 4 member(s) · latest collective seq 3" in dom
    assert re.search(r'<select id="tl-group"><option value="0"', dom)
    assert page_requests(netlog) == []


def test_hover_and_click_work_in_the_browser(tmp_path):
    """The page opened with ``#frtools-selftest`` hovers the guilty rank on the map and
    on the timeline, clicks its map cell and a timeline group, and says what it saw."""
    page, _ = _report(SAMPLES / "missing", tmp_path / "report.html")
    seen = _selftest(page, tmp_path)
    assert seen["map_tip"].startswith("rank 1 (guilty)"), seen
    assert "never issued the group's latest" in seen["map_tip"]
    assert seen["zoomed"].startswith("group 0 (default_pg)")
    assert re.match(r"rank [01] \((guilty|waiting)\)\n\w+ #\d+ on group \d", seen["slice_tip"]), (
        seen
    )
    before, after = seen["rows_before_after"]
    assert before != after  # a click on a group's row opened or closed it


def _selftest(page: Path, tmp: Path) -> dict:
    p = run(page, tmp, "--dump-dom", fragment="frtools-selftest")
    assert p.returncode == 0, p.stderr[-2000:]
    assert _attr(p.stdout, "data-error") is None, _attr(p.stdout, "data-error")
    return json.loads(_attr(p.stdout, "data-selftest") or "{}")


@pytest.mark.parametrize("case", ["healthy", "dead", "straggler", "order", "missing-wrapped"])
def test_every_kind_of_page_draws_without_a_script_error(case, tmp_path):
    page, verdict = _report(SAMPLES / case, tmp_path / "report.html")
    seen = _selftest(page, tmp_path)  # raises on a script error
    if verdict.guilty_ranks:
        assert seen["map_tip"].startswith(f"rank {verdict.guilty_ranks[0]} (guilty)"), seen


def test_network_check_sees_a_request_when_a_page_makes_one(tmp_path):
    page = tmp_path / "leaky.html"
    page.write_text('<html><body><img src="http://127.0.0.1:9/x.png"></body></html>')
    netlog = tmp_path / "netlog.json"
    dump_dom(page, tmp_path, netlog=netlog)
    assert page_requests(netlog) == ["http://127.0.0.1:9/x.png"]


def test_screenshot_of_the_report(tmp_path):
    page, _ = _report(SAMPLES / "missing-stacks", tmp_path / "report.html")
    shot = tmp_path / "report.png"
    screenshot(page, tmp_path, shot, 1280, 900)
    assert png_size(shot) == (1280, 900)
    assert shot.stat().st_size > 30_000  # a drawn page, not a blank one (~5 kB)


@pytest.mark.slow
def test_a_thousand_rank_report_renders(tmp_path):
    from frtools.synth import synthesize

    synthesize(tmp_path / "job", 1024, tp=8, pp=4, fault="missing", buffer_size=300, seed=1)
    page, verdict = _report(tmp_path / "job", tmp_path / "report.html")
    dom = dump_dom(page, tmp_path)
    assert _attr(dom, "data-ready") == "1" and _attr(dom, "data-error") is None
    selftest = _selftest(page, tmp_path)
    guilty = verdict.guilty_ranks[0]
    assert f"rank {guilty} (guilty)" in selftest["map_tip"], selftest
