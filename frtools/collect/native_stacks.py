"""Native stacks of live ranks, taken from outside with py-spy (``py-spy dump --native``).

faulthandler's stacks stop at the last Python frame: a rank spinning inside the NCCL enqueue
call, waiting inside Gloo's connect or a CUDA call shows a Python line that says nothing.
py-spy reads the C/C++ frames under it through ptrace, without changing the process (it
pauses it for about a second). It is an optional extra (``pip install 'frtools[native-stacks]'``):
without it, one line says how to get them (``HINT``).

Every process is sampled at once and waited for together, bounded by one deadline; a py-spy
that does not finish in time is killed, so a wedged ptrace never holds up the dump. What
py-spy prints is kept as it came (its JSON, at most ``limits.native_stacks_bytes``) in
``rank_<R>.native``, created private (0600); the analyzer parses it as untrusted text.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from frtools.formats import limits
from frtools.formats.manifest import NATIVE_STACKS_SUFFIX, Manifest, RankEntry, rank_file_name

HINT = (
    "native stacks (C++ frames under Python: NCCL, Gloo, CUDA) need py-spy: "
    "`pip install py-spy` (frtools' native-stacks extra); in a container ptrace may also need "
    "`--cap-add SYS_PTRACE`, on a host `sysctl kernel.yama.ptrace_scope=0` or root"
)
# py-spy resolves libtorch's symbols on its first sample: about a second on an idle host
MIN_SECONDS = 2.0


@dataclass
class NativeResult:
    """One rank's native stacks: the JSON py-spy printed, or why there is none."""

    rank: int
    pid: int
    text: str = ""
    error: str = ""


def find_py_spy() -> str | None:
    """The py-spy executable on PATH, else the one installed beside this Python (a venv's
    ``bin`` that is not on PATH); None without one."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


def take(
    pids: dict[int, int], timeout: float, py_spy: str | None = None
) -> dict[int, NativeResult]:
    """Run ``py-spy dump --native --json`` on every rank's process (rank -> pid) at once,
    each bounded by one shared deadline (``timeout`` s, at least ``MIN_SECONDS``)."""
    exe = py_spy or find_py_spy()
    results = {rank: NativeResult(rank=rank, pid=pid) for rank, pid in pids.items()}
    if exe is None:
        for r in results.values():
            r.error = "py-spy not installed"
        return results
    cap = limits.current().native_stacks_bytes
    running: dict[int, tuple[subprocess.Popen, IO[bytes], IO[bytes]]] = {}
    for rank, pid in pids.items():
        out = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
        err = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                [exe, "dump", "--native", "--json", "--pid", str(pid)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        except OSError as exc:
            results[rank].error = f"cannot run py-spy: {exc.strerror or exc}"
            out.close()
            err.close()
            continue
        running[rank] = (proc, out, err)
    deadline = time.monotonic() + max(timeout, MIN_SECONDS)
    for rank, (proc, out, err) in running.items():
        result = results[rank]
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            # py-spy attaches with ptrace, which stops the target: killed mid-way it may
            # leave the rank stopped, and a stopped rank is a hang of our making
            with contextlib.suppress(OSError):
                os.kill(result.pid, signal.SIGCONT)
            result.error = f"py-spy did not finish within {max(timeout, MIN_SECONDS):g} s"
        else:
            result.text, result.error = _answer(proc.returncode, out, err, cap)
        finally:
            out.close()
            err.close()
    return results


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _answer(returncode: int, out: IO[bytes], err: IO[bytes], cap: int) -> tuple[str, str]:
    """(JSON text, "") from a finished py-spy, or ("", one-line reason)."""
    size = out.seek(0, os.SEEK_END)
    if returncode != 0:
        err.seek(0)
        lines = err.read(4096).decode("utf-8", errors="replace").strip().splitlines()
        first = lines[-1][:200] if lines else f"exit status {returncode}"
        if "ermission" in first or "ptrace" in first.lower():
            first += " (ptrace: run as the job's user or root, `--cap-add SYS_PTRACE`)"
        return "", f"py-spy failed: {first}"
    if size > cap:
        return "", f"py-spy's answer is {limits.size_text(size)}, above native_stacks_bytes"
    out.seek(0)
    text = out.read(cap).decode("utf-8", errors="replace")
    if not text.lstrip().startswith("["):
        return "", "py-spy printed no JSON stacks (py-spy older than 0.3.3?)"
    return text, ""


def write_private(directory: Path, name: str, text: str) -> None:
    """Write ``directory/name`` readable by this user only (0600), atomically: a temporary
    file of ``mkstemp`` (0600, never through a link) renamed over the name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def take_for(pids: dict[int, int], manifest: Manifest, timeout: float) -> dict[int, NativeResult]:
    """``take`` for the ranks of a collection (rank -> pid of a process alive on this host);
    without py-spy, one note in the manifest says how to get native stacks."""
    if not pids:
        return {}
    exe = find_py_spy()
    if exe is None:
        manifest.notes.append(HINT)
        return {}
    return take(pids, timeout, exe)


def keep(result: NativeResult | None, entry: RankEntry, out: Path) -> None:
    """Write one rank's native stacks into ``out`` (``rank_<R>.native``, listed in
    ``entry.files``), or say in ``entry.note`` why there are none."""
    if result is None:
        return
    if result.error:
        entry.note = "; ".join(x for x in (entry.note, f"no native stacks: {result.error}") if x)
        return
    name = rank_file_name(entry.rank, NATIVE_STACKS_SUFFIX)
    try:
        write_private(out, name, result.text)
    except OSError as exc:
        entry.note = "; ".join(x for x in (entry.note, f"{name} not written: {exc}") if x)
        return
    entry.files.append(name)
