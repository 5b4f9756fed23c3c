"""The canonical data model every other part speaks: the Trace, rank-range text, op names,
a host's devices.

Imports nothing from the rest of frtools: model <- formats <- {recorder, collect, analyze,
synth} <- commands (docs/architecture.md).
"""
