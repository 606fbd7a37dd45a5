#!/usr/bin/env bash
# Build the end-to-end control plane (etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler in one multi-call binary, from the pinned upstream modules in
# e2e/controlplane/go.mod) to .tools/bin/sharegpu-controlplane.
#
# Module mode with the pinned go.mod/go.sum (-mod=readonly: nothing is re-resolved), -trimpath,
# CGO_ENABLED=0, no VCS stamping: the same sources give the same binary. Go's module and build
# caches (GOMODCACHE, GOCACHE; their default locations unless set) are reused, so only the first
# build is slow. The build is skipped while the binary is newer than every file in
# e2e/controlplane/ and this script (FORCE=1 rebuilds anyway).
#
# Usage: scripts/build-controlplane.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=$ROOT/e2e/controlplane
OUT=${SHAREGPU_CONTROLPLANE_BIN:-$ROOT/.tools/bin/sharegpu-controlplane}
KUBE_VERSION=v1.37.2  # keep in step with k8s.io/kubernetes in e2e/controlplane/go.mod
GO_MIN=1.26           # go.mod's go line

fail() {
    echo "build-controlplane: FAILED: $*" >&2
    exit 1
}

[ "${1:-}" = "--force" ] && FORCE=1

# shellcheck source=scripts/go-toolchain.sh
source "$ROOT/scripts/go-toolchain.sh"
STAMP="$OUT.stamp"  # the toolchain that built $OUT: a new Go rebuilds

# Up to date? The binary must be newer than e2e/controlplane/ (its files, and the directory
# itself, whose time changes when a file is removed) and this script, built by this Go.
if [ -z "${FORCE:-}" ] && [ -x "$OUT" ] && [ -f "$STAMP" ]; then
    newer=$(find "$SRC" "$ROOT/scripts/build-controlplane.sh" -newer "$OUT" -print -quit)
    if [ -z "$newer" ] && [ "$(cat "$STAMP")" = "$("$GO" version 2>/dev/null)" ]; then
        echo "build-controlplane: $OUT is up to date"
        exit 0
    fi
fi

export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false"
export GOWORK=off
IFS=. read -r major minor _ <<<"${KUBE_VERSION#v}"
ldflags="-s -w -buildid="
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean"
done

mkdir -p "$(dirname "$OUT")"
tmp="$OUT.tmp.$$"
trap 'rm -f "$tmp"' EXIT
rm -f "$STAMP"
echo "build-controlplane: building $OUT ($("$GO" version | cut -d' ' -f3), GOCACHE=$("$GO" env GOCACHE))"
start=$(date +%s)
if ! (cd "$SRC" && nice -n 10 "$GO" build -p 2 -trimpath -ldflags "$ldflags" -o "$tmp" .); then
    fail "go build in e2e/controlplane exited non-zero after $(($(date +%s) - start))s (see above)"
fi
# go vet with the build's flags, so it reuses what the build compiled
if ! (cd "$SRC" && nice -n 10 "$GO" vet -p 2 -trimpath .); then
    fail "go vet in e2e/controlplane found problems (see above)"
fi
mv -f "$tmp" "$OUT"
"$GO" version >"$STAMP"
elapsed=$(($(date +%s) - start))
echo "build-controlplane: built and vetted $OUT in ${elapsed}s ($(du -h "$OUT" | cut -f1))"
