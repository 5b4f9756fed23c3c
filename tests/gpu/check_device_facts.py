"""GPU check of device facts (run by hand, or by run_all.sh, on a machine with NVIDIA GPUs).

    python tests/gpu/check_device_facts.py

Reads the real ``nvidia-smi -q -x`` (and NVML through nvidia-ml-py where it is installed) the
way ``frtools dump`` does, writes and reads back ``device_<host>.json``, and joins every CUDA
device torch sees to its GPU by the recorder's device identity (its UUID): the join must find
it without inferring. ``check_device_facts(directory)`` is the judgement; it raises
AssertionError with what went wrong and returns a one-line summary.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path


def check_device_facts(directory: str | Path) -> str:
    """Collect, store, read back and join this host's GPUs."""
    import torch

    from frtools.analyze.hardware import attach_device_evidence
    from frtools.analyze.verdict import GuiltyRank, Verdict
    from frtools.collect.device_facts import Collection, nvml_gpus
    from frtools.formats import device_facts
    from frtools.model.trace import RankInfo, Trace, entries_table

    assert torch.cuda.is_available(), "no CUDA device"
    assert shutil.which("nvidia-smi"), "nvidia-smi is not on PATH"
    written = Collection().finish(directory)
    assert written is not None, "device facts not written"
    facts = device_facts.read(written)
    status = {s.source: s for s in facts.sources}
    assert status["nvidia-smi"].status == "collected", status["nvidia-smi"]
    assert facts.gpus, "nvidia-smi listed no GPU"
    for g in facts.gpus:
        assert g.uuid and g.uuid.startswith(("GPU-", "MIG-")), f"GPU {g.index}: uuid {g.uuid!r}"
        assert g.pci_bus_id, f"GPU {g.index}: no PCI bus id"
        assert g.temperature_c is not None, f"GPU {g.index}: no temperature"
    nvml = ""
    try:
        gpus, _ = nvml_gpus()
    except Exception as exc:  # not installed: a note, not a failure
        nvml = f"; NVML not read ({exc})"
    else:
        by_smi = {(g.uuid, g.pci_bus_id) for g in facts.gpus}
        by_nvml = {(g.uuid, g.pci_bus_id) for g in gpus}
        assert by_smi == by_nvml, f"nvidia-smi {sorted(by_smi)} != NVML {sorted(by_nvml)}"
        nvml = f"; NVML agrees on {len(gpus)} GPU(s)"

    joined = []
    for index in range(torch.cuda.device_count()):
        uuid = str(torch.cuda.get_device_properties(index).uuid)  # as the recorder stores it
        info = RankInfo(rank=index, host=facts.host, device=f"cuda:{index}", device_id=uuid)
        trace = Trace(entries=entries_table([]), ranks={index: info}, devices={facts.host: facts})
        g = GuiltyRank(rank=index, host=facts.host, device=info.device, device_id=uuid)
        attach_device_evidence(
            Verdict(kind="dead", headline="x", confidence=1.0, guilty=[g]), trace
        )
        assert g.gpu is not None and not g.gpu_inferred, f"cuda:{index} ({uuid}) not joined"
        joined.append(f"cuda:{index}->GPU {g.gpu} ({g.pci_bus_id})")
        hardware = [f.text for f in g.findings if f.hardware]
        if hardware:
            print(f"note: evidence on GPU {g.gpu}: {hardware}")
    ecc = sum(1 for g in facts.gpus if g.ecc)
    return (
        f"{len(facts.gpus)} GPU(s) read, {ecc} with ECC counters, "
        f"kmsg {status['kmsg'].status}, {', '.join(joined)}{nvml}"
    )


def main() -> int:
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: no CUDA")
        return 77
    if not shutil.which("nvidia-smi"):
        print("SKIP: nvidia-smi is not on PATH")
        return 77
    with tempfile.TemporaryDirectory() as d:
        try:
            summary = check_device_facts(d)
        except AssertionError as exc:
            print(f"FAILED: {exc}")
            print("FAIL")
            return 1
    print(summary)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
