"""A host's devices made of files, for tests on machines without GPUs: a fake ``nvidia-smi``
on the PATH printing ``-q -x`` XML shaped after NVIDIA's ``nvsmi_device_v12.dtd``, a kernel log
with Xid lines, and a ``/sys/class/infiniband``-shaped tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# GPU i of the fake host sits at PCI bus 0x47 + i (as 8-GPU servers spread them)
PCI_BUSES = (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)


def pci_bus_id(index: int) -> str:
    """nvidia-smi's spelling (8-digit domain)."""
    return f"00000000:{PCI_BUSES[index]:02X}:00.0"


def _ecc(scope: str, dram_correctable: int, dram_uncorrectable: int) -> str:
    """One ECC counter block of the DTD (newer drivers split SRAM uncorrectable in two)."""
    return (
        f"\t\t\t<{scope}>\n"
        "\t\t\t\t<sram_correctable>0</sram_correctable>\n"
        "\t\t\t\t<sram_uncorrectable_parity>0</sram_uncorrectable_parity>\n"
        "\t\t\t\t<sram_uncorrectable_secded>0</sram_uncorrectable_secded>\n"
        f"\t\t\t\t<dram_correctable>{dram_correctable}</dram_correctable>\n"
        f"\t\t\t\t<dram_uncorrectable>{dram_uncorrectable}</dram_uncorrectable>\n"
        f"\t\t\t</{scope}>\n"
    )


def gpu_xml(index: int, *, dram_uncorrectable: int = 0, remap_pending: bool = False) -> str:
    return f"""\
\t<gpu id="{pci_bus_id(index)}">
\t\t<product_name>NVIDIA H100 80GB HBM3</product_name>
\t\t<product_brand>NVIDIA</product_brand>
\t\t<uuid>GPU-5d1b6e3a-0000-4000-8000-00000000000{index}</uuid>
\t\t<minor_number>{index}</minor_number>
\t\t<pci>
\t\t\t<pci_bus>{PCI_BUSES[index]:02X}</pci_bus>
\t\t\t<pci_device>00</pci_device>
\t\t\t<pci_domain>0000</pci_domain>
\t\t\t<pci_device_id>233010DE</pci_device_id>
\t\t\t<pci_bus_id>{pci_bus_id(index)}</pci_bus_id>
\t\t</pci>
\t\t<clocks_event_reasons>
\t\t\t<clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>
\t\t\t<clocks_event_reason_hw_slowdown>{"Active" if remap_pending else "Not Active"}</clocks_event_reason_hw_slowdown>
\t\t\t<clocks_event_reason_sw_thermal_slowdown>Not Active</clocks_event_reason_sw_thermal_slowdown>
\t\t</clocks_event_reasons>
\t\t<ecc_mode>
\t\t\t<current_ecc>Enabled</current_ecc>
\t\t\t<pending_ecc>Enabled</pending_ecc>
\t\t</ecc_mode>
\t\t<ecc_errors>
{_ecc("volatile", 3, dram_uncorrectable)}{_ecc("aggregate", 12, dram_uncorrectable)}\t\t</ecc_errors>
\t\t<retired_pages>
\t\t\t<multiple_single_bit_retirement>
\t\t\t\t<retired_count>N/A</retired_count>
\t\t\t</multiple_single_bit_retirement>
\t\t\t<double_bit_retirement>
\t\t\t\t<retired_count>N/A</retired_count>
\t\t\t</double_bit_retirement>
\t\t\t<pending_blacklist>N/A</pending_blacklist>
\t\t\t<pending_retirement>N/A</pending_retirement>
\t\t</retired_pages>
\t\t<remapped_rows>
\t\t\t<remapped_row_corr>0</remapped_row_corr>
\t\t\t<remapped_row_unc>{1 if remap_pending else 0}</remapped_row_unc>
\t\t\t<remapped_row_pending>{"Yes" if remap_pending else "No"}</remapped_row_pending>
\t\t\t<remapped_row_failure>No</remapped_row_failure>
\t\t</remapped_rows>
\t\t<temperature>
\t\t\t<gpu_temp>34 C</gpu_temp>
\t\t\t<gpu_temp_max_threshold>95 C</gpu_temp_max_threshold>
\t\t</temperature>
\t\t<gpu_power_readings>
\t\t\t<power_state>P0</power_state>
\t\t\t<power_draw>118.25 W</power_draw>
\t\t</gpu_power_readings>
\t\t<processes>
\t\t\t<process_info>
\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>
\t\t\t\t<compute_instance_id>N/A</compute_instance_id>
\t\t\t\t<pid>{4100 + index}</pid>
\t\t\t\t<type>C</type>
\t\t\t\t<process_name>python</process_name>
\t\t\t\t<used_memory>1024 MiB</used_memory>
\t\t\t</process_info>
\t\t</processes>
\t</gpu>
"""


def nvidia_smi_xml(n_gpus: int = 4, **bad: dict[str, object]) -> str:
    """``nvidia-smi -q -x`` of a host with ``n_gpus`` GPUs; ``bad={"2": {...}}`` gives GPU 2
    ``gpu_xml`` keyword arguments (uncorrectable ECC, a pending row remap)."""
    gpus = "".join(gpu_xml(i, **bad.get(str(i), {})) for i in range(n_gpus))
    return (
        '<?xml version="1.0" ?>\n'
        '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">\n'
        "<nvidia_smi_log>\n"
        "\t<timestamp>Wed Dec  2 12:03:15 2026</timestamp>\n"
        "\t<driver_version>550.90.07</driver_version>\n"
        "\t<cuda_version>12.4</cuda_version>\n"
        f"\t<attached_gpus>{n_gpus}</attached_gpus>\n"
        f"{gpus}"
        "</nvidia_smi_log>\n"
    )


BILLION_LAUGHS = (
    '<?xml version="1.0"?>\n<!DOCTYPE nvidia_smi_log [\n <!ENTITY a "aaaaaaaaaa">\n'
    + "".join(f' <!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">\n' for i in range(8))
    + "]>\n<nvidia_smi_log><gpu><uuid>&i;</uuid></gpu></nvidia_smi_log>\n"
)


def fake_nvidia_smi(bin_dir: Path, xml: str | None = None, *, huge_bytes: int = 0) -> Path:
    """An ``nvidia-smi`` script in ``bin_dir`` that prints ``xml`` for ``-q -x`` (or
    ``huge_bytes`` of XML-looking junk), a real process on the PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    payload = bin_dir / "nvidia-smi.xml"
    if xml is not None:
        payload.write_text(xml)
    script = bin_dir / "nvidia-smi"
    body = (
        f"import sys\nsys.stdout.write('<nvidia_smi_log>' + 'x' * {huge_bytes})\n"
        if huge_bytes
        else f"import sys\nsys.stdout.write(open({str(payload)!r}).read())\n"
    )
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return script


def xid_line(index: int, code: int, text: str, *, seconds: float = 5123.456) -> str:
    """One ``/dev/kmsg`` record of an Xid on GPU ``index`` (the log names the PCI address
    without its function)."""
    us = int(seconds * 1e6)
    return f"3,1724,{us},-;NVRM: Xid (PCI:0000:{PCI_BUSES[index]:02x}:00): {code}, {text}\n"


def kernel_log(path: Path, lines: list[str]) -> Path:
    noise = [
        "6,1700,5000000000,-;usb 1-1: new high-speed USB device number 2 using xhci_hcd\n",
        "6,1701,5001000000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07\n",
    ]
    path.write_text("".join(noise + lines))
    return path


def infiniband_tree(root: Path, ports: dict[str, dict[str, object]]) -> Path:
    """``root/<dev>/ports/1/{state,phys_state,link_layer,counters/*}`` for each device in
    ``ports`` (``{"mlx5_0": {"state": "4: ACTIVE", "link_downed": 0}}``)."""
    for device, spec in ports.items():
        port = root / device / "ports" / "1"
        (port / "counters").mkdir(parents=True, exist_ok=True)
        (port / "state").write_text(f"{spec.get('state', '4: ACTIVE')}\n")
        (port / "phys_state").write_text(f"{spec.get('phys_state', '5: LinkUp')}\n")
        (port / "link_layer").write_text("InfiniBand\n")
        for name in ("link_downed", "symbol_error", "port_rcv_errors", "link_error_recovery"):
            (port / "counters" / name).write_text(f"{spec.get(name, 0)}\n")
    return root


def device_env(
    tmp: Path, *, nvidia_smi_dir: Path | None, kmsg: Path | None, sysfs: Path | None
) -> dict[str, str]:
    """The environment that points frtools' device facts at the fakes (``None``: that source
    absent)."""
    env = dict(os.environ)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    path = [p for p in path if not (Path(p) / "nvidia-smi").exists()]
    env["PATH"] = os.pathsep.join(([str(nvidia_smi_dir)] if nvidia_smi_dir else []) + path)
    env["FRTOOLS_KMSG"] = str(kmsg) if kmsg else str(tmp / "no-kmsg")
    env["FRTOOLS_INFINIBAND_SYSFS"] = str(sysfs) if sysfs else str(tmp / "no-infiniband")
    return env
