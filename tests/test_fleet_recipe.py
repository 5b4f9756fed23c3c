"""docs/fleet.md's srun/pdsh recipe, run as written: its bash lines, with stand-ins for
``srun`` and ``pdsh`` on PATH, against local folders standing in for hosts, for a job of
black boxes and one of PyTorch Flight Recorder dumps. The verdict must be the one the full
records give in one place.

The stand-ins run the command once per host folder, one after the other, each in its own
UTS namespace named after its host (``unshare --uts``: a summary goes by its host's name,
and PyTorch dumps name no host). Each host's own disk is a symbolic link at one path
(``$FRTOOLS_DIR``, the same path on every node, as on a cluster), pointed at that host's
folder before its command runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from frtools.analyze.diagnose import diagnose
from frtools.analyze.readers import load_trace
from frtools.synth import synthesize

DOC = Path(__file__).resolve().parent.parent / "docs" / "fleet.md"
JOB = "train-7"
HOSTS = ("gpu0001", "gpu0002", "gpu0003")

# srun [options] COMMAND...: COMMAND once per host, as that host
_SRUN = """#!/bin/bash
while [ $# -gt 0 ]; do
  case "$1" in
    --jobid|-N|-n|-w) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
for host in $FAKE_HOSTS; do
  ln -sfn "$FAKE_DISKS/$host" "$FRTOOLS_DIR" || exit 1
  unshare --uts bash -c 'hostname "$0" && exec "$@"' "$host" "$@" || exit 1
done
"""
# pdsh -w HOSTS "COMMAND": COMMAND by bash once per host, its output lines as "host: line"
_PDSH = """#!/bin/bash
[ "$1" = -w ] && shift 2
for host in $FAKE_HOSTS; do
  ln -sfn "$FAKE_DISKS/$host" "$FRTOOLS_DIR"
  unshare --uts bash -c 'hostname "$0" && exec bash -c "$1"' "$host" "$1" | sed "s/^/$host: /"
done
"""


def _can_name_hosts() -> bool:
    try:
        out = subprocess.run(["unshare", "--uts", "hostname", "gpu0001"], capture_output=True,
                             timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_name_hosts(), reason="needs `unshare --uts` to give each stand-in host its name"
)


def _recipe() -> str:
    """The bash block of docs/fleet.md's "Without Ray" section."""
    section = DOC.read_text().split("## Without Ray", 1)[1]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, "docs/fleet.md: no bash block under 'Without Ray'"
    return m.group(1)


def _verdict(folder: Path) -> tuple:
    v = diagnose(load_trace(folder, workers=1))
    return v.kind, tuple(sorted(v.guilty_ranks)), v.headline


@pytest.fixture(scope="module", params=["frtools", "torch"])
def hosts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """24 ranks (rank 13 missing) as black boxes or PyTorch dumps, 8 on each of three hosts'
    disks under <disk>/<job>/ (the boxes name those hosts node00000-2); and the verdict of
    all of them in one place."""
    root = tmp_path_factory.mktemp(f"recipe-{request.param}")
    every = root / "all"
    synthesize(every, 24, tp=4, fault="missing", fault_ranks=[13], seed=5, buffer_size=200,
               format=request.param, workers=1)  # fmt: skip
    files = sorted(p for p in every.iterdir() if p.name != "truth.json")
    assert len(files) == 24
    for i, host in enumerate(HOSTS):
        d = root / "disks" / host / JOB
        d.mkdir(parents=True)
        for p in files:
            rank = int(re.search(r"(\d+)(\.frt)?$", p.name).group(1))
            if rank // 8 == i:
                os.link(p, d / p.name)
    return root, _verdict(every)


def _run(root: Path, script: str) -> subprocess.CompletedProcess:
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "bin").mkdir(parents=True)
    for name, text in (("srun", _SRUN), ("pdsh", _PDSH)):
        (work / "bin" / name).write_text(text)
        (work / "bin" / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "FRTOOLS_DIR": str(work / "local-disk"),  # one path, each host's disk in turn
        "FAKE_DISKS": str(root / "disks"),
        "FAKE_HOSTS": " ".join(HOSTS),
        "JOB": JOB,
        "SLURM_JOB_ID": "4242",
    }
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_the_srun_recipe_gives_the_full_records_verdict(hosts) -> None:
    root, expected = hosts
    srun, _ = _recipe().split("# pdsh", 1)
    shared = root / "work" / "shared"
    script = srun.replace("/shared/", f"{shared}/")
    script = script.replace("frtools analyze ", "frtools analyze --format json ", 1)
    out = _run(root, textwrap.dedent(script))
    assert out.returncode == 1, out.stderr[-3000:]  # 1: a problem found
    assert [len(list((shared / "incident-42").iterdir()))] == [len(HOSTS)]
    assert _verdict(shared / "incident-42") == expected


@pytest.mark.timeout(300)
def test_the_pdsh_recipe_gives_the_full_records_verdict(hosts) -> None:
    root, expected = hosts
    _, pdsh = _recipe().split("# pdsh", 1)
    out = _run(root, "# pdsh" + pdsh)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Rank 13 " in out.stdout  # the terminal report names the missing rank
    folder = root / "work" / "incident-42"
    assert sorted(p.name for p in folder.iterdir()) == [f"{h}.summary" for h in HOSTS]
    assert _verdict(folder) == expected
