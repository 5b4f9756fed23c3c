"""``pytest --frtools``: distributed tests that hang or fail say which rank was to blame.

Installed with frtools (entry point ``pytest11``: ``frtools``) and inert until
``--frtools`` is given. Then, for each test:

* every Python process the test starts (ranks spawned with ``subprocess``, ``torchrun``,
  ``torch.multiprocessing.spawn``) records its c10d ops, as under ``frtools run``:
  ``FRTOOLS_RECORD=1`` and the recorder's bootstrap on ``PYTHONPATH``, with a private
  ``FRTOOLS_DIR`` and a per-test ``FRTOOLS_JOB_ID``;
* when the test times out (pytest-timeout), the plugin collects the ranks' black boxes and
  stacks *at the deadline, while the hung ranks are still alive*, then lets pytest-timeout
  do what its method does: ``signal`` fails the test, ``thread`` dumps the threads and
  ends the process. It wraps pytest-timeout's own handlers (``timeout_sigalrm``,
  ``timeout_timer``) through the ``pytest_timeout_set_timer`` hook, so the order is
  always: collect, diagnose, print / attach the verdict, then time out;
* when the test fails otherwise (a collective error, a rank that exited) and its ranks
  left black boxes, they are collected after the failure;
* the verdict (kind, guilty rank, group, call site) is added to the test's report as a
  ``frtools`` section, and the collected folder — rank files, stacks, ``verdict.txt``,
  ``verdict.json``, ``report.html`` — is kept under ``--frtools-dir`` for the CI artifact.
  Passing tests keep nothing. That folder is created 0700, or must be the user's own and
  writable by nobody else (as ``frtools dump -o``); its files are new 0600 files, never
  written through a link.

With the ``thread`` method pytest itself is ended by ``os._exit``: the verdict is then
printed to the terminal before that, and the test's ranks that are still alive are
killed (they would otherwise outlive the run, hung) and the plugin's live folder
(``/dev/shm/frtools-pytest-*``) removed. With ``signal`` the test's own
clean-up runs; ranks of a timed-out test still alive after its teardown are killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from frtools.analyze.reporters import escape
from frtools.config import DIR, JOB_ID, RECORD
from frtools.formats.private_files import own_folder, write_new

# how long live ranks get to answer a dump request (stacks) at collection
COLLECT_TIMEOUT = 5.0
DEFAULT_KEEP_DIR = "frtools-dumps"
_ENV_KEYS = (RECORD.name, DIR.name, JOB_ID.name, "PYTHONPATH")
_BOOTSTRAP = str(Path(__file__).resolve().parent / "recorder" / "_bootstrap")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("frtools", "frtools: flight recorder for distributed tests")
    group.addoption(
        "--frtools",
        action="store_true",
        default=False,
        help="Record every rank the tests start; on a timeout, hang or collective error add "
        "frtools' verdict (guilty rank, group, call site) to the test's report.",
    )
    group.addoption(
        "--frtools-dir",
        default=None,
        metavar="DIR",
        help=f"Where the records of failed tests are kept (default: ./{DEFAULT_KEEP_DIR}).",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--frtools"):
        keep = Path(config.getoption("--frtools-dir") or DEFAULT_KEEP_DIR).resolve()
        config.pluginmanager.register(FrtoolsSession(config, keep), "frtools-session")


@dataclass
class Finding:
    """What the plugin found for one test."""

    text: str  # the section shown in the report
    folder: Path | None
    kind: str | None = None
    guilty: str = ""


def job_id_for(nodeid: str) -> str:
    """A job folder name for a test: readable, bounded, unique (a hash of the node id)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("._")[:80] or "test"
    return f"{slug}-{zlib.crc32(nodeid.encode()):08x}"


class FrtoolsSession:
    """The plugin's state for one pytest run (registered only with ``--frtools``)."""

    def __init__(self, config: pytest.Config, keep_dir: Path) -> None:
        self.config = config
        self.keep_dir = keep_dir
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.live_dir = Path(tempfile.mkdtemp(prefix="frtools-pytest-", dir=base))
        # also when the run ends without pytest_unconfigure (exit paths that skip it)
        atexit.register(shutil.rmtree, self.live_dir, ignore_errors=True)
        self.findings: dict[str, Finding] = {}
        self.timed_out: set[str] = set()
        self._lock = threading.Lock()

    # --- every test runs with recording on in the processes it starts ---------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Any:
        saved = {k: os.environ.get(k) for k in _ENV_KEYS}
        job = job_id_for(item.nodeid)
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [_BOOTSTRAP, *[p for p in parts if p != _BOOTSTRAP]]
        )
        os.environ[RECORD.name] = "1"
        os.environ[DIR.name] = str(self.live_dir)
        os.environ[JOB_ID.name] = job
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            job_dir = self.live_dir / job
            if item.nodeid in self.timed_out:
                kill_ranks(job_dir)
            shutil.rmtree(job_dir, ignore_errors=True)

    # --- timeouts: collect at the deadline, then let pytest-timeout act -------------

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        try:
            import pytest_timeout
        except ImportError:
            return None
        on_signal = getattr(pytest_timeout, "timeout_sigalrm", None)
        on_thread = getattr(pytest_timeout, "timeout_timer", None)
        method = settings.method
        if method == "signal" and threading.current_thread() is not threading.main_thread():
            method = "thread"
        if method == "signal" and on_signal is not None:

            def handler(signum: int, frame: Any) -> None:
                __tracebackhide__ = True
                self._on_timeout(item, print_now=False)
                on_signal(item, settings)

            def cancel() -> None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_DFL)

            item.cancel_timeout = cancel  # type: ignore[attr-defined]
            signal.signal(signal.SIGALRM, handler)
            signal.setitimer(signal.ITIMER_REAL, settings.timeout)
            return True
        if method == "thread" and on_thread is not None:

            def expire() -> None:
                self._on_timeout(item, print_now=True)
                kill_ranks(self.live_dir / job_id_for(item.nodeid))
                # os._exit(1) follows: no unconfigure, no atexit; the live folder goes now
                shutil.rmtree(self.live_dir, ignore_errors=True)
                on_thread(item, settings)  # dumps the threads, then os._exit(1)

            timer = threading.Timer(settings.timeout, expire)
            timer.name = f"frtools timeout {item.nodeid}"
            timer.daemon = True

            def cancel_timer() -> None:
                timer.cancel()
                if timer is not threading.current_thread():
                    timer.join()

            item.cancel_timeout = cancel_timer  # type: ignore[attr-defined]
            timer.start()
            return True
        return None  # an unknown method: pytest-timeout's own; collected after the failure

    def _on_timeout(self, item: pytest.Item, print_now: bool) -> None:
        with self._lock:
            self.timed_out.add(item.nodeid)
        finding = self.collect(item, "timed out")
        if finding is None:
            return
        with self._lock:
            self.findings[item.nodeid] = finding
        if print_now:  # the process ends right after: write past the output capture
            self._print_now(finding)

    def _print_now(self, finding: Finding) -> None:
        capman = self.config.pluginmanager.getplugin("capturemanager")
        writer = self.config.get_terminal_writer()
        try:
            if capman is not None:
                capman.suspend_global_capture(in_=True)
            writer.line()
            writer.sep("=", "frtools verdict")
            writer.line(finding.text)
            writer.flush()
        except Exception:  # noqa: BLE001 - the report must never break the run
            pass

    # --- the report ------------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        outcome = yield
        report = outcome.get_result()
        if not report.failed:
            return
        with self._lock:
            finding = self.findings.get(item.nodeid)
        if finding is None and report.when in ("setup", "call"):
            finding = self.collect(item, "failed")
            if finding is not None:
                with self._lock:
                    self.findings[item.nodeid] = finding
        if finding is not None and not getattr(item, "_frtools_reported", False):
            report.sections.append(("frtools verdict", finding.text))
            item._frtools_reported = True  # type: ignore[attr-defined]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.findings:
            return
        terminalreporter.write_sep("=", "frtools")
        for nodeid, f in self.findings.items():
            what = f"{(f.kind or 'no verdict').upper()}"
            if f.guilty:
                what += f", guilty {f.guilty}"
            where = f" -> {f.folder}" if f.folder is not None else ""
            terminalreporter.write_line(escape.line(f"{nodeid}: {what}{where}"))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        shutil.rmtree(self.live_dir, ignore_errors=True)

    # --- collecting and diagnosing one test's ranks ---------------------------------

    def collect(self, item: pytest.Item, why: str) -> Finding | None:
        """Collect the test's ranks, diagnose them and keep the folder; None when the test
        started no recorded rank. Never raises: a broken analysis is told, not thrown."""
        job = job_id_for(item.nodeid)
        job_dir = self.live_dir / job
        if not job_dir.is_dir() or not any(job_dir.glob("rank_*.frt")):
            return None
        out = self.keep_dir / job
        started = time.monotonic()
        try:
            from frtools.collect.local import collect_job

            own_folder(self.keep_dir)  # --frtools-dir: ours and private, or refused
            if out.exists():
                shutil.rmtree(out)
            collect_job(job_dir, out, COLLECT_TIMEOUT)
        except Exception as e:  # noqa: BLE001
            text = escape.line(f"frtools: the test {why}; collecting its ranks failed: {e}")
            return Finding(text, None)
        try:
            return self._diagnose(out, why, started)
        except Exception as e:  # noqa: BLE001
            text = f"frtools: the test {why}; its records are in {out}, the analysis failed: {e}"
            return Finding(escape.line(text), out)

    def _diagnose(self, out: Path, why: str, started: float) -> Finding:
        from frtools.analyze.diagnose import align_and_diagnose
        from frtools.analyze.readers import load_trace
        from frtools.analyze.reporters import html, json_report, terminal
        from frtools.model.ranks import format_ranks

        trace = load_trace(out)
        alignment, verdict = align_and_diagnose(trace)
        text = terminal.render(verdict, width=100).rstrip("\n")
        write_new(out / "verdict.txt", text + "\n")
        write_new(out / "verdict.json", json_report.render(verdict))
        with contextlib.suppress(Exception):
            write_new(out / "report.html", html.render(verdict, trace, alignment, source=str(out)))
        took = time.monotonic() - started
        footer = (
            f"\n(the test {why}; {len(trace.ranks)} rank(s) collected and diagnosed in "
            f"{took:.1f} s; records, verdict.txt and report.html in {out})"
        )
        return Finding(
            text + footer,
            out,
            kind=verdict.kind,
            guilty=format_ranks(verdict.guilty_ranks) if verdict.guilty else "",
        )


def kill_ranks(job_dir: Path) -> list[int]:
    """SIGKILL the processes whose black boxes are in ``job_dir`` and are still running
    (a timed-out test's hung ranks); returns their pids."""
    if not job_dir.is_dir():
        return []
    from frtools.collect.local import pid_alive
    from frtools.formats.blackbox import SnapshotError, read_header

    killed = []
    for path in job_dir.glob("rank_*.frt"):
        try:
            header = read_header(path)
        except (OSError, SnapshotError):
            continue
        ident = header.get("identity") or {}
        pid = ident.get("pid") or header.get("owner_pid")
        if not isinstance(pid, int) or pid <= 1 or pid == os.getpid() or not pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed
