"""Terminal report (rich): the answer first, on one screen at 100 columns.

Colour means something: red = guilty, yellow = waiting, green = healthy. Every text a dump
wrote goes through ``escape.terminal`` (no escape sequence reaches the terminal, no markup is
read) and the rendered text through ``escape.no_workflow_commands`` (no line of it starts a CI
workflow command).
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from frtools.analyze.reporters.escape import no_workflow_commands, terminal
from frtools.analyze.reporters.stacks_text import stack_lines
from frtools.analyze.steps import step_diff_lines
from frtools.analyze.verdict import GuiltyRank, Verdict
from frtools.model.ranks import format_ranks

# verdicts where the guilty rank is somewhere in its own code: its stack says where
STACK_KINDS = ("missing", "dead", "stuck")


def renderable(verdict: Verdict, verbose: bool = False) -> Group:
    """The whole report as one rich renderable."""
    parts: list = []
    healthy = verdict.kind == "healthy"
    # red: a rank is to blame; yellow: something is wrong but no rank can be named
    colour = "green" if healthy else ("yellow" if verdict.kind == "inconclusive" else "red")
    head = Text()
    head.append(f" {verdict.kind.upper()} ", style=f"bold white on {colour}")
    head.append(" ")
    head.append(terminal(verdict.headline), style=f"bold {colour}")
    parts.append(head)
    meta = Text(f"confidence {verdict.confidence:.0%}", style="dim")
    meta.append(
        f" · ranks {verdict.ranks_found}/{verdict.ranks_expected} with a record", style="dim"
    )
    parts.append(meta)

    for g in verdict.guilty:
        line = Text("  ")
        line.append(f"rank {g.rank}", style="bold red")
        host = f"{g.host}, host from the file name" if g.host and g.host_guessed else g.host
        ident = [x for x in (host, g.device, f"pid {g.pid}" if g.pid else None) if x]
        if g.local_rank is not None:
            ident.append(f"local rank {g.local_rank}")
        if g.device_id:
            ident.append(g.device_id)
        if ident:
            line.append(" (" + terminal(", ".join(ident)) + ")", style="red")
        line.append(f": {terminal(g.reason)}")
        parts.append(line)
        if g.call_site:
            parts.append(Text(f"    at {terminal(g.call_site)}", style="cyan"))
        parts.extend(_device_lines(g))

    pg = verdict.process_group
    if pg is not None:
        where = Text("  group ")
        where.append(terminal(pg.name), style="bold")
        if pg.desc:
            where.append(f" ({terminal(pg.desc)})")
        where.append(f" ranks {format_ranks(list(pg.ranks), 40)}")
        if pg.inferred:
            where.append(" (membership inferred)", style="dim")
        if verdict.op:
            where.append(f" · op {terminal(verdict.op)}")
        if verdict.collective_seq_id is not None:
            where.append(f" · collective_seq_id {verdict.collective_seq_id}")
        if verdict.p2p_seq_id is not None:
            where.append(f" · p2p_seq_id {verdict.p2p_seq_id}")
        parts.append(where)
    if verdict.waiting:
        w = Text("  waiting: ")
        w.append(format_ranks(verdict.waiting, 85), style="yellow")
        parts.append(w)

    if verdict.groups:
        parts.append(_groups_table(verdict, verbose))

    if verdict.stacks is not None and (verdict.kind in STACK_KINDS or verbose):
        lines = stack_lines(verdict.stacks, max_frames=12 if verbose else 6)
        if lines:
            parts.append(Text("Stacks", style="bold"))
            for line in lines:
                style = "red" if line.startswith("rank ") else ""
                if "<- outlier" in line:
                    style = "red"
                parts.append(Text(f"  {terminal(line)}", style=style))

    parts.extend(step_diff_text(verdict, verbose))
    parts.extend(action_lines(verdict, verbose))

    if verdict.decide:
        parts.append(Text("To decide", style="bold"))
        for d in verdict.decide:
            parts.append(Text(f"  • {terminal(d)}"))

    if verbose and verdict.evidence:
        parts.append(Text("Evidence", style="bold"))
        for e in verdict.evidence:
            parts.append(Text(f"  • {terminal(e)}"))

    bad = [i for i in verdict.inputs if i.status != "ok"]
    if bad or verdict.ranks_missing:
        parts.append(Text("Inputs", style="bold"))
        if verdict.ranks_missing:
            parts.append(
                Text(f"  no usable record for rank(s) {format_ranks(verdict.ranks_missing, 60)}")
            )
        shown = bad if verbose else bad[:8]
        for i in shown:
            style = "red" if i.status == "error" else "dim"
            line = Text("  ")
            line.append(f"{i.status:9}", style=style)
            line.append(f" {terminal(i.path)}: {terminal(i.reason)}")
            parts.append(line)
        if len(bad) > len(shown):
            parts.append(Text(f"  … {len(bad) - len(shown)} more (-v lists all)", style="dim"))
    return Group(*parts)


def _device_lines(g: GuiltyRank) -> list[Text]:
    """The guilty rank's GPU and what its host's device facts showed abnormal there
    (red: evidence against the hardware; yellow: a hint)."""
    lines = []
    if g.gpu is not None:
        gpu = f"    GPU {g.gpu}" + (f" (PCI {terminal(g.pci_bus_id)})" if g.pci_bus_id else "")
        if g.host:
            gpu += f" on {terminal(g.host)}"
        if g.gpu_inferred:
            gpu += " — inferred from the rank's local rank (no CUDA device recorded)"
        lines.append(Text(gpu, style="dim" if g.gpu_inferred else ""))
    for f in g.findings:
        style = "bold red" if f.hardware else "yellow"
        lines.append(Text(f"    ! {terminal(f.text)}", style=style))
    return lines


ACTION_STYLE = {
    "drain": "bold white on red",
    "fix code": "bold white on magenta",
    "restart": "bold black on yellow",
    "investigate": "bold black on yellow",
    "none": "bold white on green",
}
SHOWN_REASONS = 4  # reasons of the action shown without -v


def action_lines(verdict: Verdict, verbose: bool = False) -> list[Text]:
    """The next action (docs/actions.md): its kind, what it names, its reasons and what is
    missing; nothing for a verdict without one."""
    action = verdict.action
    if action is None:
        return []
    head = Text("Next: ", style="bold")
    head.append(f" {action.kind.upper()} ", style=ACTION_STYLE.get(action.kind, "bold"))
    targets = [
        " ".join(
            x
            for x in (
                g.host,
                f"GPU {g.gpu}" if g.gpu is not None else None,
                f"(PCI {g.pci_bus_id})" if g.pci_bus_id else None,
                "(inferred)" if g.inferred else None,
            )
            if x
        )
        for g in action.gpus
    ]
    if action.kind == "drain":
        named = {g.host for g in action.gpus}
        targets += [h for h in action.hosts if h not in named]
    elif action.kind == "fix code":
        targets = list(action.files or action.call_sites)
    if targets:
        head.append(" " + terminal(", ".join(targets[:6])), style="bold")
        if len(targets) > 6:
            head.append(f" +{len(targets) - 6}", style="dim")
    head.append(f"  ({action.rule})", style="dim")
    lines = [head]
    shown = action.reasons if verbose else action.reasons[:SHOWN_REASONS]
    lines += [Text(f"  • {terminal(r)}") for r in shown]
    if len(action.reasons) > len(shown):
        lines.append(Text(f"  … {len(action.reasons) - len(shown)} more (-v)", style="dim"))
    lines += [Text(f"  missing: {terminal(m)}", style="dim") for m in action.missing]
    return lines


def step_diff_text(verdict: Verdict, verbose: bool = False) -> list[Text]:
    """What the failing step did differently from the last good one (frtools.analyze.steps);
    one line where no step repeats; nothing for a healthy verdict unless verbose."""
    diff = verdict.step_diff
    if diff is None or (verdict.kind == "healthy" and not verbose):
        return []
    lines = [Text("Step diff", style="bold")]
    style = "" if diff.changes else "dim"
    lines += [Text(f"  {terminal(line)}", style=style) for line in step_diff_lines(diff)]
    return lines


def _groups_table(verdict: Verdict, verbose: bool) -> Table:
    guilty = set(verdict.guilty_ranks)
    waiting = set(verdict.waiting)
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    table.add_column("ranks", overflow="fold", max_width=24)
    table.add_column("op")
    table.add_column("input sizes", overflow="fold", max_width=28)
    table.add_column("dtypes", overflow="fold", max_width=14)
    if verbose:
        table.add_column("output sizes", overflow="fold", max_width=20)
    table.add_column("state")
    for g in verdict.groups:
        ranks = set(g.ranks)
        style = "red" if ranks & guilty else ("yellow" if ranks <= waiting else "")
        row = [
            Text(format_ranks(g.ranks, 24), style=style),
            Text(terminal(g.op or "-")),
            Text(terminal(g.input_sizes or "-")),
            Text(terminal(g.input_dtypes or "-")),
        ]
        if verbose:
            row.append(Text(terminal(g.output_sizes or "-")))
        row.append(Text(terminal(g.state or "-"), style=style))
        table.add_row(*row)
    return table


def render(
    verdict: Verdict, verbose: bool = False, width: int = 100, color: bool | None = None
) -> str:
    """The report as text (ANSI colours when ``color``; plain text otherwise), no line of
    which starts a workflow command."""
    console = Console(
        width=width,
        record=True,
        force_terminal=bool(color),
        no_color=not color,
        color_system="standard" if color else None,
        file=_Null(),
        highlight=False,
    )
    console.print(renderable(verdict, verbose))
    return no_workflow_commands(console.export_text(styles=bool(color)))


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass
