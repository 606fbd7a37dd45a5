#!/usr/bin/env bash
# Build the pinned container runtime of the real-node tests (containerd, its runc shim, ctr and
# runc, from the pinned modules in e2e/node/go.mod) into .tools/node/bin/.
#
# Module mode with the pinned go.mod/go.sum (-mod=readonly: nothing is re-resolved), -trimpath,
# no VCS stamping. containerd, the shim and ctr are pure Go (CGO_ENABLED=0, `no_btrfs`: the btrfs
# snapshotter needs C headers and is not used); runc needs cgo for its nsenter stage (gcc) and
# libseccomp (libseccomp-dev, pkg-config) for the `seccomp` tag: pods asking for the
# RuntimeDefault seccomp profile (as the chart's do) get it.
# Go's module and build caches are reused, so only the first build is slow. The build is skipped
# while every binary is newer than every file in e2e/node/ and this script (--force rebuilds).
#
# Usage: scripts/build-node.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=$ROOT/e2e/node
OUT=${SHAREGPU_NODE_BIN_DIR:-$ROOT/.tools/node/bin}
CONTAINERD_VERSION=v2.4.2  # keep in step with e2e/node/go.mod
RUNC_VERSION=v1.5.2        # keep in step with e2e/node/go.mod
GO_MIN=1.26
BINARIES=(containerd containerd-shim-runc-v2 ctr runc)

fail() {
    echo "build-node: FAILED: $*" >&2
    exit 1
}

[ "${1:-}" = "--force" ] && FORCE=1

# shellcheck source=scripts/go-toolchain.sh
source "$ROOT/scripts/go-toolchain.sh"
command -v "${CC:-gcc}" >/dev/null || fail "runc needs a C compiler for its nsenter stage (apt-get install gcc)"
pkg-config --exists libseccomp 2>/dev/null \
    || fail "runc needs libseccomp for seccomp profiles (apt-get install libseccomp-dev pkg-config)"
STAMP="$OUT/.stamp"

if [ -z "${FORCE:-}" ] && [ -f "$STAMP" ]; then
    uptodate=1
    for b in "${BINARIES[@]}"; do
        if [ ! -x "$OUT/$b" ] || [ -n "$(find "$SRC" "$ROOT/scripts/build-node.sh" -newer "$OUT/$b" -print -quit)" ]; then
            uptodate=
        fi
    done
    if [ -n "$uptodate" ] && [ "$(cat "$STAMP")" = "$("$GO" version 2>/dev/null)" ]; then
        echo "build-node: $OUT is up to date"
        exit 0
    fi
fi

export GOFLAGS="-mod=readonly -buildvcs=false"
export GOWORK=off
mkdir -p "$OUT"
tmp=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
rm -f "$STAMP"
echo "build-node: building containerd $CONTAINERD_VERSION and runc $RUNC_VERSION into $OUT ($("$GO" version | cut -d' ' -f3))"
start=$(date +%s)
cd "$SRC"
cld="-s -w -buildid= -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
cld+=" -X github.com/containerd/containerd/v2/version.Revision=module"
if ! CGO_ENABLED=0 nice -n 10 "$GO" build -p 2 -trimpath -tags no_btrfs -ldflags "$cld" -o "$tmp/" \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr; then
    fail "go build of containerd exited non-zero after $(($(date +%s) - start))s (see above)"
fi
rld="-s -w -buildid= -X main.version=${RUNC_VERSION#v}"
if ! CGO_ENABLED=1 nice -n 10 "$GO" build -p 2 -trimpath -tags seccomp -ldflags "$rld" -o "$tmp/runc" \
    github.com/opencontainers/runc; then
    fail "go build of runc exited non-zero after $(($(date +%s) - start))s (see above)"
fi
for b in "${BINARIES[@]}"; do
    mv -f "$tmp/$b" "$OUT/$b"
done
"$GO" version >"$STAMP"
echo "build-node: built ${BINARIES[*]} in $(($(date +%s) - start))s ($(du -ch "${BINARIES[@]/#/$OUT/}" | tail -1 | cut -f1))"
