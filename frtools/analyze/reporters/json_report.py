"""The JSON report: ``Verdict.to_document()`` as written text (docs/verdict.schema.json)."""

from __future__ import annotations

import json

from frtools.analyze.verdict import Verdict


def render(verdict: Verdict) -> str:
    """The versioned JSON document, indented, with a trailing newline."""
    return json.dumps(verdict.to_document(), indent=2) + "\n"
