"""The join of the verdict to the machines: each guilty rank -> its host and GPU, and what was
abnormal there when the records were collected (``Trace.devices``; docs/device-evidence.md).

A rank's GPU is the one its recorder named (``RankInfo.device_id``: PCI bus id or UUID); a
rank without one (a CPU job, a PyTorch dump) stands on its local rank's place in the host's GPU
list, as ``torchrun`` gives rank ``cuda:LOCAL_RANK`` — the verdict says that GPU was inferred.
What counts as hardware (the evidence a drain rests on) is decided here, by the tables below;
the rules that turn it into an action are ``analyze/action.py``'s.
"""

from __future__ import annotations

from frtools.analyze.verdict import DeviceFinding, GuiltyRank, Verdict
from frtools.formats.device_facts import canonical_pci
from frtools.model.devices import GpuFacts, HostDevices
from frtools.model.trace import RankInfo, Trace

# Xid codes NVIDIA documents as a hardware, bus, memory (ECC) or GPU-firmware fault: each is
# evidence against the GPU (docs/actions.md, "Xid codes"). Meanings as NVIDIA's Xid catalog
# words them.
XID_HARDWARE = {
    48: "double bit ECC error (DBE)",
    54: "auxiliary power is not connected to the GPU board",
    57: "error programming video memory interface",
    58: "unstable video memory interface detected",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# Xid codes that are usually the application's (an illegal access, a killed channel): shown,
# not held against the GPU
XID_SOFTWARE = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
}
# clock-event reasons that say the GPU slowed itself (a straggler's hint, not a drain)
SLOWDOWN_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
)
# IB/RoCE error counters shown when non-zero (they count since the port's last reset, so they
# are a hint, not evidence: only a port that is not ACTIVE counts against the host)
IB_ERROR_COUNTERS = (
    "link_downed",
    "link_error_recovery",
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
MAX_FINDINGS_PER_RANK = 12
NCCLRAS_WORDS = ("error", "fail", "dead", "unreachable", "unresponsive", "timeout", "missing")


def attach_device_evidence(verdict: Verdict, trace: Trace) -> None:
    """Fill each guilty rank's GPU and findings, the verdict's ``device_sources`` and one
    evidence line per hardware finding. Nothing changes when the inputs held no device facts."""
    for g in verdict.guilty:
        info = trace.ranks.get(g.rank)
        if info is not None and info.host_guessed and g.host == info.host:
            g.host_guessed = True
    if not trace.devices:
        return
    verdict.device_sources = [
        f"{host}: {s.source} {s.status}" + (f" ({s.detail})" if s.detail else "")
        for host, facts in sorted(trace.devices.items())
        for s in facts.sources
    ]
    for g in verdict.guilty:
        facts = _host_facts(g, trace)
        if facts is None:
            continue
        gpu = _place(g, trace.ranks.get(g.rank), facts)
        g.findings = _findings(facts, gpu)[:MAX_FINDINGS_PER_RANK]
        for f in g.findings:
            if f.hardware:
                verdict.evidence.append(f"Rank {g.rank} on {f.host}: {f.text}.")


def _host_facts(g: GuiltyRank, trace: Trace) -> HostDevices | None:
    """The guilty rank's host's facts; with no host known, the only host's when there is one."""
    if g.host:
        return trace.devices.get(g.host)
    if len(trace.devices) == 1:
        facts = next(iter(trace.devices.values()))
        g.host, g.host_guessed = facts.host, True
        return facts
    return None


def _place(g: GuiltyRank, info: RankInfo | None, facts: HostDevices) -> GpuFacts | None:
    """The rank's GPU: by its device identity, else by ``cuda:N`` or its local rank
    (``gpu_inferred``); None when neither names a GPU of the host."""
    gpu = None
    ident = g.device_id or (info.device_id if info else None)
    if ident:
        text = ident.strip()
        gpu = next((x for x in facts.gpus if x.uuid and uuid_key(x.uuid) == uuid_key(text)), None)
        if gpu is None and (pci := canonical_pci(text)):
            gpu = facts.gpu_by_pci(pci)
    if gpu is None:
        device = g.device or (info.device if info else None)
        local = g.local_rank if g.local_rank is not None else (info.local_rank if info else None)
        index = None
        if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
            index = int(device[5:])
        elif local is not None:
            index = local
        elif len(facts.gpus) == 1:
            index = facts.gpus[0].index
        gpu = facts.gpu_by_index(index) if index is not None else None
        g.gpu_inferred = gpu is not None
    if gpu is not None:
        g.gpu, g.pci_bus_id = gpu.index, gpu.pci_bus_id
    return gpu


def uuid_key(uuid: str) -> str:
    """nvidia-smi's ``GPU-5d1b...`` and torch's ``5d1b...`` (the recorder's device id) alike."""
    key = uuid.strip().lower()
    return key[4:] if key.startswith("gpu-") else key


def _gpu_label(gpu: GpuFacts | None, pci: str | None = None) -> str:
    if gpu is None:
        return f"GPU at PCI {pci}" if pci else "a GPU"
    return f"GPU {gpu.index}" + (f" (PCI {gpu.pci_bus_id})" if gpu.pci_bus_id else "")


def _short_time(t: str | None) -> str:
    if not t:
        return ""
    if "T" in t and t.endswith("Z"):  # 2026-12-02T12:03:11Z -> 12:03:11 UTC
        return f" at {t[11:19]} UTC"
    return f" at {t}"


def _findings(facts: HostDevices, gpu: GpuFacts | None) -> list[DeviceFinding]:
    host, out = facts.host, []

    def add(
        source: str,
        code: str,
        text: str,
        hardware: bool,
        on: GpuFacts | None,
        pci_bus_id: str | None = None,
        time: str | None = None,
    ) -> None:
        out.append(
            DeviceFinding(
                host=host,
                source=source,
                code=code,
                text=text,
                hardware=hardware,
                gpu=on.index if on else None,
                pci_bus_id=on.pci_bus_id if on else pci_bus_id,
                time=time,
            )
        )

    # the kernel log: Xid lines of this GPU (of any GPU when the rank's is unknown), SXid lines
    for e in reversed(facts.kernel_events):  # newest first
        on = facts.gpu_by_pci(e.pci_bus_id) if e.pci_bus_id else None
        if e.kind == "sxid":
            text = f"NVSwitch at PCI {e.pci_bus_id}: SXid {e.code}{_short_time(e.time)}"
            add(
                "kmsg",
                f"sxid:{e.code}",
                f"{text} ({e.text[:80]})",
                bool(e.fatal),
                None,
                pci_bus_id=e.pci_bus_id,
                time=e.time,
            )
            continue
        if gpu is not None and on is not gpu:
            continue
        meaning = XID_HARDWARE.get(e.code) or XID_SOFTWARE.get(e.code) or e.text[:80]
        text = f"{_gpu_label(on, e.pci_bus_id)}: Xid {e.code}{_short_time(e.time)} ({meaning})"
        add(
            "kmsg",
            f"xid:{e.code}",
            text,
            e.code in XID_HARDWARE,
            on,
            pci_bus_id=e.pci_bus_id,
            time=e.time,
        )
    # the GPU's own counters (nvidia-smi / NVML)
    if gpu is not None:
        source = next(
            (
                s.source
                for s in facts.sources
                if s.source in ("nvidia-smi", "nvml") and s.status == "collected"
            ),
            "nvidia-smi",
        )
        label = _gpu_label(gpu)
        for scope in ("volatile", "aggregate"):
            counts = gpu.ecc.get(scope, {})
            for name, memory in (("dram_uncorrectable", "HBM"), ("sram_uncorrectable", "SRAM")):
                if counts.get(name, 0) > 0 and (
                    scope == "volatile" or not gpu.ecc.get("volatile", {}).get(name)
                ):
                    since = "since the driver loaded" if scope == "volatile" else "over its life"
                    add(
                        source,
                        f"ecc:{name}",
                        f"{label}: {memory} uncorrectable ECC {counts[name]} ({since})",
                        scope == "volatile",
                        gpu,
                    )
        if gpu.remap_failure:
            add(source, "ecc:row_remap_failure", f"{label}: a row remapping failed", True, gpu)
        if gpu.remap_pending:
            add(
                source,
                "ecc:row_remap_pending",
                f"{label}: row remapping pending "
                f"({gpu.remapped_uncorrectable or 0} uncorrectable; the GPU needs a reset)",
                True,
                gpu,
            )
        if gpu.retirement_pending:
            add(
                source,
                "ecc:page_retirement_pending",
                f"{label}: page retirement pending (the GPU needs a reset)",
                True,
                gpu,
            )
        slow = [r for r in gpu.throttle_reasons if r in SLOWDOWN_REASONS]
        if slow:
            add(
                source,
                "clocks:" + slow[0],
                f"{label}: clocks slowed ({', '.join(slow)})",
                False,
                gpu,
            )
    # the host's NICs
    for p in facts.ib_ports:
        name = f"{p.device} port {p.port}"
        if p.state and p.state.upper() != "ACTIVE":
            add(
                "infiniband",
                "ib:port_" + p.state.lower()[:20],
                f"{name} is {p.state}" + (f" ({p.phys_state})" if p.phys_state else ""),
                True,
                None,
            )
        for counter in IB_ERROR_COUNTERS:
            if p.counters.get(counter, 0) > 0:
                add(
                    "infiniband",
                    f"ib:{counter}",
                    f"{name} {counter} {p.counters[counter]} (since the counters' last reset)",
                    False,
                    None,
                )
    # NCCL's RAS view
    if facts.ncclras:
        for line in facts.ncclras.splitlines():
            if any(w in line.lower() for w in NCCLRAS_WORDS):
                add("ncclras", "ncclras:fault", f"ncclras: {line.strip()[:160]}", False, None)
                break
    return out
