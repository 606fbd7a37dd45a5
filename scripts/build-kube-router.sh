#!/usr/bin/env bash
# Build the NetworkPolicy enforcer of the real-node tests: kube-router's network policy
# controller (github.com/cloudnativelabs/kube-router/v2 at the version pinned in
# e2e/tools/kube-router/go.mod), into .tools/node/bin/kube-router beside containerd.
#
# The tests run it as a host process with only its firewall (--run-firewall, no router, no
# service proxy) beside the bridge CNI: it enforces NetworkPolicy with iptables and ipset
# (Debian's iptables and ipset, scripts/install-node-packages.sh).
#
# Module mode with the pinned go.mod/go.sum (-mod=readonly: nothing is re-resolved), -trimpath,
# CGO_ENABLED=0, no VCS stamping. Go's module and build caches are reused, so only the first build
# is slow. Skipped while the binary is newer than every file in e2e/tools/kube-router/ and this
# script, built by this Go (--force rebuilds).
#
# Usage: scripts/build-kube-router.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=$ROOT/e2e/tools/kube-router
OUT=${SHAREGPU_NODE_BIN_DIR:-$ROOT/.tools/node/bin}
BIN=$OUT/kube-router
STAMP=$OUT/kube-router.stamp  # the toolchain that built $BIN: a new Go rebuilds
PKG=github.com/cloudnativelabs/kube-router/v2
GO_MIN=1.26

fail() {
    echo "build-kube-router: FAILED: $*" >&2
    exit 1
}

[ "${1:-}" = "--force" ] && FORCE=1

# shellcheck source=scripts/go-toolchain.sh
source "$ROOT/scripts/go-toolchain.sh"
VERSION=$(awk -v m="$PKG" '$1 == m {print $2; exit}' "$SRC/go.mod")
[ -n "$VERSION" ] || fail "e2e/tools/kube-router/go.mod pins no $PKG"

if [ -z "${FORCE:-}" ] && [ -x "$BIN" ] && [ -f "$STAMP" ] \
    && [ -z "$(find "$SRC" "$ROOT/scripts/build-kube-router.sh" -newer "$BIN" -print -quit)" ] \
    && [ "$(cat "$STAMP")" = "$("$GO" version 2>/dev/null)" ]; then
    echo "build-kube-router: $BIN is up to date"
    exit 0
fi

export GOFLAGS="-mod=readonly -buildvcs=false"
export GOWORK=off
export CGO_ENABLED=0
mkdir -p "$OUT"
tmp="$BIN.tmp.$$"
trap 'rm -f "$tmp"' EXIT
rm -f "$STAMP"
echo "build-kube-router: building kube-router $VERSION into $OUT ($("$GO" version | cut -d' ' -f3))"
start=$(date +%s)
ld="-s -w -buildid= -X $PKG/pkg/version.Version=$VERSION -X $PKG/pkg/version.BuildDate=module"
if ! (cd "$SRC" && nice -n 10 "$GO" build -p 2 -trimpath -ldflags "$ld" -o "$tmp" "$PKG/cmd/kube-router"); then
    fail "go build of kube-router exited non-zero after $(($(date +%s) - start))s (see above)"
fi
mv -f "$tmp" "$BIN"
"$GO" version >"$STAMP"
echo "build-kube-router: built $BIN in $(($(date +%s) - start))s ($(du -h "$BIN" | cut -f1))"
