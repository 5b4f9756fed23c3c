"""The process-group hook body in C++ (torch >= 2.15): built on demand, used when built.

The hooks of ``capture.hooks`` run a Python pre/post pair per op by default. The C++ body
(``_native/pg_hooks.cpp``) records the same ops with the same records without taking the
GIL per op. It is compiled against the installed torch's C++ API, whose ABI changes with
every torch build, so it is not built at install time (pip builds frtools without torch):
``build()`` compiles it with ``torch.utils.cpp_extension`` into a private per-user cache
folder keyed by torch's version, Python's and the source's hash, once per machine (a file
lock keeps concurrent ranks from building twice).

``FRTOOLS_NATIVE_HOOKS``: ``auto`` (default) uses it when it is already built, ``1`` builds
it at the first group if missing (about a minute, once), ``0`` never uses it. Build ahead::

    python -m frtools.recorder.native_hooks build

Anything that goes wrong (no compiler, a build error, another torch's build, torch < 2.15)
falls back to the Python hooks with one warning; the job goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import stat
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from frtools.config import CACHE_DIR, NATIVE_HOOKS

__all__ = ["build", "cache_dir", "load", "status"]

_NATIVE = Path(__file__).parent / "_native"
SOURCES = (_NATIVE / "pg_hooks.cpp", _NATIVE / "box_api.h")

_module: ModuleType | None = None
_failure: str | None = None
_warned = False


class NativeHooksUnavailable(RuntimeError):
    """The C++ hook body cannot be used here (the message says why)."""


def _key() -> str:
    """What a build depends on: torch's exact build, Python's version, the sources."""
    import torch

    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{torch.version.git_version}|{sys.version}".encode())
    h.update(str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")).encode())
    for path in SOURCES:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def module_name() -> str:
    return f"frtools_pg_hooks_{_key()}"


def cache_dir() -> Path:
    """``$FRTOOLS_CACHE_DIR``, else ``$XDG_CACHE_HOME/frtools``, else ``~/.cache/frtools``;
    the build lives in ``native_hooks/<module name>`` below it."""
    base = CACHE_DIR.read()
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
        base = os.path.join(xdg, "frtools") if xdg else os.path.expanduser("~/.cache/frtools")
    return Path(base) / "native_hooks" / module_name()


def _private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) 0700, and refuse it unless it is this user's own
    directory that nobody else can write: a shared object loaded from it runs as us."""
    for part in reversed([path, *path.parents]):
        if not part.exists():
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise NativeHooksUnavailable(f"{path} is not a directory of this user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    parent = os.lstat(path.parent)
    if parent.st_uid != os.geteuid() or parent.st_mode & 0o022:
        raise NativeHooksUnavailable(f"{path.parent} is writable by others")
    return path


def _built(directory: Path) -> Path | None:
    so = directory / f"{module_name()}.so"
    return so if so.is_file() else None


def _import(so: Path) -> ModuleType:
    name = so.stem
    if name in sys.modules:  # build() has imported it (a second import would fail)
        return sys.modules[name]
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
    if spec is None:
        raise NativeHooksUnavailable(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _check_torch() -> None:
    from frtools.recorder.capture import c10d_internals

    if not c10d_internals.has_process_group_hooks():
        raise NativeHooksUnavailable("this torch has no process-group hooks (torch < 2.15)")


def build(verbose: bool = False) -> Path:
    """Compile the C++ hook body for this torch (once: an existing build is kept); returns
    the shared object's path. Raises on any failure."""
    import fcntl

    _check_torch()
    directory = _private_dir(cache_dir())
    so = _built(directory)
    if so is not None:
        return so
    with open(directory / "frtools-build.lock", "w") as lock:
        # another rank of this machine may be building (not "lock": cpp_extension's own baton)
        fcntl.flock(lock, fcntl.LOCK_EX)
        so = _built(directory)
        if so is not None:
            return so
        # a baton left by a killed build would make cpp_extension wait for ever; we hold the
        # only right to build here
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / "lock")
        from torch.utils import cpp_extension

        cpp_extension.load(
            module_name(),
            [str(SOURCES[0])],
            extra_include_paths=[str(_NATIVE)],
            extra_cflags=["-O2", "-fvisibility=hidden"],
            build_directory=str(directory),
            verbose=verbose,
        )
    so = _built(directory)
    if so is None:
        raise NativeHooksUnavailable(f"the build left no {module_name()}.so in {directory}")
    return so


def load(build_if_missing: bool | None = None) -> ModuleType | None:
    """The C++ hook module, or None: not built (and not asked to build), switched off, or
    unusable (said once with a warning). ``build_if_missing``: None reads
    ``FRTOOLS_NATIVE_HOOKS``."""
    global _module, _failure
    if _module is not None:
        return _module
    mode = NATIVE_HOOKS.read()
    if mode == "off":
        return None
    if build_if_missing is None:
        build_if_missing = mode == "on"
    if _failure is not None:
        return None
    try:
        _check_torch()
        so = _built(cache_dir())
        if so is None:
            if not build_if_missing:
                return None
            so = build()
        _module = _import(so)
    except Exception as exc:
        _failure = f"{type(exc).__name__}: {exc}"
        _warn(_failure)
        return None
    return _module


def _warn(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    with contextlib.suppress(Exception):
        warnings.warn(
            f"frtools: the C++ process-group hooks cannot be used ({reason}); recording "
            "with the Python hooks",
            RuntimeWarning,
            stacklevel=3,
        )


def unusable(exc: BaseException) -> None:
    """The built module failed when used: the Python hooks record from now on (said once)."""
    global _failure
    _failure = f"{type(exc).__name__}: {exc}"
    _warn(_failure)


def status() -> str:
    """One line: built or not, where."""
    try:
        _check_torch()
    except Exception as exc:
        return f"unavailable: {exc}"
    so = _built(cache_dir())
    return f"built: {so}" if so is not None else f"not built (would go to {cache_dir()})"


def recorder_body(recorder: Any, module: ModuleType) -> Any:
    """The native side of a ``Recorder``: its box, stack interning and failure switch."""
    from frtools.recorder.capture import hot_path

    def fail(why: str) -> None:
        recorder.fail(RuntimeError(why))

    body = module.Recorder(
        recorder.box,
        recorder.stack_miss,
        fail,
        recorder.watch_cuda,
        hot_path.__file__,
        hot_path.STACK_DEPTH,
        recorder.cuda_events,
        max(1, int(recorder._poll_s * 1000)),
    )
    body.set_stacks(recorder.stack_lookup is not hot_path._no_stack)
    body.set_enabled(recorder.enabled)
    return body


def main(argv: list[str] | None = None) -> int:
    import time

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["build"]:
        start = time.monotonic()
        try:
            so = build(verbose="-v" in args)
        except Exception as exc:
            print(f"frtools: native hooks not built: {type(exc).__name__}: {exc}")
            return 1
        print(f"frtools: native hooks built in {time.monotonic() - start:.0f} s: {so}")
        return 0
    if args[:1] == ["status"]:
        print(f"frtools: native hooks {status()}")
        return 0
    print("usage: python -m frtools.recorder.native_hooks build [-v] | status")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
