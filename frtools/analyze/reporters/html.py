"""The HTML report: one self-contained file a person opens after a hang.

Everything is inside the file (styles, a small vanilla script, the data as JSON); a strict
Content-Security-Policy forbids the page any request, so it reads the same offline, from a
CI artifact or a mail attachment. The answer comes first and is plain HTML (readable with
scripts off); the maps are drawn on canvases from the embedded data:

* the verdict, the guilty ranks (host, device, call site) and who waits;
* a group x rank progress map (last issued / last completed collective per member), rows of
  groups of one kind, ranks binned to the canvas width, a click zooms to one group's members;
* the last ops of every rank as time slices around the hang, grouped by host or by the
  groups of one kind, the guilty and waiting ranks marked;
* stacks grouped with outliers marked, per-rank enqueue lateness for a straggler, and the
  inputs that could not be used.

Sizes stay bounded at thousands of ranks: every rank gets a few of its last ops, the ranks
that matter (guilty, and the members of the verdict's group) get more.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import PurePath
from typing import Any

from frtools import __version__
from frtools.analyze.align import Alignment
from frtools.analyze.reporters import views
from frtools.analyze.stacks import StacksSummary, frames_that_matter_first, user_frames_first
from frtools.analyze.steps import step_diff_lines
from frtools.analyze.verdict import Verdict
from frtools.model.ranks import format_ranks
from frtools.model.trace import Trace

# the page's one script runs by its hash (computed at render time), never 'unsafe-inline':
# a script element some text managed to put into the page would not run
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src {script_hash}; "
    "img-src data:; base-uri 'none'; form-action 'none'"
)
# time slices embedded for all ranks together, and the most per rank
OPS_BUDGET = 24_000
FOCUS_OPS = 48
FOCUS_RANKS = 64
MIN_OPS = 4
MAX_LISTED_GROUPS = 60
SHOWN_GROUPS = 10
MAX_LISTED_INPUTS = 500

_STATE_CODES = {
    views.DONE: "d",
    views.PENDING: "p",
    views.UNKNOWN: "u",
    views.BEHIND: "b",
    views.NO_RECORD: "n",
}
_COMPLETION_CODES = {views.COMPLETED: 0, views.NOT_COMPLETED: 1, views.COMPLETION_UNKNOWN: 2}


def _asset(name: str) -> str:
    return resources.files("frtools.analyze.reporters").joinpath("assets", name).read_text("utf-8")


def render(
    verdict: Verdict,
    trace: Trace,
    alignment: Alignment,
    *,
    last: int | None = None,
    title: str | None = None,
    source: str | None = None,
) -> str:
    """The whole report as one HTML document. ``last``: ops per rank in the timeline
    (default: as many as fit the size budget); ``source``: the analyzed path, shown."""
    pmap = views.progress_map(trace, alignment)
    point = views.hang_point(trace, alignment, verdict)
    focus = _focus_ranks(verdict, pmap)
    per_rank = _ops_per_rank(pmap.ranks, focus, last)
    ops = views.recent_ops(trace, alignment, per_rank, point.end_ns)
    late = views.lateness(alignment) if verdict.kind == "straggler" else None
    data = _payload(verdict, trace, pmap, point, ops, focus, late)
    heading = title or f"frtools: {verdict.kind}"
    body = [
        _verdict_section(verdict, source),
        _map_section(verdict, pmap),
        _timeline_section(point, ops, per_rank),
    ]
    if late is not None and late.ranks:
        body.append(_lateness_section(verdict, late))
    if verdict.stacks is not None:
        body.append(_stacks_section(verdict))
    body.append(_step_diff_section(verdict))
    body.append(_inputs_section(verdict))
    script = f"\n{_asset('report.js')}\n"  # the <script> element's text, as hashed
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    return _PAGE.format(
        csp=html.escape(CSP.format(script_hash=f"'sha256-{digest}'")),
        title=html.escape(heading),
        css=_asset("report.css"),
        kind=html.escape(verdict.kind),
        body="\n".join(body),
        version=html.escape(__version__),
        data=_json_for_script(data),
        script=script,
    )


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="referrer" content="no-referrer">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body class="kind-{kind}" data-ready="0">
<main>
{body}
<footer>frtools {version} · this file is self-contained: it makes no network request.</footer>
</main>
<div id="tip" hidden></div>
<script type="application/json" id="frtools-data">{data}</script>
<script>{script}</script>
</body>
</html>
"""


def _json_for_script(data: Any) -> str:
    """JSON that cannot end its <script> element early."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _focus_ranks(verdict: Verdict, pmap: views.ProgressMap) -> list[int]:
    """The ranks drawn with the most detail: the guilty ones, then the members of the
    verdict's group nearest to them."""
    guilty = list(dict.fromkeys(verdict.guilty_ranks))
    chosen = list(guilty)
    pg = verdict.process_group
    members = list(pg.ranks) if pg is not None else []
    if not members and guilty:
        members = list(verdict.waiting)
    if guilty:
        members.sort(key=lambda r: (min(abs(r - g) for g in guilty), r))
    for r in members:
        if len(chosen) >= FOCUS_RANKS:
            break
        if r not in chosen:
            chosen.append(r)
    return chosen[:FOCUS_RANKS] if len(chosen) > FOCUS_RANKS else chosen


def _ops_per_rank(ranks: list[int], focus: list[int], last: int | None) -> dict[int, int]:
    if last is not None:
        return {r: last for r in ranks}
    others = max(MIN_OPS, min(FOCUS_OPS, OPS_BUDGET // max(1, len(ranks))))
    out = {r: others for r in ranks}
    for r in focus:
        out[r] = FOCUS_OPS
    return out


def _groups_payload(groups: list[views.GroupProgress]) -> dict[str, Any]:
    """The groups as columns (9,761 groups at 4,096 ranks, most of one member): names,
    kinds, members as rank-range text, each group's latest seq, and per member (all groups'
    members one after another) how far its last issued / completed seq is behind the
    group's latest (mostly 0; null: none) and its state letter."""
    descs: dict[str, int] = {}
    behind_issued: list[int | None] = []
    behind_done: list[int | None] = []
    states: list[str] = []
    latest: list[int] = []
    for g in groups:
        top = g.latest
        latest.append(-1 if top is None else top)
        for i, d, st in zip(g.last_issued, g.last_completed, g.states, strict=True):
            behind_issued.append(None if i is None or top is None else top - i)
            behind_done.append(None if d is None or top is None else top - d)
            states.append(_STATE_CODES[st])
    kinds = [descs.setdefault(g.desc, len(descs)) for g in groups]
    return {
        "names": [g.name for g in groups],
        "descs": list(descs),
        "kind": kinds,
        "members": [format_ranks(g.members, strides=True) for g in groups],
        "latest": latest,
        "issued_behind": behind_issued,
        "completed_behind": behind_done,
        "states": "".join(states),
    }


def _payload(
    verdict: Verdict,
    trace: Trace,
    pmap: views.ProgressMap,
    point: views.HangPoint,
    ops: Any,
    focus: list[int],
    late: views.Lateness | None,
) -> dict[str, Any]:
    ranks = pmap.ranks
    index = {r: i for i, r in enumerate(ranks)}
    roles = ["."] * len(ranks)
    for r in verdict.waiting:
        if r in index:
            roles[index[r]] = "w"
    for r in verdict.ranks_missing:
        if r in index and roles[index[r]] == ".":
            roles[index[r]] = "a"
    for r in verdict.guilty_ranks:
        if r in index:
            roles[index[r]] = "g"
    hosts = views.hosts_of(trace, ranks)
    host_names = sorted({h for h in hosts.values() if h})
    host_index = {h: i for i, h in enumerate(host_names)}
    group_index = {g.name: i for i, g in enumerate(pmap.groups)}
    pg = verdict.process_group
    data: dict[str, Any] = {
        "kind": verdict.kind,
        "headline": verdict.headline,
        "ranks": {"n": len(ranks)} if ranks == list(range(len(ranks))) else {"list": ranks},
        "roles": "".join(roles),
        "hosts": (
            {"names": host_names, "of": [host_index.get(hosts[r] or "", -1) for r in ranks]}
            if host_names
            else None
        ),
        "focus": focus,
        "map": {
            "groups": _groups_payload(pmap.groups),
            "rows": [{"l": row.label, "d": row.desc, "g": row.groups} for row in pmap.rows],
            "verdict_group": group_index.get(pg.name) if pg is not None else None,
        },
        "verdict_seq": verdict.collective_seq_id,
        "verdict_p2p_seq": verdict.p2p_seq_id,
        "timeline": _timeline_payload(ops, point, group_index),
        "lateness": (
            {
                "ranks": late.ranks,
                "median": late.median_ms,
                "p90": late.p90_ms,
                "n": late.collectives,
            }
            if late is not None and late.ranks
            else None
        ),
    }
    return data


def _timeline_payload(ops: Any, point: views.HangPoint, group_index: dict[str, int]) -> dict:
    end = point.end_ns
    out: dict[str, Any] = {
        "end_is_dump_time": point.end_is_dump_time,
        "hang": None if point.hang_ns is None else round((point.hang_ns - end) / 1e3),
        "hang_label": point.label,
    }
    if not len(ops):
        out.update(ops=None, opnames=[], sites=[], sizes=[])
        return out
    tables: dict[str, dict[str, int]] = {"op": {}, "site": {}, "size": {}}

    def code(table: str, value: str) -> int:
        t = tables[table]
        if value not in t:
            t[value] = len(t)
        return t[value]

    sizes = [
        f"{i or '?'} {d}".strip() + (f" → {o}" if o and o != i else "")
        for i, d, o in zip(
            ops["input_sizes"], ops["input_dtypes"], ops["output_sizes"], strict=True
        )
    ]
    start = ((ops["start_ns"].to_numpy() - end) / 1e3).round().astype("int64")
    dur = ((ops["end_ns"].to_numpy() - ops["start_ns"].to_numpy()) / 1e3).round().astype("int64")
    out["ops"] = {
        "r": ops["rank"].astype("int64").tolist(),
        "s": start.tolist(),
        "d": dur.tolist(),
        "o": [code("op", v) for v in ops["op"]],
        "g": [group_index.get(v, -1) for v in ops["pg_name"]],
        "q": ops["seq"].astype("int64").tolist(),
        "c": [_COMPLETION_CODES[v] for v in ops["completion"]],
        "e": [1 if v else 0 for v in ops["end_known"]],
        "k": [code("site", v or "") for v in ops["call_site"]],
        "z": [code("size", v) for v in sizes],
        "p": ops["peer"].astype("int64").tolist(),
    }
    out["opnames"] = list(tables["op"])
    out["sites"] = list(tables["site"])
    out["sizes"] = list(tables["size"])
    return out


# --- the static sections: readable with scripts off, and what a DOM test reads ---------


def _verdict_section(verdict: Verdict, source: str | None) -> str:
    pg = verdict.process_group
    out = ['<section id="verdict" class="verdict">']
    out.append(
        f'<h1><span class="badge">{_e(verdict.kind.upper())}</span> '
        f'<span id="headline">{_e(verdict.headline)}</span></h1>'
    )
    meta = [
        f"confidence {verdict.confidence:.0%}",
        f"ranks {verdict.ranks_found}/{verdict.ranks_expected} with a record",
    ]
    if verdict.ranks_missing:
        meta.append(f"no record: {_e(format_ranks(verdict.ranks_missing, 60))}")
    if source:
        meta.append(f"from <code>{_e(source)}</code>")
    out.append(f'<p class="meta">{" · ".join(meta)}</p>')
    if verdict.guilty:
        shown = verdict.guilty[:50]
        # identity columns only where some guilty rank has the fact (Gloo dumps have none)
        columns = [
            (name, cell)
            for name, cell in (
                (
                    "host",
                    lambda g: (
                        (g.host or "?")
                        + (f" (local rank {g.local_rank})" if g.local_rank is not None else "")
                    ),
                ),
                ("device", lambda g: " ".join(x for x in (g.device, g.device_id) if x) or "?"),
                ("pid", lambda g: g.pid or "?"),
            )
            if any(cell(g) != "?" for g in shown)
        ]
        head = "".join(f"<th>{name}</th>" for name, _ in columns)
        out.append(
            f'<table class="guilty"><thead><tr><th>guilty rank</th>{head}<th>reason</th>'
            "<th>call site</th></tr></thead><tbody>"
        )
        for g in shown:
            cells = "".join(f"<td>{_e(cell(g))}</td>" for _, cell in columns)
            out.append(
                f'<tr><td class="rank">{g.rank}</td>{cells}<td>{_e(g.reason)}</td>'
                f"<td><code>{_e(g.call_site or '?')}</code></td></tr>"
            )
        if len(verdict.guilty) > 50:
            out.append(
                f'<tr><td colspan="{3 + len(columns)}">… {len(verdict.guilty) - 50} more</td></tr>'
            )
        out.append("</tbody></table>")
    if pg is not None:
        where = f"group <b>{_e(pg.name)}</b>"
        if pg.desc:
            where += f" ({_e(pg.desc)})"
        where += f", ranks {_e(format_ranks(list(pg.ranks), 80))}"
        if pg.inferred:
            where += ' <span class="dim">(membership inferred)</span>'
        if verdict.op:
            where += f" · op <b>{_e(verdict.op)}</b>"
        if verdict.collective_seq_id is not None:
            where += f" · collective_seq_id {verdict.collective_seq_id}"
        if verdict.p2p_seq_id is not None:
            where += f" · p2p_seq_id {verdict.p2p_seq_id}"
        out.append(f'<p class="where">{where}</p>')
    if verdict.waiting:
        out.append(
            f'<p class="waiting">waiting ({len(verdict.waiting)}): '
            f"<span>{_e(format_ranks(verdict.waiting, 160))}</span></p>"
        )
    if verdict.groups:
        guilty = set(verdict.guilty_ranks)
        out.append('<table class="agree"><thead><tr><th>ranks</th><th>op</th>')
        out.append("<th>input sizes</th><th>dtypes</th><th>output sizes</th><th>state</th>")
        out.append("</tr></thead><tbody>")
        for grp in verdict.groups[:40]:
            cls = ' class="guilty-row"' if set(grp.ranks) & guilty else ""
            out.append(
                f"<tr{cls}><td>{_e(format_ranks(grp.ranks, 40))}</td><td>{_e(grp.op or '-')}</td>"
                f"<td>{_e(grp.input_sizes or '-')}</td><td>{_e(grp.input_dtypes or '-')}</td>"
                f"<td>{_e(grp.output_sizes or '-')}</td><td>{_e(grp.state or '-')}</td></tr>"
            )
        out.append("</tbody></table>")
    out.append(_action_html(verdict))
    if verdict.decide:
        out.append('<div class="decide"><b>To decide</b><ul>')
        out.extend(f"<li>{_e(d)}</li>" for d in verdict.decide)
        out.append("</ul></div>")
    if verdict.evidence:
        out.append("<details><summary>evidence</summary><ul>")
        out.extend(f"<li>{_e(e)}</li>" for e in verdict.evidence)
        out.append("</ul></details>")
    out.append(
        '<nav><a href="#map">progress map</a> · <a href="#timeline">timeline</a>'
        + (' · <a href="#lateness">lateness</a>' if verdict.kind == "straggler" else "")
        + (' · <a href="#stacks">stacks</a>' if verdict.stacks is not None else "")
        + ' · <a href="#inputs">inputs</a></nav>'
    )
    out.append("</section>")
    return "\n".join(out)


def _action_html(verdict: Verdict) -> str:
    """The next action (docs/actions.md): kind, what it names, reasons, what is missing."""
    action = verdict.action
    if action is None:
        return ""
    kind = _e(action.kind)
    out = [
        f'<div id="action" class="action action-{kind.replace(" ", "-")}" data-kind="{kind}">',
        f'<p><b>Next:</b> <span class="badge">{_e(action.kind.upper())}</span> ',
    ]
    if action.kind == "drain":
        named = [
            " ".join(
                x
                for x in (
                    f"<b>{_e(g.host)}</b>",
                    f"GPU {g.gpu}" if g.gpu is not None else None,
                    f"(PCI <code>{_e(g.pci_bus_id)}</code>)" if g.pci_bus_id else None,
                    "(inferred)" if g.inferred else None,
                )
                if x
            )
            for g in action.gpus
        ]
        named += [f"<b>{_e(h)}</b>" for h in action.hosts if h not in {g.host for g in action.gpus}]
        out.append(", ".join(named))
    elif action.kind == "fix code":
        out.append(", ".join(f"<code>{_e(s)}</code>" for s in action.call_sites[:10]))
    out.append(f' <span class="dim">({_e(action.rule)})</span></p><ul>')
    out.extend(f"<li>{_e(r)}</li>" for r in action.reasons)
    out.extend(f'<li class="dim">missing: {_e(m)}</li>' for m in action.missing)
    out.append("</ul></div>")
    return "".join(out)


def _map_section(verdict: Verdict, pmap: views.ProgressMap) -> str:
    out = ['<section id="map"><h2>Progress by process group</h2>']
    out.append(
        '<p class="help">One row per kind of group, one column per rank (several ranks per '
        "pixel column at scale: the worst state shows). Each cell: that rank's last collective "
        "on its group of this kind against the group's latest. "
        '<span class="key k-d">completed</span> <span class="key k-u">issued, completion '
        'unknown</span> <span class="key k-p">issued, not completed</span> '
        '<span class="key k-b">never issued the latest</span> <span class="key k-n">no '
        "record</span>. ▼ and a red band: the guilty rank(s). Click a cell to zoom to its group.</p>"
    )
    out.append('<div class="map-wrap"><canvas id="map-canvas" height="10"></canvas></div>')
    out.append('<div id="map-zoom" class="zoom"></div>')
    rows = []
    by_desc: dict[str, list[views.GroupProgress]] = {}
    for g in pmap.groups:
        by_desc.setdefault(g.desc, []).append(g)
    for desc, groups in by_desc.items():
        behind = sum(1 for g in groups if views.BEHIND in g.states)
        pending = sum(1 for g in groups if views.PENDING in g.states)
        no_rec = sum(1 for g in groups if views.NO_RECORD in g.states)
        sizes = sorted({len(g.members) for g in groups})
        size_text = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]}"
        rows.append(
            f"<tr><td>{_e(desc or '(none)')}</td><td>{len(groups)}</td><td>{size_text}</td>"
            f"<td>{behind or ''}</td><td>{pending or ''}</td><td>{no_rec or ''}</td></tr>"
        )
    out.append(
        '<table class="kinds"><thead><tr><th>kind</th><th>groups</th><th>members</th>'
        "<th>with a member behind</th><th>with an op not completed</th><th>with a member "
        "without record</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
    )
    out.append(_groups_table(verdict, pmap))
    out.append("</section>")
    return "\n".join(out)


def _groups_table(verdict: Verdict, pmap: views.ProgressMap) -> str:
    pg = verdict.process_group
    guilty = set(verdict.guilty_ranks)
    candidates = [(i, g) for i, g in enumerate(pmap.groups) if not g.in_step]

    def key(item: tuple[int, views.GroupProgress]) -> tuple:
        i, g = item
        return (
            not (pg is not None and g.name == pg.name),
            not (set(g.members) & guilty),
            views.BEHIND not in g.states,
            i,
        )

    candidates.sort(key=key)
    if not candidates:
        return '<p class="dim">Every group is in step: each member issued and completed its latest collective.</p>'
    out = [
        f'<h3>Groups not in step ({len(candidates)})</h3><table class="groups">',
        "<thead><tr><th>group</th><th>kind</th><th>members</th><th>latest seq</th>",
        "<th>behind</th><th>not completed</th><th>no record</th></tr></thead><tbody>",
    ]
    for n, (i, g) in enumerate(candidates[:MAX_LISTED_GROUPS]):
        if n == SHOWN_GROUPS:
            out.append(
                '</tbody></table><details><summary>more groups</summary><table class="groups">'
                "<tbody>"
            )
        behind = [r for r, s in zip(g.members, g.states, strict=True) if s == views.BEHIND]
        pend = [r for r, s in zip(g.members, g.states, strict=True) if s == views.PENDING]
        none = [r for r, s in zip(g.members, g.states, strict=True) if s == views.NO_RECORD]
        cls = ' class="verdict-group"' if pg is not None and g.name == pg.name else ""
        out.append(
            f'<tr{cls} data-group="{i}"><td>{_e(g.name)}</td><td>{_e(g.desc)}</td>'
            f"<td>{_e(format_ranks(g.members, 30))}</td><td>{_e(g.latest)}</td>"
            f"<td>{_e(format_ranks(behind, 30) if behind else '')}</td>"
            f"<td>{_e(format_ranks(pend, 30) if pend else '')}</td>"
            f"<td>{_e(format_ranks(none, 30) if none else '')}</td></tr>"
        )
    if len(candidates) > MAX_LISTED_GROUPS:
        out.append(
            f'<tr><td colspan="7" class="dim">… {len(candidates) - MAX_LISTED_GROUPS} more '
            "(the map shows all)</td></tr>"
        )
    out.append("</tbody></table>")
    if len(candidates) > SHOWN_GROUPS:
        out.append("</details>")
    return "\n".join(out)


def _timeline_section(point: views.HangPoint, ops: Any, per_rank: dict[int, int]) -> str:
    counts = sorted(set(per_rank.values()))
    shown = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    end = "the dumps' time" if point.end_is_dump_time else "the newest record (no dump time)"
    return (
        '<section id="timeline"><h2>Last ops of every rank</h2>'
        f'<p class="help">The last {shown} ops of each rank ({len(ops)} slices), from enqueue '
        f"to completion; time runs to {end} at 0. Rows grouped by "
        '<select id="tl-group"></select>; click a group\'s row to open or close it. '
        '<span class="key k-d">completed</span> <span class="key k-p">not completed</span> '
        '<span class="key k-u">completion unknown</span>; hatched: end not recorded '
        "(drawn to the rank's next op); red outline: the verdict's op. Ctrl+wheel zooms, "
        'drag pans. <button id="tl-fit" type="button">fit</button> '
        '<button id="tl-hang" type="button">around the hang</button></p>'
        '<div id="tl-scroll" class="tl-scroll"><canvas id="tl-canvas"></canvas>'
        '<div id="tl-spacer"></div></div></section>'
    )


def _lateness_section(verdict: Verdict, late: views.Lateness) -> str:
    rows = sorted(
        zip(late.ranks, late.median_ms, late.p90_ms, late.collectives, strict=True),
        key=lambda x: -x[1],
    )[:15]
    guilty = set(verdict.guilty_ranks)
    body = "".join(
        f"<tr{' class=guilty-row' if r in guilty else ''}><td>{r}</td><td>{m:.2f}</td>"
        f"<td>{p:.2f}</td><td>{n}</td></tr>"
        for r, m, p, n in rows
    )
    return (
        '<section id="lateness"><h2>Enqueue lateness per rank</h2>'
        '<p class="help">How late each rank enters collectives that every member of the group '
        "issued: its enqueue time minus the mean of the other members' (median, ms; several "
        "ranks per bar at scale: the largest shows). Red: the straggler(s).</p>"
        '<canvas id="late-canvas" height="160"></canvas>'
        '<table class="late"><thead><tr><th>rank</th><th>median ms</th><th>p90 ms</th>'
        f"<th>collectives</th></tr></thead><tbody>{body}</tbody></table></section>"
    )


def _step_diff_section(verdict: Verdict) -> str:
    """What the failing step did differently from the last good one (frtools.analyze.steps);
    one line where no step repeats; nothing for a healthy verdict."""
    diff = verdict.step_diff
    if diff is None or verdict.kind == "healthy":
        return ""
    cls = "" if diff.changes else ' class="dim"'
    items = "".join(f"<li{cls}>{_e(line)}</li>" for line in step_diff_lines(diff))
    return (
        '<section id="step-diff"><h2>Step diff</h2><p class="help">What the failing step did '
        f"differently from the last good one, per rank.</p><ul>{items}</ul></section>"
    )


def _stacks_section(verdict: Verdict) -> str:
    summary = verdict.stacks
    assert summary is not None
    out = [
        '<section id="stacks"><h2>Stacks</h2>',
        f'<p class="help">Main-thread Python stacks of {summary.ranks_with_stacks} rank(s), '
        "as faulthandler wrote them.</p>",
    ]
    for stack in summary.guilty:
        title = f"rank {stack.rank} main thread" + (f" ({stack.fatal})" if stack.fatal else "")
        lines = []
        for f in user_frames_first(stack.frames)[:40]:
            lines.append(f"{_e(f)}" if f.user else f'<span class="dim">{_e(f)}</span>')
        out.append(f'<h3 class="guilty-title">{_e(title)}</h3><pre>{chr(10).join(lines)}</pre>')
    if summary.groups:
        out.extend(_stack_groups_table(summary.groups, user_frames_first))
    out.extend(_native_stacks_html(summary))
    out.append("</section>")
    return "\n".join(out)


def _native_stacks_html(summary: StacksSummary) -> list[str]:
    """The native stacks (py-spy) beside the Python ones: NCCL/Gloo/CUDA/c10d frames first."""
    if not summary.native_groups:
        return []
    out = [
        f'<h3>Native stacks</h3><p class="help">Native stacks of {summary.ranks_with_native} '
        "rank(s), as py-spy took them at dump time; NCCL, Gloo, CUDA and c10d frames first.</p>"
    ]
    for stack in summary.native_guilty:
        lines = [
            _e(f) if f.matters else f'<span class="dim">{_e(f)}</span>'
            for f in frames_that_matter_first(stack.frames)[:40]
        ]
        title = f"rank {stack.rank} native stack ({stack.thread})"
        out.append(f'<h3 class="guilty-title">{_e(title)}</h3><pre>{chr(10).join(lines)}</pre>')
    return out + _stack_groups_table(summary.native_groups, frames_that_matter_first)


def _stack_groups_table(groups: Sequence[Any], order: Callable[[Any], list[Any]]) -> list[str]:
    """One row per stack group (Python or native): ranks, count, where, its frames folded
    (in ``order``), outliers marked."""
    out = [
        '<table class="stacks"><thead><tr><th>ranks</th><th>count</th><th>where</th>'
        "<th></th></tr></thead><tbody>"
    ]
    for g in groups[:MAX_LISTED_GROUPS]:
        mark = '<span class="outlier">outlier</span>' if g.outlier else ""
        frames = "\n".join(_e(f) for f in order(g.frames)[:30])
        out.append(
            f"<tr{' class=outlier-row' if g.outlier else ''}>"
            f"<td>{_e(format_ranks(g.ranks, 40))}</td><td>{g.count}</td>"
            f"<td><details><summary><code>{_e(g.top)}</code></summary><pre>{frames}</pre>"
            f"</details></td><td>{mark}</td></tr>"
        )
    out.append("</tbody></table>")
    return out


def _inputs_section(verdict: Verdict) -> str:
    bad = [i for i in verdict.inputs if i.status != "ok"]
    ok = len(verdict.inputs) - len(bad)
    out = ['<section id="inputs"><h2>Inputs</h2>']
    formats: dict[str, int] = {}
    for i in verdict.inputs:
        if i.status == "ok":
            kind = i.format or PurePath(i.path).suffix.lstrip(".") or "other"
            formats[kind] = formats.get(kind, 0) + 1
    kinds = ", ".join(f"{n} {f}" for f, n in sorted(formats.items()))
    out.append(
        f"<p>{ok} file(s) used{f' ({_e(kinds)})' if kinds else ''}; {len(bad)} not used."
        + (
            f" No usable record for rank(s) {_e(format_ranks(verdict.ranks_missing, 120))}."
            if verdict.ranks_missing
            else ""
        )
        + "</p>"
    )
    if bad:
        out.append(
            '<table class="inputs"><thead><tr><th>file</th><th>status</th><th>rank</th>'
            "<th>why</th></tr></thead><tbody>"
        )
        for i in bad[:MAX_LISTED_INPUTS]:
            out.append(
                f'<tr class="st-{_e(i.status)}"><td><code>{_e(i.path)}</code></td>'
                f"<td>{_e(i.status)}</td><td>{_e('' if i.rank is None else i.rank)}</td>"
                f"<td>{_e(i.reason)}</td></tr>"
            )
        if len(bad) > MAX_LISTED_INPUTS:
            out.append(f'<tr><td colspan="4">… {len(bad) - MAX_LISTED_INPUTS} more</td></tr>')
        out.append("</tbody></table>")
    out.append("</section>")
    return "\n".join(out)
