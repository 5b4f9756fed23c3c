import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

# Test files whose tests run torch itself (real jobs, the recorder): `scripts/test.sh` runs
# them again on the older supported torch (`pytest -m torch`).
TORCH_FILES = {
    "test_all_to_all_splits.py",
    "test_blackbox.py",
    "test_demo.py",
    "test_dump.py",
    "test_native_stacks.py",
    "test_pytest_plugin.py",
    "test_real_corpus.py",
    "test_recorder_capture.py",
    "test_recorder_security.py",
    "test_recorder_stability.py",
    "test_recovery.py",
    "test_recovery_hostile.py",
    "test_run.py",
    "test_scenarios.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in TORCH_FILES:
            item.add_marker(pytest.mark.torch)


@pytest.fixture(scope="session")
def native_hooks_module():
    """The C++ process-group hook body, built once (about a minute the first time on a
    machine, then cached per user and torch); the test is skipped where it cannot be."""
    from frtools.config import NATIVE_HOOKS
    from frtools.recorder import native_hooks

    if NATIVE_HOOKS.read() == "off":
        pytest.skip("FRTOOLS_NATIVE_HOOKS=0")
    try:
        native_hooks.build()
    except Exception as exc:
        pytest.skip(f"the C++ hook body cannot be built here: {type(exc).__name__}: {exc}")
    module = native_hooks.load(build_if_missing=False)
    if module is None:
        pytest.skip("the C++ hook body was built but does not load")
    return module


@pytest.fixture(scope="session")
def corpus_runs(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Run a real-corpus case's job (tests/corpus) the first time a test asks for it; later
    tests, in any file of the session, reuse its dumps: no job runs twice."""
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:  # ``tests.corpus`` is imported from the repository root
        sys.path.insert(0, repo)
    from tests.corpus.cases import JOBS
    from tests.corpus.harness import run_case

    root = tmp_path_factory.mktemp("real-corpus")
    runs: dict = {}

    def get(case):  # noqa: ANN001, ANN202
        if case.job not in runs:
            runs[case.job] = run_case(JOBS[case.job], root / case.job)
        return runs[case.job]

    return get
