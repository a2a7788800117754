#!/usr/bin/env bash
# Set up the eBPF launch probe's dependencies on a Debian node (idempotent; run as root).
#
#   1. BCC's Python module from Debian (`python3-bpfcc`; the PyPI package named `bcc` is an
#      unrelated lattice library and is never installed).
#   2. Kernel headers for BCC's compile: the newest Debian linux-headers-6.12.x pair (-amd64 and
#      -common) unpacked and merged into one tree under .cache/kernel-headers/, for use as
#      BCC_KERNEL_SOURCE on machines that ship no headers of their own.
#   3. Only the `bcc` package exposed to the project's venv (a symlink in its site-packages).
#   4. A compile check: BCC builds a trivial program against the merged headers.
#
# Exits 0 with "eBPF setup skipped: <why>" when it cannot apply here (not root, no apt, not
# Debian amd64); exits non-zero only when a step that should have worked failed.
#
# Environment: VENV (default <repo>/.venv), FLEXPIPE_HEADERS_CACHE (default
# <repo>/.cache/kernel-headers), HEADERS_SERIES (default 6.12).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
CACHE="${FLEXPIPE_HEADERS_CACHE:-$REPO/.cache/kernel-headers}"
SERIES="${HEADERS_SERIES:-6.12}"
SYS_PY=/usr/bin/python3

say() { printf 'bpf-setup: %s\n' "$*"; }
skip() { printf 'eBPF setup skipped: %s\n' "$*"; exit 0; }
die() { printf 'eBPF setup FAILED: %s\n' "$*" >&2; exit 1; }

[[ "$(id -u)" == 0 ]] || skip "not root (needs apt-get and dpkg); run deploy/bpf/setup.sh as root"
command -v apt-get >/dev/null || skip "no apt-get (BCC is taken from Debian's python3-bpfcc)"
[[ "$(dpkg --print-architecture 2>/dev/null)" == amd64 ]] \
    || skip "architecture is not amd64 (headers pair is Debian's -amd64 flavour)"
[[ -x "$SYS_PY" ]] || skip "no system $SYS_PY (python3-bpfcc installs bcc for it)"

APT_UPDATED=0
apt_update_once() {
    if [[ "$APT_UPDATED" == 0 ]]; then
        say "apt-get update"
        apt-get update -qq || die "apt-get update failed"
        APT_UPDATED=1
    fi
}

# --- 1. BCC ---------------------------------------------------------------------------------
if "$SYS_PY" -c 'import bcc' 2>/dev/null; then
    say "python3-bpfcc already installed"
else
    say "installing python3-bpfcc"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-bpfcc >/dev/null; then
        apt_update_once
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-bpfcc >/dev/null \
            || die "apt-get install python3-bpfcc failed"
    fi
    "$SYS_PY" -c 'import bcc' || die "python3-bpfcc installed but 'import bcc' fails"
fi
BCC_DIR="$("$SYS_PY" -c 'import bcc, os; print(os.path.dirname(bcc.__file__))')"

# --- 2. Kernel headers ----------------------------------------------------------------------
newest_headers() {
    apt-cache search --names-only "^linux-headers-${SERIES//./\\.}\\.[0-9]+\\+deb[0-9]+-amd64\$" \
        | awk '{print $1}' | sort -V | tail -n 1
}
PKG="$(newest_headers)"
if [[ -z "$PKG" ]]; then
    apt_update_once
    PKG="$(newest_headers)"
fi
[[ -n "$PKG" ]] || die "no linux-headers-${SERIES}.*-amd64 package in apt's lists"
VER="${PKG#linux-headers-}"
VER="${VER%-amd64}"               # e.g. 6.12.117+deb12
COMMON_PKG="linux-headers-${VER}-common"
TREE="$CACHE/linux-headers-${VER}"

if [[ -f "$TREE/.flexpipe-complete" ]]; then
    say "kernel headers already merged at $TREE"
else
    say "downloading $PKG and $COMMON_PKG"
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/flexpipe-headers.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    chown _apt "$WORK" 2>/dev/null || true  # apt drops to _apt to download; let it write here
    (cd "$WORK" && apt-get download -qq "$PKG" "$COMMON_PKG") \
        || { apt_update_once; (cd "$WORK" && apt-get download -qq "$PKG" "$COMMON_PKG"); } \
        || die "apt-get download $PKG $COMMON_PKG failed"
    mkdir -p "$WORK/root"
    for deb in "$WORK"/*.deb; do
        dpkg-deb -x "$deb" "$WORK/root" || die "dpkg-deb -x $deb failed"
    done
    FLAVOUR_DIR="$WORK/root/usr/src/linux-headers-${VER}-amd64"
    COMMON_DIR="$WORK/root/usr/src/linux-headers-${VER}-common"
    [[ -d "$FLAVOUR_DIR" && -d "$COMMON_DIR" ]] || die "unexpected layout in the headers packages"
    # NOTE: -amd64 holds only the generated headers, .config and Module.symvers (its Makefile
    # includes -common's by absolute path); -common holds the rest. BCC takes one tree as
    # BCC_KERNEL_SOURCE, and neither alone compiles (-amd64 lacks include/linux/kconfig.h,
    # -common lacks include/generated/autoconf.h). So copy -common and lay -amd64's real files
    # over it; -amd64's scripts/ and tools/ symlinks into linux-kbuild are dropped (BCC never
    # runs kbuild).
    rm -rf "$TREE.tmp"
    mkdir -p "$TREE.tmp"
    cp -a "$COMMON_DIR/." "$TREE.tmp/"
    (cd "$FLAVOUR_DIR" && find . \( -type f -o -type d \) -print0) | while IFS= read -r -d '' p; do
        if [[ -d "$FLAVOUR_DIR/$p" ]]; then
            mkdir -p "$TREE.tmp/$p"
        elif [[ "$p" == ./Makefile ]]; then
            :  # the flavour's Makefile only includes -common's by absolute path
        else
            cp -a "$FLAVOUR_DIR/$p" "$TREE.tmp/$p"
        fi
    done
    [[ -f "$TREE.tmp/include/generated/autoconf.h" ]] || die "merged tree lacks autoconf.h"
    [[ -f "$TREE.tmp/arch/x86/include/generated/uapi/asm/unistd_64.h" ]] \
        || die "merged tree lacks generated asm headers"
    touch "$TREE.tmp/.flexpipe-complete"
    rm -rf "$TREE"
    mv "$TREE.tmp" "$TREE"
    say "merged kernel headers into $TREE"
fi
ln -sfn "$(basename "$TREE")" "$CACHE/current"
for old in "$CACHE"/linux-headers-*; do  # trees of older header releases
    [[ "$old" == "$TREE" || ! -d "$old" ]] || { rm -rf "$old"; say "removed old $old"; }
done

# --- 3. bcc in the venv ---------------------------------------------------------------------
if [[ -x "$VENV/bin/python" ]]; then
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if [[ -L "$SITE/bcc" && "$(readlink "$SITE/bcc")" == "$BCC_DIR" ]]; then
        say "bcc already linked into $SITE"
    elif [[ -e "$SITE/bcc" && ! -L "$SITE/bcc" ]]; then
        die "$SITE/bcc exists and is not our link (the unrelated PyPI 'bcc'?); remove it"
    else
        ln -sfn "$BCC_DIR" "$SITE/bcc"
        say "linked $BCC_DIR into $SITE"
    fi
    CHECK_PY="$VENV/bin/python"
else
    say "no venv at $VENV; bcc is available to $SYS_PY only"
    CHECK_PY="$SYS_PY"
fi

# --- 4. Compile check -----------------------------------------------------------------------
BCC_KERNEL_SOURCE="$CACHE/current" "$CHECK_PY" - <<'EOF' || die "BCC cannot compile with $CACHE/current"
import bcc
b = bcc.BPF(
    text="BPF_HASH(c, u32, u64); int f(void *ctx) { return 0; }",
    cflags=["-Wno-ignored-attributes", "-Wno-unused-value"],
)
b.cleanup()
EOF
say "BCC compiles against $CACHE/current"
say "done: export BCC_KERNEL_SOURCE=$CACHE/current (the probe finds it there by itself)"
