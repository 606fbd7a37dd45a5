#!/usr/bin/env bash
# Installs the command-line tools the tests drive into .tools/bin (git-ignored), each built from
# its upstream Go module at the version pinned in e2e/tools/<tool>/go.mod, every module checked
# against go.sum:
#   helm     always (the chart tests run helm lint / template / install): helm.sh/helm/v4;
#   kubectl  only when none is on PATH, or to keep the one built here up to date (the plugin
#            test runs `kubectl inspect cgpu`): k8s.io/kubectl.
#
# Module mode with the pinned go.mod/go.sum (-mod=readonly: nothing is re-resolved), -trimpath,
# CGO_ENABLED=0, no VCS stamping. Go's module and build caches are reused, and a build is
# skipped while its binary is newer than every file of its e2e/tools/<tool>/ and this script,
# built by this Go (FORCE=1 rebuilds anyway). Measured on the shared, busy 2-core machine at
# -p 1: helm 65 minutes the first time, 44 s with Go's build cache warm; kubectl 24 minutes and
# 22 s.
#
# GO_PARALLEL sets go build's -p (default 1: the development machine is shared; CI sets more).
#
# Usage: scripts/install-tools.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=$ROOT/.tools/bin
GO_MIN=1.26  # e2e/tools/*/go.mod's go line

fail() {
    echo "install-tools: FAILED: $*" >&2
    exit 1
}

[ "${1:-}" = "--force" ] && FORCE=1

# shellcheck source=scripts/go-toolchain.sh
source "$ROOT/scripts/go-toolchain.sh"
export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false"
export GOWORK=off

# pinned: the version a module's go.mod requires
pinned() {
    awk -v m="$2" '$1 == m {print $2; exit}' "$ROOT/e2e/tools/$1/go.mod"
}

# build TOOL PACKAGE LDFLAGS [vet]: e2e/tools/TOOL's PACKAGE to .tools/bin/TOOL
build() {
    local tool=$1 pkg=$2 ldflags=$3 vet=${4:-}
    local src=$ROOT/e2e/tools/$tool out=$BIN/$tool
    local stamp=$out.stamp  # the toolchain that built $out: a new Go rebuilds
    if [ -z "${FORCE:-}" ] && [ -x "$out" ] && [ -f "$stamp" ]; then
        local newer
        newer=$(find "$src" "$ROOT/scripts/install-tools.sh" -newer "$out" -print -quit)
        if [ -z "$newer" ] && [ "$(cat "$stamp")" = "$("$GO" version 2>/dev/null)" ]; then
            return 0
        fi
    fi
    mkdir -p "$BIN"
    local tmp="$out.tmp.$$" start
    start=$(date +%s)
    rm -f "$stamp"
    echo "install-tools: building $out from $pkg ($("$GO" version | cut -d' ' -f3))"
    if ! (cd "$src" && nice -n 10 "$GO" build -p "${GO_PARALLEL:-1}" -trimpath -ldflags "-s -w -buildid= $ldflags" \
            -o "$tmp" "$pkg"); then
        rm -f "$tmp"
        fail "go build in e2e/tools/$tool exited non-zero after $(($(date +%s) - start))s"
    fi
    if [ -n "$vet" ] && ! (cd "$src" && nice -n 10 "$GO" vet -p "${GO_PARALLEL:-1}" -trimpath .); then
        rm -f "$tmp"
        fail "go vet in e2e/tools/$tool found problems (see above)"
    fi
    mv -f "$tmp" "$out"
    "$GO" version >"$stamp"
    echo "install-tools: built $out in $(($(date +%s) - start))s"
}

helm_version=$(pinned helm helm.sh/helm/v4)
[ -n "$helm_version" ] || fail "e2e/tools/helm/go.mod pins no helm.sh/helm/v4"
build helm helm.sh/helm/v4/cmd/helm "-X helm.sh/helm/v4/internal/version.version=$helm_version"

if [ -x "$BIN/kubectl" ] || ! command -v kubectl >/dev/null 2>&1; then
    kube=$(pinned kubectl k8s.io/kubectl)  # v0.X.Y is Kubernetes v1.X.Y
    [ -n "$kube" ] || fail "e2e/tools/kubectl/go.mod pins no k8s.io/kubectl"
    kube=v1.${kube#v0.}
    IFS=. read -r major minor _ <<<"${kube#v}"
    ldflags=""
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $p.gitVersion=$kube -X $p.gitMajor=$major -X $p.gitMinor=$minor"
        ldflags+=" -X $p.gitTreeState=clean"
    done
    build kubectl . "$ldflags" vet
fi
