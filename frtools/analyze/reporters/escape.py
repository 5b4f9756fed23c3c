"""What a dump wrote, made safe for the place it is shown: one escaping step per output kind.

Every text in a dump (a group name, an op, a host, a call site, a stack) is hostile: it may
carry escape sequences that set a terminal's title or move its cursor over the verdict, rich
markup, newlines followed by a CI runner's workflow commands (``::add-mask::``), or markdown
that adds a heading or an HTML comment hiding the rest of a job summary.

* ``terminal``: control characters (C0, DEL, C1, line and paragraph separators, bidi
  overrides) shown as ``\\x1b``, ``\\n``, ``\\u202e`` — never sent as they are;
* ``markup``: the same, for a string that rich reads as markup (``[red]`` stays text);
* ``no_workflow_commands``: a whole rendered text, last: no line of it may start (after
  blanks, as the runner reads it) with ``::``, which a wrapped line could otherwise do;
* ``line``: one line a command prints on stderr: ``terminal`` then ``no_workflow_commands``;
* ``markdown_text`` / ``markdown_code`` / ``markdown_fence``: inline text with markdown's
  active characters escaped, a code span whose fence is longer than any backtick run in it,
  a fenced block the same way (HTML inside code is shown, never parsed).

GitHub's own workflow-command escaping (``%``, ``\\r``, ``\\n``) is ``github.escape_data``; the
HTML report escapes with ``html.escape``.
"""

from __future__ import annotations

import re

__all__ = [
    "line",
    "markdown_code",
    "markdown_fence",
    "markdown_text",
    "markup",
    "no_workflow_commands",
    "terminal",
]

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_WORKFLOW = re.compile(r"^([^\S\n]*)::", re.M)  # the runner trims any blank first
_MARKDOWN_ACTIVE = re.compile(r"([\\`*\[\]<>|#!~])")
_BACKTICKS = re.compile(r"`+")


def _visible(m: re.Match[str]) -> str:
    c = m.group(0)
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def terminal(text: object) -> str:
    """``text`` with every control character made visible (``"\\x1b[2J"`` -> ``"\\\\x1b[2J"``)."""
    return _CONTROL.sub(_visible, "" if text is None else str(text))


def markup(text: object) -> str:
    """``terminal(text)`` that rich prints as it is, not as markup."""
    from rich.markup import escape

    return escape(terminal(text))


def no_workflow_commands(rendered: str) -> str:
    """A rendered text in which no line starts a CI workflow command: a line whose first
    non-blank characters are ``::`` gets its first colon shown as ``\\x3a``."""
    return _WORKFLOW.sub(lambda m: m.group(1) + "\\x3a:", rendered)


def line(text: object) -> str:
    """One line for stderr: no control character, no workflow command."""
    return no_workflow_commands(terminal(text))


def markdown_text(text: object) -> str:
    """Inline markdown (a line or a table cell) showing ``text`` as text: no heading, list,
    link, image, HTML or comment it could open, no cell it could end."""
    return _MARKDOWN_ACTIVE.sub(r"\\\1", terminal(text))


def markdown_code(text: object, *, table: bool = False) -> str:
    """``text`` as one code span, whatever backticks it holds (``table``: inside a table
    cell, where GitHub splits on ``|`` even in code, so it is escaped)."""
    body = terminal(text)
    run = max((len(m) for m in _BACKTICKS.findall(body)), default=0)
    fence = "`" * (run + 1)
    if body.startswith(("`", " ")) or body.endswith(("`", " ")):
        body = f" {body} "
    if table:
        body = body.replace("|", "\\|")
    return f"{fence}{body}{fence}"


def markdown_fence(lines: list[str]) -> list[str]:
    """``lines`` as one fenced code block, its fence longer than any backtick run in them."""
    shown = [terminal(x) for x in lines]
    run = max((len(m) for x in shown for m in _BACKTICKS.findall(x)), default=0)
    fence = "`" * max(3, run + 1)
    return [fence, *shown, fence]
