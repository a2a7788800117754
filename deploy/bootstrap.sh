#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: distribution packages, the venv with FlexPipe and its
# Python packages, the Kafka jars from Maven Central, and the eBPF toolchain. Quick when done before.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bootstrap: %s\n' "$*"; }

apt_install() {
  # Only what is missing; apt lists refreshed at most once per run.
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    say "missing ${missing[*]} and cannot apt-get install them (not root or no apt); install them by hand"
    return 1
  fi
  say "apt-get install ${missing[*]}"
  if [ -z "${_APT_UPDATED:-}" ]; then apt-get update -qq; _APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

command -v java >/dev/null || apt_install openjdk-17-jre-headless
command -v mvn >/dev/null || apt_install maven
command -v gcc >/dev/null || apt_install gcc libc6-dev
command -v promtool >/dev/null || apt_install prometheus || say "promtool unavailable: alert-rule tests will fail"

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { say "need Python >= 3.11 ($PY)"; exit 1; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.flexpipe-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "installing Python packages"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi

.venv/bin/flexpipe kafka jars >/dev/null
if [ -x deploy/bpf/setup.sh ]; then
  deploy/bpf/setup.sh || say "eBPF setup failed: eBPF tests will skip with the reason"
fi
say "ready"
