"""Markdown report for CI job summaries (e.g. ``$GITHUB_STEP_SUMMARY``).

Every text a dump wrote is inline text (``escape.markdown_text``), a code span
(``escape.markdown_code``) or inside a fence longer than any backtick run in it: none can add
a heading, a link, HTML or a comment that hides the rest of the summary.
"""

from __future__ import annotations

from frtools.analyze.reporters.escape import markdown_code, markdown_fence, markdown_text
from frtools.analyze.reporters.stacks_text import stack_lines
from frtools.analyze.reporters.terminal import STACK_KINDS
from frtools.analyze.steps import step_diff_lines
from frtools.analyze.verdict import Verdict
from frtools.model.ranks import format_ranks

_ICON = {"healthy": "✅", "inconclusive": "⚠️"}


def _cell(value: object) -> str:
    return markdown_text("" if value is None else value)


def action_section(verdict: Verdict) -> list[str]:
    """The next action (docs/actions.md): its kind, what it names, its reasons, what is
    missing."""
    action = verdict.action
    if action is None:
        return []
    out = [f"### Next action: `{action.kind}` ({markdown_code(action.rule)})", ""]
    if action.kind == "drain":
        named = [
            " ".join(
                x
                for x in (
                    markdown_code(g.host),
                    f"GPU {g.gpu}" if g.gpu is not None else None,
                    f"PCI {markdown_code(g.pci_bus_id)}" if g.pci_bus_id else None,
                    "(inferred)" if g.inferred else None,
                )
                if x
            )
            for g in action.gpus
        ]
        named += [markdown_code(h) for h in action.hosts if h not in {g.host for g in action.gpus}]
        out += [f"Drain: {', '.join(named)}", ""]
    elif action.kind == "fix code" and action.call_sites:
        out += ["Fix: " + ", ".join(markdown_code(s) for s in action.call_sites[:10]), ""]
    out += [f"- {_cell(r)}" for r in action.reasons]
    out += [f"- missing: {_cell(m)}" for m in action.missing]
    return [*out, ""]


def step_diff_section(verdict: Verdict, verbose: bool = False) -> list[str]:
    """What the failing step did differently from the last good one (frtools.analyze.steps);
    one line where no step repeats; nothing for a healthy verdict unless verbose."""
    diff = verdict.step_diff
    if diff is None or (verdict.kind == "healthy" and not verbose):
        return []
    return ["### Step diff", "", *(f"- {_cell(line)}" for line in step_diff_lines(diff)), ""]


def render(verdict: Verdict, verbose: bool = False) -> str:
    """Headline, guilty ranks, the rank groups at the collective, and bad inputs."""
    icon = _ICON.get(verdict.kind, "❌")
    out = [f"## {icon} frtools: `{verdict.kind}`", "", f"**{_cell(verdict.headline)}**", ""]
    out.append(
        f"Confidence {verdict.confidence:.0%} · ranks found {verdict.ranks_found}"
        f"/{verdict.ranks_expected}"
        + (f" · missing {format_ranks(verdict.ranks_missing)}" if verdict.ranks_missing else "")
    )
    out.append("")
    pg = verdict.process_group
    if pg is not None:
        where = f"Process group {markdown_code(pg.name)}" + (
            f" ({_cell(pg.desc)})" if pg.desc else ""
        )
        where += f", ranks {format_ranks(list(pg.ranks))}"
        if verdict.op:
            where += f", op {markdown_code(verdict.op)}"
        if verdict.collective_seq_id is not None:
            where += f", collective_seq_id {verdict.collective_seq_id}"
        if verdict.p2p_seq_id is not None:
            where += f", p2p_seq_id {verdict.p2p_seq_id}"
        out += [where, ""]
    if verdict.guilty:
        out += [
            "| guilty rank | host | device | pid | reason | call site |",
            "|---|---|---|---|---|---|",
        ]
        for g in verdict.guilty:
            out.append(
                f"| {g.rank} | {_cell(g.host)} | {_cell(g.device)} | {_cell(g.pid)} "
                f"| {_cell(g.reason)} | {_cell(g.call_site)} |"
            )
        out.append("")
    if verdict.waiting:
        out += [f"Waiting ranks: {format_ranks(verdict.waiting)}", ""]
    if verdict.groups:
        out += ["| ranks | op | input sizes | dtypes | state |", "|---|---|---|---|---|"]
        for g in verdict.groups:
            out.append(
                f"| {format_ranks(g.ranks)} | {_cell(g.op)} | {_cell(g.input_sizes)} "
                f"| {_cell(g.input_dtypes)} | {_cell(g.state)} |"
            )
        out.append("")
    out += step_diff_section(verdict, verbose)
    out += action_section(verdict)
    if verdict.decide:
        out += ["### To decide", ""] + [f"- {_cell(d)}" for d in verdict.decide] + [""]
    if verdict.stacks is not None and (verdict.kind in STACK_KINDS or verbose):
        lines = stack_lines(verdict.stacks, max_frames=12 if verbose else 6)
        if lines:
            out += ["### Stacks", "", *markdown_fence(lines), ""]
    if verbose and verdict.evidence:
        out += ["### Evidence", ""] + [f"- {_cell(e)}" for e in verdict.evidence] + [""]
    bad = [i for i in verdict.inputs if i.status != "ok"]
    if bad:
        out += ["### Inputs not used", "", "| file | status | reason |", "|---|---|---|"]
        for i in bad:
            out.append(f"| {markdown_code(i.path, table=True)} | {i.status} | {_cell(i.reason)} |")
        out.append("")
    return "\n".join(out)
