#!/usr/bin/env bash
# The test command (`make test`, `.ci/run`): lint, type-check, then pytest. The pytest session
# starts its own Kafka broker (tests/conftest.py) unless FLEXPIPE_KAFKA__BOOTSTRAP_SERVERS is set,
# and this script stops it even when pytest is killed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTEST_KAFKA_RUN_NAME="pytest-$$"
trap '.venv/bin/flexpipe kafka down --name "$PYTEST_KAFKA_RUN_NAME" >/dev/null 2>&1 || true' EXIT

echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy .
echo "== pytest"; .venv/bin/pytest "$@"
