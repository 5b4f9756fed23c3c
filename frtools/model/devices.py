"""What a host's devices looked like when its records were collected: its GPUs (nvidia-smi or
NVML), the Xid/SXid lines of its kernel log, its InfiniBand/RoCE ports and NCCL's RAS view.

The Trace carries one ``HostDevices`` per host (``Trace.devices``) so the analyzer can ask of a
guilty rank: is it the machine or the code? ``formats/device_facts.py`` reads and writes the
file these come from (``device_<host>.json``); docs/device-evidence.md describes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# a source's status in ``SourceStatus.status``
SOURCE_STATUSES = ("collected", "absent", "failed")
SOURCES = ("nvidia-smi", "nvml", "kmsg", "infiniband", "ncclras")


@dataclass(frozen=True, kw_only=True)
class SourceStatus:
    """How one source fared on one host: ``collected``, ``absent`` (not there: no nvidia-smi,
    no ``/sys/class/infiniband``) or ``failed`` (there, but it timed out, was refused, ...)."""

    source: str
    status: str
    detail: str = ""


@dataclass(kw_only=True)
class GpuFacts:
    """One GPU as nvidia-smi / NVML reported it. Counters are None where not reported (a GPU
    without ECC, a field 'N/A')."""

    index: int
    uuid: str | None = None
    pci_bus_id: str | None = None  # canonical: "0000:47:00.0" (lower case, 4-digit domain)
    name: str | None = None
    # "volatile" / "aggregate" -> {"sram_correctable", "sram_uncorrectable",
    # "dram_correctable", "dram_uncorrectable"} -> count
    ecc: dict[str, dict[str, int]] = field(default_factory=dict)
    retired_single_bit: int | None = None
    retired_double_bit: int | None = None
    retirement_pending: bool | None = None
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    throttle_reasons: list[str] = field(default_factory=list)  # the active ones
    temperature_c: float | None = None
    power_w: float | None = None
    processes: list[tuple[int, str]] = field(default_factory=list)  # (pid, name)


@dataclass(frozen=True, kw_only=True)
class KernelEvent:
    """One Xid (GPU) or SXid (NVSwitch) line of the kernel log."""

    kind: str  # "xid" | "sxid"
    code: int
    pci_bus_id: str | None  # canonical, function 0 when the log names none
    time: str | None  # as the log gives it: wall clock, or seconds since boot
    text: str  # the message after the code, shortened
    fatal: bool | None = None  # SXid lines say Fatal / Non-fatal


@dataclass(frozen=True, kw_only=True)
class IbPort:
    """One InfiniBand/RoCE port under ``/sys/class/infiniband/<device>/ports/<port>``."""

    device: str
    port: int
    state: str | None  # "ACTIVE", "DOWN", ... (the word after "4: ")
    phys_state: str | None  # "LinkUp", "Disabled", ...
    link_layer: str | None  # "InfiniBand" | "Ethernet"
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class HostDevices:
    """Every device fact of one host, as collected at dump time."""

    host: str
    collected_ns: int | None = None
    sources: list[SourceStatus] = field(default_factory=list)
    gpus: list[GpuFacts] = field(default_factory=list)
    kernel_events: list[KernelEvent] = field(default_factory=list)
    ib_ports: list[IbPort] = field(default_factory=list)
    ncclras: str | None = None  # ncclras' text output, bounded
    path: str = ""  # the file these were read from

    def gpu_by_pci(self, pci_bus_id: str) -> GpuFacts | None:
        """The GPU at a canonical PCI bus id; a log's id without a function matches any."""
        for gpu in self.gpus:
            if gpu.pci_bus_id and gpu.pci_bus_id.split(".")[0] == pci_bus_id.split(".")[0]:
                return gpu
        return None

    def gpu_by_index(self, index: int) -> GpuFacts | None:
        return next((g for g in self.gpus if g.index == index), None)
