"""Device facts of this host at dump time: its GPUs, the Xid lines of its kernel log, its
InfiniBand/RoCE ports and NCCL's RAS view, written as ``device_<host>.json`` beside the records
(``frtools.formats.device_facts``; docs/device-evidence.md).

Best effort, never in the dump's way: every source runs in its own thread under its own short
deadline (the constants below), a tool that does not answer in time is killed, and a source
that is absent or fails is one line in the manifest, never an error. ``start()`` begins the
collection while the dump does its own work and ``Collection.finish()`` writes what arrived.

The recorder's stall hand-off cannot import this room; it runs ``python -m
frtools.collect.device_facts DIR`` as a detached child instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from frtools.config import DEVICE_FACTS, INFINIBAND_SYSFS, KMSG
from frtools.formats import device_facts as fmt
from frtools.formats import limits
from frtools.formats.manifest import Manifest
from frtools.model.devices import GpuFacts, HostDevices, IbPort, SourceStatus

NVIDIA_SMI_DEADLINE_S = 5.0
NVML_DEADLINE_S = 5.0
KMSG_DEADLINE_S = 2.0
INFINIBAND_DEADLINE_S = 2.0
NCCLRAS_DEADLINE_S = 3.0
# the whole collection, all sources at once: a dump waits at most this long for them
TOTAL_DEADLINE_S = 6.0
MAX_KMSG_BYTES = 8 << 20  # the kernel's ring is 256 KiB-16 MiB; a saved log's newest part
SYSFS_FILE_BYTES = 4096  # what sysfs reports as the size of its attribute files
MAX_IB_DEVICES = 64
# the counters an IB/RoCE port's health shows in (counters/ under each port)
IB_COUNTERS = (
    "link_downed",
    "link_error_recovery",
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_rcv_constraint_errors",
    "port_xmit_constraint_errors",
)


class SourceFailed(Exception):
    """A source that is there but gave nothing usable; the message says why (one line)."""


class SourceAbsent(Exception):
    """A source this host does not have (no nvidia-smi, no /sys/class/infiniband)."""


def run_bounded(argv: list[str], deadline_s: float, cap: int) -> tuple[int, bytes]:
    """Run a tool, reading at most ``cap`` bytes of its output for at most ``deadline_s``;
    it is killed (its whole process group) when it overruns either."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    data = bytearray()
    end = time.monotonic() + deadline_s
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise SourceFailed(f"no answer within {deadline_s:g} s; killed")
                if not sel.select(left):
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                data += chunk
                if len(data) > cap:
                    raise SourceFailed(f"printed over {limits.size_text(cap)}; refused")
        try:
            rc = proc.wait(max(0.05, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SourceFailed(f"did not exit within {deadline_s:g} s; killed") from None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return rc, bytes(data)


def _first_line(data: bytes) -> str:
    line = data.decode("utf-8", "replace").strip().splitlines()
    return (line[0][:160] if line else "").strip()


# --- the sources -----------------------------------------------------------------------------


def nvidia_smi_gpus() -> tuple[list[GpuFacts], str]:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        raise SourceAbsent("nvidia-smi is not on PATH")
    rc, out = run_bounded([tool, "-q", "-x"], NVIDIA_SMI_DEADLINE_S, fmt.MAX_XML_BYTES)
    if rc != 0:
        raise SourceFailed(f"exited with status {rc}: {_first_line(out)}")
    try:
        gpus = fmt.parse_nvidia_smi_xml(out)
    except fmt.DeviceFactsError as exc:
        raise SourceFailed(str(exc)) from None
    return gpus, f"{len(gpus)} GPU(s)"


def nvml_gpus() -> tuple[list[GpuFacts], str]:
    """The same facts through NVML (nvidia-ml-py), where nvidia-smi is not on PATH."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        raise SourceAbsent("nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise SourceAbsent(f"NVML did not start: {exc}") from None
    try:
        gpus = [_nvml_gpu(pynvml, i) for i in range(min(pynvml.nvmlDeviceGetCount(), fmt.MAX_GPUS))]
    except Exception as exc:
        raise SourceFailed(f"NVML: {type(exc).__name__}: {exc}") from None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return gpus, f"{len(gpus)} GPU(s)"


def _nvml_gpu(nv: object, index: int) -> GpuFacts:
    n = nv  # the pynvml module

    def ask(call: Callable[[], object]) -> object:
        try:
            return call()
        except Exception:  # NVMLError_NotSupported on a GPU without the feature
            return None

    h = n.nvmlDeviceGetHandleByIndex(index)  # type: ignore[attr-defined]
    pci = ask(lambda: n.nvmlDeviceGetPciInfo(h))  # type: ignore[attr-defined]
    bus_id = getattr(pci, "busId", None)
    bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    ecc: dict[str, dict[str, int]] = {}
    for scope, counter in (("volatile", 0), ("aggregate", 1)):
        counts = {}
        for name, err, loc in (
            (
                "dram_correctable",
                0,
                2,
            ),  # NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_LOCATION_DRAM
            ("dram_uncorrectable", 1, 2),
            ("sram_correctable", 0, 7),  # NVML_MEMORY_LOCATION_SRAM
            ("sram_uncorrectable", 1, 7),
        ):
            value = ask(
                lambda e=err, c=counter, lo=loc: n.nvmlDeviceGetMemoryErrorCounter(h, e, c, lo)
            )  # type: ignore[attr-defined]
            if isinstance(value, int) and value >= 0:
                counts[name] = value
        if counts:
            ecc[scope] = counts
    rows = ask(lambda: n.nvmlDeviceGetRemappedRows(h))  # type: ignore[attr-defined]
    rows = rows if isinstance(rows, tuple) and len(rows) == 4 else (None,) * 4
    temp = ask(lambda: n.nvmlDeviceGetTemperature(h, 0))  # type: ignore[attr-defined]
    power = ask(lambda: n.nvmlDeviceGetPowerUsage(h))  # type: ignore[attr-defined]
    uuid = ask(lambda: n.nvmlDeviceGetUUID(h))  # type: ignore[attr-defined]
    name = ask(lambda: n.nvmlDeviceGetName(h))  # type: ignore[attr-defined]
    procs = ask(lambda: n.nvmlDeviceGetComputeRunningProcesses(h)) or []  # type: ignore[attr-defined]
    return GpuFacts(
        index=index,
        uuid=uuid.decode() if isinstance(uuid, bytes) else uuid if isinstance(uuid, str) else None,
        pci_bus_id=fmt.canonical_pci(bus_id),
        name=name.decode() if isinstance(name, bytes) else name if isinstance(name, str) else None,
        ecc=ecc,
        remapped_correctable=rows[0],
        remapped_uncorrectable=rows[1],
        remap_pending=bool(rows[2]) if rows[2] is not None else None,
        remap_failure=bool(rows[3]) if rows[3] is not None else None,
        temperature_c=float(temp) if isinstance(temp, (int, float)) else None,
        power_w=power / 1000.0 if isinstance(power, (int, float)) else None,
        processes=[(int(p.pid), "") for p in list(procs)[: fmt.MAX_PROCESSES]],
    )


def boot_time_s() -> float | None:
    """This host's boot time (``btime`` of ``/proc/stat``), to put kmsg times on a clock."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def kernel_events() -> tuple[list, str]:
    """Xid/SXid lines of ``FRTOOLS_KMSG`` (``/dev/kmsg``: its records, read without waiting;
    a regular file: its newest part), else of ``dmesg``."""
    path = KMSG.read()
    text, where = None, path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise SourceFailed(f"{path}: {exc.strerror or exc}") from None
    why = ""
    if st is not None and not os.path.isdir(path):
        try:
            if os.path.isfile(path):
                data = limits.read_regular(path, MAX_KMSG_BYTES, limit_name="kmsg", tail=True)
                text = data.decode("utf-8", "replace")
            else:
                text = _read_kmsg_device(path)
        except PermissionError:
            why = f"{path} is not readable by this user"
        except (OSError, limits.InputRefused) as exc:
            why = f"{path}: {getattr(exc, 'strerror', None) or exc}"
    elif st is None:
        why = f"{path} does not exist"
    if text is None and path == KMSG.default and (tool := shutil.which("dmesg")):
        rc, out = run_bounded([tool], KMSG_DEADLINE_S, MAX_KMSG_BYTES)
        if rc == 0:
            text, where = out.decode("utf-8", "replace"), "dmesg"
        else:
            why += f"; dmesg: {_first_line(out) or f'status {rc}'}"
    if text is None:
        if st is None:
            raise SourceAbsent(why)
        raise SourceFailed(why + " (kernel.dmesg_restrict?)")
    events = fmt.parse_kernel_log(text, boot_time_s())
    return events, f"{len(events)} Xid/SXid line(s) in {where}"


def _read_kmsg_device(path: str) -> str:
    """Every record the kernel still holds in ``/dev/kmsg``, without blocking on new ones."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    records: list[bytes] = []
    size, end = 0, time.monotonic() + KMSG_DEADLINE_S
    try:
        while size < MAX_KMSG_BYTES and time.monotonic() < end:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while read: go on with the next
                    continue
                raise
            if not record:
                break
            records.append(record)
            size += len(record)
    finally:
        os.close(fd)
    return b"".join(records).decode("utf-8", "replace")


def _sysfs(path: Path) -> str | None:
    try:
        data = limits.read_regular(path, SYSFS_FILE_BYTES, limit_name="sysfs attribute")
    except (OSError, limits.InputRefused):
        return None
    return data.decode("utf-8", "replace").strip()


def ib_ports() -> tuple[list[IbPort], str]:
    """Port state and error counters under ``FRTOOLS_INFINIBAND_SYSFS``
    (``<device>/ports/<n>/``)."""
    root = Path(INFINIBAND_SYSFS.read())
    if not root.is_dir():
        raise SourceAbsent(f"{root} does not exist (no InfiniBand/RoCE devices)")
    ports: list[IbPort] = []
    end = time.monotonic() + INFINIBAND_DEADLINE_S
    for device in sorted(root.iterdir())[:MAX_IB_DEVICES]:
        for port_dir in sorted((device / "ports").glob("*")):
            if not port_dir.name.isdigit() or len(ports) >= fmt.MAX_IB_PORTS:
                continue
            if time.monotonic() > end:
                raise SourceFailed(f"reading {root} took over {INFINIBAND_DEADLINE_S:g} s")
            counters = {}
            for name in IB_COUNTERS:
                value = _sysfs(port_dir / "counters" / name)
                if value is not None and value.isdigit() and len(value) < 20:
                    counters[name] = int(value)
            state = _sysfs(port_dir / "state")
            phys = _sysfs(port_dir / "phys_state")
            ports.append(
                IbPort(
                    device=device.name[:64],
                    port=int(port_dir.name[:5]),
                    state=state.split(":", 1)[-1].strip()[:40] if state else None,
                    phys_state=phys.split(":", 1)[-1].strip()[:40] if phys else None,
                    link_layer=(_sysfs(port_dir / "link_layer") or "")[:40] or None,
                    counters=counters,
                )
            )
    return ports, f"{len(ports)} port(s) under {root}"


def ncclras_text() -> tuple[str, str]:
    tool = shutil.which("ncclras")
    if tool is None:
        raise SourceAbsent("ncclras (NCCL >= 2.24) is not on PATH")
    rc, out = run_bounded([tool], NCCLRAS_DEADLINE_S, fmt.MAX_NCCLRAS_BYTES)
    if rc != 0:
        raise SourceFailed(f"exited with status {rc}: {_first_line(out)}")
    return out.decode("utf-8", "replace"), f"{len(out)} bytes"


# --- the collection --------------------------------------------------------------------------


class Collection:
    """The sources running in the background; ``finish`` writes what came in time."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.started_ns = time.time_ns()
        self.started = time.monotonic()
        self.results: dict[str, tuple[str, object, str]] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._source, args=(name, fn), daemon=True, name=f"frtools-{name}"
            )
            for name, fn in (
                ("gpus", self._gpus),
                ("kmsg", kernel_events),
                ("infiniband", ib_ports),
                ("ncclras", ncclras_text),
            )
        ]
        for t in self._threads:
            t.start()

    def _gpus(self) -> tuple[object, str]:
        try:
            return nvidia_smi_gpus()
        except SourceAbsent as smi_absent:
            try:
                gpus, detail = nvml_gpus()
            except SourceAbsent as exc:
                raise SourceAbsent(f"{smi_absent}; {exc}") from None
            return gpus, f"{detail} (NVML)"

    def _source(self, name: str, fn: Callable[[], tuple[object, str]]) -> None:
        try:
            value, detail = fn()
            result = ("collected", value, detail)
        except SourceAbsent as exc:
            result = ("absent", None, str(exc))
        except SourceFailed as exc:
            result = ("failed", None, str(exc))
        except Exception as exc:  # a source never takes the dump down
            result = ("failed", None, f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.results[name] = result

    def facts(self, deadline_s: float = TOTAL_DEADLINE_S) -> HostDevices:
        end = self.started + deadline_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        with self._lock:
            results = dict(self.results)
        facts = HostDevices(host=self.host, collected_ns=self.started_ns)
        for name in ("gpus", "kmsg", "infiniband", "ncclras"):
            status, value, detail = results.get(
                name, ("failed", None, f"no answer within {deadline_s:g} s")
            )
            source = name
            if name == "gpus":
                source = "nvml" if detail.endswith("(NVML)") else "nvidia-smi"
                if value is not None:
                    facts.gpus = list(value)  # type: ignore[call-overload]
            elif name == "kmsg" and value is not None:
                facts.kernel_events = list(value)  # type: ignore[call-overload]
            elif name == "infiniband" and value is not None:
                facts.ib_ports = list(value)  # type: ignore[call-overload]
            elif name == "ncclras" and isinstance(value, str):
                facts.ncclras = value
            facts.sources.append(SourceStatus(source=source, status=status, detail=detail))
        return facts

    def finish(
        self,
        out_dir: str | os.PathLike[str],
        manifest: Manifest | None = None,
        deadline_s: float = TOTAL_DEADLINE_S,
    ) -> Path | None:
        """Write ``device_<host>.json`` into ``out_dir`` with what came within ``deadline_s``
        of the start (the dump's own timeout bounds it); one manifest note per source that is
        absent or failed. Never raises: a file that cannot be written is a note too."""
        facts = self.facts(min(deadline_s, TOTAL_DEADLINE_S))
        if manifest is not None:
            for s in facts.sources:
                if s.status != "collected":
                    manifest.notes.append(
                        f"device facts on {self.host}: {s.source} {s.status}: {s.detail}"
                    )
        try:
            return fmt.write(out_dir, facts)
        except OSError as exc:
            if manifest is not None:
                manifest.notes.append(f"device facts on {self.host} not written: {exc}")
            return None


def start(host: str | None = None) -> Collection | None:
    """Begin collecting (None when ``FRTOOLS_DEVICE_FACTS=0``)."""
    return Collection(host) if DEVICE_FACTS.read() else None


def main(argv: list[str] | None = None) -> int:
    """``python -m frtools.collect.device_facts DIR``: write this host's facts into DIR (the
    recorder's stall hand-off runs this as a detached child)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m frtools.collect.device_facts DIR", file=sys.stderr)
        return 2
    collection = start()
    if collection is None:
        return 0
    return 0 if collection.finish(args[0]) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
