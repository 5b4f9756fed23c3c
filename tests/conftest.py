import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

# Test files whose tests run torch itself (real jobs, the recorder): `scripts/test.sh` runs
# them again on the older supported torch (`pytest -m torch`).
TORCH_FILES = {
    "test_blackbox.py",
    "test_demo.py",
    "test_dump.py",
    "test_pytest_plugin.py",
    "test_real_corpus.py",
    "test_recorder_capture.py",
    "test_recorder_security.py",
    "test_recorder_stability.py",
    "test_recovery.py",
    "test_run.py",
    "test_scenarios.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in TORCH_FILES:
            item.add_marker(pytest.mark.torch)
