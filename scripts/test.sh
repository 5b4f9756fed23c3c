#!/usr/bin/env bash
# Install everything the tests need on a fresh machine and run them: the whole suite on
# torch 2.15, then the torch-dependent part again on torch 2.13 in its own virtualenv
# (the real-job corpus there: the cases recorded by frtools only).
#
#   scripts/test.sh                 # both torch versions
#   FRTOOLS_TEST_TORCHES=2.15 scripts/test.sh    # one version only
#   scripts/test.sh -k report       # extra arguments go to pytest (both runs)
#
# torch 2.15.0 on PyPI is the CUDA build (several GB; it runs on CPU). Where the machine pins
# an older torch with a pip constraint, PIP_CONSTRAINT=/dev/null lifts it for that one call.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCHES="${FRTOOLS_TEST_TORCHES:-2.15 2.13}"
PY="${PYTHON:-python}"

# A Debian package a test needs, unless its command is already there: apt_install CMD PKG WHY
apt_install() {
    command -v "$1" >/dev/null 2>&1 && return 0
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$2" >/dev/null
    else
        echo "scripts/test.sh: install $3 (package '$2') for its test" >&2
    fi
}
# Headless Chromium for the HTML report's browser test.
apt_install chromium chromium Chromium
# The Prometheus server (and promtool) for tests/test_live.py: a real Prometheus scrapes
# `frtools metrics` and fires monitoring/frtools-alerts.yml.
apt_install prometheus prometheus Prometheus

status=0
for version in $TORCHES; do
    case "$version" in
    2.15)
        PIP_CONSTRAINT=/dev/null "$PY" -m pip install --quiet torch==2.15.0 -e ".[test]"
        echo "== torch 2.15: the whole suite"
        "$PY" -m pytest -q "$@" || status=$?
        ;;
    2.13)
        venv=".venv-torch2.13"
        [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        "$venv/bin/python" -m pip install --quiet torch==2.13.0 -e ".[test]"
        # The torch-dependent tests again, but not the real-job corpus cases that PyTorch's
        # own recorder writes (its 2.13 dumps are read by the sample_dumps and scenario
        # tests); the corpus cases under frtools run check the recorder on this torch.
        echo "== torch 2.13: the torch-dependent tests (marker torch, not fr_recorder)"
        "$venv/bin/python" -m pytest -q -m "torch and not fr_recorder" "$@" || status=$?
        ;;
    *)
        echo "scripts/test.sh: unknown torch version $version (2.15 or 2.13)" >&2
        exit 2
        ;;
    esac
done
exit $status
