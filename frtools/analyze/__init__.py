"""The analyzer: readers -> align -> diagnose -> Verdict -> reporters.

``analyze_on_ray`` (``frtools.analyze.ray_fleet``) runs a fleet analysis on a Ray cluster;
it is imported on first use, and Ray only when it runs.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "analyze_on_ray":
        from .ray_fleet import analyze_on_ray

        return analyze_on_ray
    raise AttributeError(f"module 'frtools.analyze' has no attribute {name!r}")
