"""The canonical data model every other part speaks: the Trace, rank-range text, op kinds.

Imports nothing from the rest of frtools: model <- formats <- {recorder, collect, analyze,
synth} <- commands (docs/architecture.md).
"""
