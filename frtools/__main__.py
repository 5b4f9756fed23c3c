"""The process's entry point: the console script ``frtools`` and ``python -m frtools``.

What only a process of its own may do happens here, never where a program imports frtools:
a command that analyzes may exit as soon as its output is out (``exit_at_once``), and the
per-host ``summarize`` runs without pandas."""

from __future__ import annotations

import sys

from frtools.analyze import memory
from frtools.cli import main

# Commands whose process never handles a pandas object. pyarrow imports pandas (~0.25 s, a
# quarter of a host's `frtools summarize`) on its first array conversion, only to recognize
# pandas inputs; in these commands' own processes it is told at once that pandas is absent.
WITHOUT_PANDAS = frozenset({"summarize"})


class _NoPandas:
    """A meta path finder that answers ``import pandas`` with ModuleNotFoundError (a None in
    sys.modules is not enough: pyarrow's Cython import takes it for the module)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"no pandas in this command: {name}", name=name)


def entry() -> None:
    """:func:`frtools.cli.main` in a process of its own."""
    memory.set_exits_at_once()
    if sys.argv[1:2] and sys.argv[1] in WITHOUT_PANDAS and "pandas" not in sys.modules:
        sys.meta_path.insert(0, _NoPandas())
    main()


if __name__ == "__main__":
    entry()
