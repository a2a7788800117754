#!/usr/bin/env bash
# GPU check for the torch reference engine: runs the tests marked `gpu` (CUDA KV pool, a shift
# with KV migration between two engines on one GPU, NCCL TP2 when two GPUs exist) and prints one
# JSON line. Needs the venv (deploy/bootstrap.sh). Bounded to 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
timeout 480 .venv/bin/pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$report" \
  tests/runtime/torch_engine/test_gpu.py >&2
rc=$?
.venv/bin/python - "$report" "$rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
import torch
suite = ET.parse(sys.argv[1]).getroot().iter("testsuite").__next__()
print(json.dumps({
    "gpus": torch.cuda.device_count(),
    "tests": int(suite.get("tests", 0)),
    "failures": int(suite.get("failures", 0)) + int(suite.get("errors", 0)),
    "skipped": int(suite.get("skipped", 0)),
    "tokens_equal": int(sys.argv[2]) == 0 and int(suite.get("skipped", 0)) < int(suite.get("tests", 0)),
    "pytest_rc": int(sys.argv[2]),
}))
PY
rm -f "$report"
exit "$rc"
