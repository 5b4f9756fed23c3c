"""The device-facts file, ``device_<host>.json``: what a host's GPUs, kernel log and NICs
showed when its records were collected (docs/device-evidence.md).

The one definition of that file (``write`` and ``read``) and of the texts it is made from:
``nvidia-smi -q -x`` XML (``parse_nvidia_smi_xml``) and Xid/SXid lines of the kernel log
(``parse_kernel_log``). Both the tool's output and the file are hostile input: the XML is
parsed with defusedxml (no entities, nothing external) after a size check, the file is read
only as a bounded regular file, and every field is checked (type, range, length) before it
becomes a ``model.devices`` value; anything else is dropped or refused with a one-line reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from frtools.formats import limits
from frtools.formats.private_files import write_new
from frtools.model.devices import (
    SOURCE_STATUSES,
    SOURCES,
    GpuFacts,
    HostDevices,
    IbPort,
    KernelEvent,
    SourceStatus,
)

KIND = "frtools-device-facts"
VERSION = 1
FILE_PREFIX = "device_"
FILE_SUFFIX = ".json"

# what one host's facts may cost (docs/device-evidence.md#limits)
MAX_FILE_BYTES = 4 << 20
MAX_XML_BYTES = 16 << 20  # nvidia-smi -q -x of 8 GPUs with processes is ~100 KiB
MAX_GPUS = 64
MAX_PROCESSES = 64  # per GPU
MAX_KERNEL_EVENTS = 512  # the newest kept
MAX_IB_PORTS = 256
MAX_COUNTERS = 64  # per port
MAX_TEXT = 240  # any one string field
MAX_NCCLRAS_BYTES = 64 << 10
MAX_HOST = 253
_COUNT_MAX = (1 << 63) - 1


class DeviceFactsError(ValueError):
    """Device facts that cannot be used; the message is one line naming the reason."""


# --- small validated values ---------------------------------------------------------------

_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


def canonical_pci(text: object) -> str | None:
    """``00000000:47:00.0`` (nvidia-smi), ``0000:47:00`` (an Xid line), ``47:00.0`` ->
    ``0000:47:00.0``; None for anything else."""
    if not isinstance(text, str):
        return None
    m = _PCI_RE.match(text.strip())
    if not m:
        return None
    domain = int(m.group("domain") or "0", 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{m.group('bus').lower()}:{m.group('dev').lower()}.{m.group('fn') or 0}"


def file_name(host: str) -> str:
    """``device_<host>.json``, the host's name kept to file-safe characters."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host)[:MAX_HOST].lstrip(".") or "unknown"
    return f"{FILE_PREFIX}{safe}{FILE_SUFFIX}"


def is_device_file(name: str) -> bool:
    return name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX)


def _text(value: object, n: int = MAX_TEXT) -> str | None:
    if not isinstance(value, str):
        return None
    value = "".join(c if c.isprintable() else " " for c in value.strip())
    return value if len(value) <= n else value[: n - 1] + "…"


def _count(value: object) -> int | None:
    """A non-negative counter of the file (a JSON int); None for anything else."""
    if not isinstance(value, int):  # the file's own ints only: text is nvidia-smi's
        return None
    return limits.strict_int(value, lo=0, hi=_COUNT_MAX)


def _xml_count(text: str | None) -> int | None:
    """A counter in nvidia-smi's XML (its text); None for 'N/A' or junk."""
    return limits.strict_int(text, lo=0, hi=_COUNT_MAX) if isinstance(text, str) else None


def _number(value: object) -> float | None:
    """``"34 C"``, ``"70.00 W"``, 34 -> a finite float; None otherwise."""
    if isinstance(value, str):
        m = re.match(r"^\s*(-?\d{1,9}(?:\.\d{1,6})?)\b", value)
        value = float(m.group(1)) if m else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if -1e9 < value < 1e9 else None


def _yes(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("yes", "active", "true"):
            return True
        if word in ("no", "not active", "false"):
            return False
    return None


# --- nvidia-smi -q -x -----------------------------------------------------------------------

ECC_COUNTERS = ("sram_correctable", "sram_uncorrectable", "dram_correctable", "dram_uncorrectable")


def parse_nvidia_smi_xml(data: bytes) -> list[GpuFacts]:
    """The GPUs of ``nvidia-smi -q -x`` output (schema: NVIDIA's ``nvsmi_device_v*.dtd``), in
    the order nvidia-smi lists them, which is its index. ``DeviceFactsError`` when the output is
    too big, declares entities, is not XML or is not an ``nvidia_smi_log``."""
    from defusedxml import DefusedXmlException
    from defusedxml.ElementTree import ParseError, fromstring

    if len(data) > MAX_XML_BYTES:
        raise DeviceFactsError(
            f"nvidia-smi XML of {limits.size_text(len(data))} is over the "
            f"{limits.size_text(MAX_XML_BYTES)} limit; refused"
        )
    try:
        root = fromstring(data, forbid_dtd=False, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as exc:
        what = {
            "EntitiesForbidden": "it declares entities (no entity is expanded)",
            "ExternalReferenceForbidden": "it references something outside itself",
            "DTDForbidden": "it carries a DTD",
        }.get(type(exc).__name__, type(exc).__name__)
        raise DeviceFactsError(f"nvidia-smi XML refused: {what}") from None
    except (ParseError, ValueError, RecursionError) as exc:
        raise DeviceFactsError(f"nvidia-smi output is not XML: {str(exc)[:120]}") from None
    if root.tag != "nvidia_smi_log":
        raise DeviceFactsError(
            f"nvidia-smi XML has root <{str(root.tag)[:40]}>, not nvidia_smi_log"
        )
    gpus = []
    for index, node in enumerate(root.findall("gpu")):
        if index >= MAX_GPUS:
            break
        gpus.append(_gpu_from_xml(index, node))
    return gpus


def _gpu_from_xml(index: int, node: Any) -> GpuFacts:
    def text(path: str) -> str | None:
        found = node.find(path)
        return found.text if found is not None and isinstance(found.text, str) else None

    ecc: dict[str, dict[str, int]] = {}
    for scope in ("volatile", "aggregate"):
        counts = {}
        for name in ECC_COUNTERS:
            value = _xml_count(text(f"ecc_errors/{scope}/{name}"))
            if value is None and name == "sram_uncorrectable":  # newer drivers split it
                parts = [
                    _xml_count(text(f"ecc_errors/{scope}/sram_uncorrectable_{kind}"))
                    for kind in ("parity", "secded")
                ]
                if any(p is not None for p in parts):
                    value = sum(p or 0 for p in parts)
            if value is not None:
                counts[name] = value
        if counts:
            ecc[scope] = counts
    throttle = []
    for group in ("clocks_event_reasons", "clocks_throttle_reasons"):
        for reason in node.findall(f"{group}/*"):
            if _yes(reason.text):
                name = re.sub(r"^clocks_(?:event|throttle)_reason_", "", str(reason.tag))
                throttle.append(_text(name, 60) or "?")
    processes = []
    for proc in node.findall("processes/process_info")[:MAX_PROCESSES]:
        pid = _xml_count(proc.findtext("pid"))
        if pid is not None:
            processes.append((pid, _text(proc.findtext("process_name")) or ""))
    power = text("gpu_power_readings/power_draw") or text("power_readings/power_draw")
    return GpuFacts(
        index=index,
        uuid=_text(text("uuid"), 80),
        pci_bus_id=canonical_pci(text("pci/pci_bus_id") or node.get("id")),
        name=_text(text("product_name"), 80),
        ecc=ecc,
        retired_single_bit=_xml_count(
            text("retired_pages/multiple_single_bit_retirement/retired_count")
        ),
        retired_double_bit=_xml_count(text("retired_pages/double_bit_retirement/retired_count")),
        retirement_pending=_yes(text("retired_pages/pending_retirement"))
        or _yes(text("retired_pages/pending_blacklist")),
        remapped_correctable=_xml_count(text("remapped_rows/remapped_row_corr")),
        remapped_uncorrectable=_xml_count(text("remapped_rows/remapped_row_unc")),
        remap_pending=_yes(text("remapped_rows/remapped_row_pending")),
        remap_failure=_yes(text("remapped_rows/remapped_row_failure")),
        throttle_reasons=throttle[:16],
        temperature_c=_number(text("temperature/gpu_temp")),
        power_w=_number(power),
        processes=processes,
    )


# --- the kernel log ---------------------------------------------------------------------------

_PCI_IN_LOG = r"PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
_XID_RE = re.compile(rf"NVRM: Xid \({_PCI_IN_LOG}\): (?P<code>\d{{1,5}})(?:, (?P<rest>.*))?")
_SXID_RE = re.compile(rf"SXid \({_PCI_IN_LOG}\): (?P<code>\d{{1,6}})(?:, (?P<rest>.*))?")
_KMSG_PREFIX = re.compile(r"^\d+,\d+,(?P<us>\d{1,20}),[^;]*;")
_DMESG_SECONDS = re.compile(r"^\[\s*(?P<s>\d{1,12}\.\d{1,9})\]")
_DMESG_WALL = re.compile(r"^\[(?P<t>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]")
_ISO = re.compile(r"^(?P<t>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")
_SYSLOG = re.compile(r"^(?P<t>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d)\s")
MAX_LOG_LINE = 4096


def _log_time(line: str, boot_time_s: float | None) -> str | None:
    m = _KMSG_PREFIX.match(line)
    seconds = int(m.group("us")) / 1e6 if m else None
    if seconds is None and (m := _DMESG_SECONDS.match(line)):
        seconds = float(m.group("s"))
    if seconds is not None:
        if boot_time_s is not None:
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(boot_time_s + seconds))
        return f"{seconds:.3f} s after boot"
    for pattern in (_DMESG_WALL, _ISO, _SYSLOG):
        if m := pattern.match(line):
            return m.group("t")
    return None


def parse_kernel_log(text: str, boot_time_s: float | None = None) -> list[KernelEvent]:
    """The Xid and SXid lines of a kernel log (``/dev/kmsg`` records, ``dmesg`` with or
    without ``-T``, a journal or syslog), the newest ``MAX_KERNEL_EVENTS`` kept.
    ``boot_time_s``: the host's boot time, to turn seconds since boot into a wall clock."""
    events: list[KernelEvent] = []
    for line in text.splitlines():
        if "Xid" not in line:
            continue
        line = line[:MAX_LOG_LINE]
        m = _XID_RE.search(line)
        kind = "xid"
        if m is None:
            m = _SXID_RE.search(line)
            kind = "sxid"
        if m is None:
            continue
        rest = m.group("rest") or ""
        fatal = None
        if kind == "sxid":
            fatal = bool(re.search(r"(?<!Non-)\bFatal\b", rest)) or None
            if re.search(r"\bNon-fatal\b", rest, re.IGNORECASE):
                fatal = False
        events.append(
            KernelEvent(
                kind=kind,
                code=int(m.group("code")),
                pci_bus_id=canonical_pci(m.group("pci")),
                time=_log_time(line, boot_time_s),
                text=_text(rest) or "",
                fatal=fatal,
            )
        )
    return events[-MAX_KERNEL_EVENTS:]


# --- the file ----------------------------------------------------------------------------------


def to_dict(facts: HostDevices) -> dict[str, Any]:
    return {
        "kind": KIND,
        "version": VERSION,
        "host": facts.host,
        "collected_ns": facts.collected_ns,
        "sources": [
            {"source": s.source, "status": s.status, "detail": s.detail} for s in facts.sources
        ],
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "name": g.name,
                "ecc": g.ecc,
                "retired_pages": {
                    "single_bit": g.retired_single_bit,
                    "double_bit": g.retired_double_bit,
                    "pending": g.retirement_pending,
                },
                "remapped_rows": {
                    "correctable": g.remapped_correctable,
                    "uncorrectable": g.remapped_uncorrectable,
                    "pending": g.remap_pending,
                    "failure": g.remap_failure,
                },
                "throttle_reasons": g.throttle_reasons,
                "temperature_c": g.temperature_c,
                "power_w": g.power_w,
                "processes": [{"pid": pid, "name": name} for pid, name in g.processes],
            }
            for g in facts.gpus
        ],
        "kernel_events": [
            {
                "kind": e.kind,
                "code": e.code,
                "pci_bus_id": e.pci_bus_id,
                "time": e.time,
                "text": e.text,
                "fatal": e.fatal,
            }
            for e in facts.kernel_events
        ],
        "ib_ports": [
            {
                "device": p.device,
                "port": p.port,
                "state": p.state,
                "phys_state": p.phys_state,
                "link_layer": p.link_layer,
                "counters": p.counters,
            }
            for p in facts.ib_ports
        ],
        "ncclras": facts.ncclras,
    }


def write(directory: str | os.PathLike[str], facts: HostDevices) -> Path:
    """Write ``device_<host>.json`` into ``directory`` (private, atomically; a file over
    ``MAX_FILE_BYTES`` loses its kernel events and ncclras text first)."""
    doc = to_dict(facts)
    text = json.dumps(doc, indent=1)
    if len(text) > MAX_FILE_BYTES:
        doc["kernel_events"], doc["ncclras"] = doc["kernel_events"][-32:], None
        text = json.dumps(doc)[:MAX_FILE_BYTES]
    path = write_new(Path(directory) / file_name(facts.host), text + "\n")
    _share_as_folder(path, Path(directory))
    return path


def _share_as_folder(path: Path, directory: Path) -> None:
    """The file opens to the folder's group as the records beside it do: a folder the
    recorder made 0750 for ``FRTOOLS_SHARE_GROUP`` gets 0640 files of that group; a private
    folder keeps the file 0600."""
    st = os.stat(directory, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IRGRP or st.st_mode & 0o007:
        return
    with contextlib.suppress(OSError):
        os.chown(path, -1, st.st_gid, follow_symlinks=False)
        os.chmod(path, 0o640)  # ours, just created in our folder


def read(path: str | os.PathLike[str]) -> HostDevices:
    """A ``device_<host>.json`` as ``HostDevices``, every field checked; ``DeviceFactsError``
    (one line, naming the file) when it is refused or is not such a file."""
    path = Path(path)
    try:
        raw = limits.read_regular(
            path, MAX_FILE_BYTES, limit_name="device facts size", follow_symlinks=False
        )
        limits.check_json(raw)
        doc = json.loads(raw)
    except limits.InputRefused as exc:
        raise DeviceFactsError(f"{path}: {exc}") from None
    except RecursionError:
        raise DeviceFactsError(f"{path}: nests too deeply; refused") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DeviceFactsError(f"{path}: unreadable device facts: {str(exc)[:120]}") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise DeviceFactsError(f"{path}: not an frtools device-facts file")
    if doc.get("version") != VERSION:
        raise DeviceFactsError(f"{path}: device-facts version {_text(str(doc.get('version')), 20)}")
    host = _text(doc.get("host"), MAX_HOST)
    if not host:
        raise DeviceFactsError(f"{path}: device facts name no host")
    return HostDevices(
        host=host,
        collected_ns=_count(doc.get("collected_ns")),
        sources=[s for s in map(_source, _list(doc.get("sources"), 32)) if s],
        gpus=[g for g in map(_gpu, _list(doc.get("gpus"), MAX_GPUS)) if g],
        kernel_events=[
            e for e in map(_event, _list(doc.get("kernel_events"), MAX_KERNEL_EVENTS)) if e
        ],
        ib_ports=[p for p in map(_port, _list(doc.get("ib_ports"), MAX_IB_PORTS)) if p],
        ncclras=_text(doc.get("ncclras"), MAX_NCCLRAS_BYTES),
        path=str(path),
    )


def _list(value: object, n: int) -> list[Any]:
    return [v for v in value[:n] if isinstance(v, dict)] if isinstance(value, list) else []


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _source(d: dict[str, Any]) -> SourceStatus | None:
    if d.get("source") not in SOURCES or d.get("status") not in SOURCE_STATUSES:
        return None
    return SourceStatus(source=d["source"], status=d["status"], detail=_text(d.get("detail")) or "")


def _gpu(d: dict[str, Any]) -> GpuFacts | None:
    index = _count(d.get("index"))
    if index is None or index >= MAX_GPUS:
        return None
    ecc = {}
    for scope in ("volatile", "aggregate"):
        counts = {
            k: c
            for k in ECC_COUNTERS
            if (c := _count(_dict(_dict(d.get("ecc")).get(scope)).get(k))) is not None
        }
        if counts:
            ecc[scope] = counts
    retired, remapped = _dict(d.get("retired_pages")), _dict(d.get("remapped_rows"))
    reasons = d.get("throttle_reasons") if isinstance(d.get("throttle_reasons"), list) else []
    return GpuFacts(
        index=index,
        uuid=_text(d.get("uuid"), 80),
        pci_bus_id=canonical_pci(d.get("pci_bus_id")),
        name=_text(d.get("name"), 80),
        ecc=ecc,
        retired_single_bit=_count(retired.get("single_bit")),
        retired_double_bit=_count(retired.get("double_bit")),
        retirement_pending=_yes(retired.get("pending")),
        remapped_correctable=_count(remapped.get("correctable")),
        remapped_uncorrectable=_count(remapped.get("uncorrectable")),
        remap_pending=_yes(remapped.get("pending")),
        remap_failure=_yes(remapped.get("failure")),
        throttle_reasons=[t for r in reasons[:16] if (t := _text(r, 60))],
        temperature_c=_number(d.get("temperature_c")),
        power_w=_number(d.get("power_w")),
        processes=[
            (pid, _text(p.get("name")) or "")
            for p in _list(d.get("processes"), MAX_PROCESSES)
            if (pid := _count(p.get("pid"))) is not None
        ],
    )


def _event(d: dict[str, Any]) -> KernelEvent | None:
    code = _count(d.get("code"))
    if d.get("kind") not in ("xid", "sxid") or code is None or code > 999_999:
        return None
    return KernelEvent(
        kind=d["kind"],
        code=code,
        pci_bus_id=canonical_pci(d.get("pci_bus_id")),
        time=_text(d.get("time"), 40),
        text=_text(d.get("text")) or "",
        fatal=d.get("fatal") if isinstance(d.get("fatal"), bool) else None,
    )


def _port(d: dict[str, Any]) -> IbPort | None:
    device, port = _text(d.get("device"), 64), _count(d.get("port"))
    if not device or port is None or port > 4096:
        return None
    counters = {
        k[:64]: c
        for k, v in list(_dict(d.get("counters")).items())[:MAX_COUNTERS]
        if isinstance(k, str) and (c := _count(v)) is not None
    }
    return IbPort(
        device=device,
        port=port,
        state=_text(d.get("state"), 40),
        phys_state=_text(d.get("phys_state"), 40),
        link_layer=_text(d.get("link_layer"), 40),
        counters=counters,
    )
