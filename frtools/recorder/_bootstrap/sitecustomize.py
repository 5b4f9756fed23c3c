"""Put on PYTHONPATH by ``frtools run``: every Python process of the job records.

Runs any ``sitecustomize`` that was already on the path first (the one this shadows), then,
when ``FRTOOLS_RECORD=1``, arranges for ``frtools.recorder.enable()`` to run as soon as
``torch.distributed`` is imported. Never raises: a broken recorder must not stop the job.
"""

import os
import sys


def _chain_previous_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _chain_previous_sitecustomize()
except Exception as _exc:
    print(f"frtools: the previous sitecustomize failed: {_exc!r}", file=sys.stderr)

try:
    from frtools.config import RECORD

    if RECORD.read():
        from frtools.recorder import enable_on_torch_distributed_import

        enable_on_torch_distributed_import()
except Exception as _exc:
    print(f"frtools: recording disabled: {_exc!r}", file=sys.stderr)
