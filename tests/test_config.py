"""``frtools.config`` owns every ``FRTOOLS_*`` variable: declared once, documented in the
README, read through it, parsed the same way everywhere."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from frtools import config

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "frtools"
NAME = re.compile(r"\bFRTOOLS_[A-Z0-9_]*[A-Z0-9]\b")
NATIVE_READ = re.compile(r"getenv\(\s*\"(FRTOOLS_[A-Z0-9_]+)\"")
DIRECT_READ = re.compile(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"']FRTOOLS_")

# Files that still read their variable straight from os.environ, owned elsewhere; each needs a
# one-line change to read it through frtools.config (then drop it from here).
NOT_YET_THROUGH_CONFIG = {
    "frtools/recorder/_native/blackbox.cpp",  # FRTOOLS_CUDART: C++, cannot import Python
}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cpp", ".h"))


def _names_used() -> dict[str, set[str]]:
    """FRTOOLS_* name -> files mentioning it (C++: only what getenv reads, not macros)."""
    used: dict[str, set[str]] = {}
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        names = NAME.findall(text) if path.suffix == ".py" else NATIVE_READ.findall(text)
        for name in names:
            used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return used


def _readme_table() -> dict[str, str]:
    """README's environment table: variable -> default column."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`FRTOOLS_"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_every_frtools_variable_in_the_source_is_declared_in_config() -> None:
    undeclared = {n: sorted(f) for n, f in _names_used().items() if n not in config.ENV_VARS}
    assert undeclared == {}


def test_every_declared_variable_is_in_the_readme_table_with_its_default() -> None:
    table = _readme_table()
    assert sorted(table) == sorted(config.ENV_VARS)
    for setting in config.SETTINGS:
        assert table[setting.name] == setting.shown_default, setting.name


def test_variables_are_read_through_config() -> None:
    direct = {
        str(p.relative_to(ROOT))
        for p in _sources()
        if p.name != "config.py" and DIRECT_READ.search(p.read_text(encoding="utf-8"))
    }
    assert direct <= NOT_YET_THROUGH_CONFIG


def test_unset_or_blank_means_the_default() -> None:
    cfg = config.recorder_config({"FRTOOLS_DIR": "  ", "FRTOOLS_STALL_SECONDS": ""})
    assert cfg.dir == config.DEFAULT_DIR
    assert cfg.stall_seconds == 60.0
    assert cfg.stack_signal == int(signal.SIGUSR2)
    assert cfg.job_dir == f"{config.DEFAULT_DIR}/local"
    assert config.STORE_PREFIX.read({}) == "frtools/"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FRTOOLS_BUFFER_SIZE": "many"}, "FRTOOLS_BUFFER_SIZE='many' is not a int"),
        ({"FRTOOLS_STALL_SECONDS": "-1"}, "FRTOOLS_STALL_SECONDS='-1' must not be negative"),
        ({"FRTOOLS_STACK_SIGNAL": "SIGNOPE"}, "is not a signal name or number"),
        ({"FRTOOLS_BUFFER_SIZE": "0"}, "FRTOOLS_BUFFER_SIZE must be at least 1"),
    ],
)
def test_an_unusable_value_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.recorder_config(env)


def test_flags_read_alike() -> None:
    assert config.RECORD.read({"FRTOOLS_RECORD": "yes"}) is True
    assert config.RECORD.read({}) is False
    assert config.STACKS.read({"FRTOOLS_STACKS": "off"}) is False
    assert config.JOBWIDE.read({"FRTOOLS_JOBWIDE": "0"}) is False
    assert config.JOBWIDE.read({}) is True


def test_job_id_from_the_launcher() -> None:
    assert config.job_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}) == "42"
    assert config.job_id({"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}) == "node1-29500"
    assert config.job_id({"FRTOOLS_JOB_ID": "a/b"}) == "a_b"
    assert config.recorder_config({}, job_id="x y").job_id == "x_y"


def test_config_is_the_base_layer() -> None:
    text = (PACKAGE / "config.py").read_text(encoding="utf-8")
    assert not re.search(r"^\s*(from|import)\s+frtools", text, re.M)
