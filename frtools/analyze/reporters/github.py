"""GitHub Actions workflow commands: an annotation at each guilty rank's call site.

``::error file=F,line=L,title=T::message`` puts the verdict on the line of code in the
pull request's diff and in the run's summary; a healthy job gets one ``::notice``.
Escaping follows the runner's rules (actions/toolkit ``command.ts``): in the message
``%``, ``\\r`` and ``\\n``; in a property also ``:`` and ``,``.

A call site is ``path:line in function``; a path under ``$GITHUB_WORKSPACE`` is made
relative to it, as annotations name files relative to the repository.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from frtools.analyze.verdict import GuiltyRank, Verdict
from frtools.model.ranks import format_ranks

# GitHub shows at most 10 annotations of each level per step
MAX_ANNOTATIONS = 10
_SITE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?: in (?P<func>.*))?$")


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(level: str, message: str, **properties: str | int | None) -> str:
    props = ",".join(
        f"{k}={escape_property(str(v))}" for k, v in properties.items() if v not in (None, "")
    )
    return f"::{level}{' ' + props if props else ''}::{escape_data(message)}"


def split_call_site(
    call_site: str | None, workspace: str | None = None
) -> tuple[str | None, int | None]:
    """``"/ws/repo/train.py:120 in step"`` -> ``("train.py", 120)`` when the workspace is
    ``/ws/repo``; ``(None, None)`` when there is no file and line."""
    if not call_site:
        return None, None
    m = _SITE.match(call_site.strip())
    if not m:
        return None, None
    path = m.group("file")
    if workspace:
        root = os.path.join(os.path.abspath(workspace), "")
        if os.path.isabs(path) and os.path.abspath(path).startswith(root):
            path = os.path.relpath(os.path.abspath(path), root)
    return path, int(m.group("line"))


def _level(verdict: Verdict) -> str:
    if verdict.kind == "healthy":
        return "notice"
    if verdict.kind == "inconclusive":
        return "warning"
    return "error"


def _message(verdict: Verdict, g: GuiltyRank | None) -> str:
    lines = [verdict.headline]
    if g is not None:
        where = ", ".join(x for x in (g.host, g.device, f"pid {g.pid}" if g.pid else None) if x)
        lines.append(f"rank {g.rank}{f' ({where})' if where else ''}: {g.reason}")
        if g.call_site:
            lines.append(f"at {g.call_site}")
    pg = verdict.process_group
    if pg is not None:
        what = f"group {pg.name}" + (f" ({pg.desc})" if pg.desc else "")
        if verdict.op:
            what += f", op {verdict.op}"
        if verdict.collective_seq_id is not None:
            what += f", collective_seq_id {verdict.collective_seq_id}"
        lines.append(what)
    if verdict.waiting:
        lines.append(f"waiting: {format_ranks(verdict.waiting, 200)}")
    lines += [f"to decide: {d}" for d in verdict.decide]
    lines += action_lines(verdict)
    lines.append(f"confidence {verdict.confidence:.0%}")
    return "\n".join(lines)


def action_lines(verdict: Verdict) -> list[str]:
    """The next action in an annotation (docs/actions.md): kind, what it names, its first
    reasons; nothing for a healthy verdict."""
    action = verdict.action
    if action is None or action.kind == "none":
        return []
    named = action.hosts if action.kind == "drain" else action.files
    gpus = [f"{g.host} GPU {g.gpu}" for g in action.gpus if g.gpu is not None]
    what = ", ".join([*gpus, *named][:6])
    lines = [f"next action: {action.kind}" + (f" ({what})" if what else "")]
    lines += [f"  {r}" for r in action.reasons[:3]]
    return lines


def render(verdict: Verdict, env: Mapping[str, str] | None = None) -> str:
    """The workflow commands, one per line, with a trailing newline."""
    env = os.environ if env is None else env
    workspace = env.get("GITHUB_WORKSPACE")
    level = _level(verdict)
    title = f"frtools: {verdict.kind}"
    out: list[str] = []
    if level != "error" or not verdict.guilty:
        out.append(command(level, _message(verdict, None), title=title))
    else:
        for g in verdict.guilty[:MAX_ANNOTATIONS]:
            path, line = split_call_site(g.call_site, workspace)
            out.append(
                command(
                    level,
                    _message(verdict, g),
                    file=path,
                    line=line,
                    title=f"{title}: rank {g.rank}",
                )
            )
    bad = [i for i in verdict.inputs if i.status == "error"]
    if bad:
        shown = "\n".join(f"{i.path}: {i.reason}" for i in bad[:20])
        more = f"\n… {len(bad) - 20} more" if len(bad) > 20 else ""
        out.append(
            command(
                "warning",
                f"{len(bad)} dump file(s) unusable:\n{shown}{more}",
                title="frtools: inputs",
            )
        )
    return "\n".join(out) + "\n"


def append_step_summary(markdown_text: str, env: Mapping[str, str] | None = None) -> bool:
    """Append the markdown report to ``$GITHUB_STEP_SUMMARY`` when it is set; True if so."""
    env = os.environ if env is None else env
    path = env.get("GITHUB_STEP_SUMMARY")
    if not path:
        return False
    with open(path, "a", encoding="utf-8") as f:
        f.write(markdown_text if markdown_text.endswith("\n") else markdown_text + "\n")
    return True
