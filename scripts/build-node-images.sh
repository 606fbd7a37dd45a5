#!/usr/bin/env bash
# Make the images the real-node tests run, without a registry, as docker-archives under
# .tools/images/ (imported into each node's containerd with `ctr -n k8s.io images import`):
#
#   base.tar       docker.io/library/python:3.12-slim-bookworm: a STAND-IN for the Dockerfile's
#                  FROM, a Debian bookworm root filesystem made by mmdebstrap (minbase, python3
#                  3.11, pip, ca-certificates) with python3/pip at /usr/local/bin as in the
#                  official image and pip allowed to install system-wide (no EXTERNALLY-MANAGED)
#   sharegpu.tar   ghcr.io/sharegpu/sharegpu:<chart appVersion>: the project's image, built from
#                  the repository's Dockerfile by scripts/build-image.sh (buildah) on the
#                  stand-in base (--base). The tag the chart asks for: a pre-release such as
#                  0.2.0-dev between releases; a released version only when HEAD is that
#                  release's tag v<version> and the image's inputs are committed (the image
#                  built here is then that release's), else the script fails
#   pause.tar      sharegpu.local/pause:e2e: the pod sandbox, a static pause binary (pause.c)
#   hami.tar       docker.io/projecthami/hami:<chart's hami tag>: a STAND-IN of HAMi's image laid
#                  out as HAMi's (/k8s-vgpu/lib/nvidia/libvgpu.so.<tag>) holding the stand-in
#                  interposer of the tests (tests/isolation/standin_vgpu.c); the base's /bin/sh
#                  runs the chart's hami-install script
#   hami-nolib.tar the same image without the library (sharegpu.local/hami-nolib:e2e)
#   kube-scheduler.tar  registry.k8s.io/kube-scheduler:v<major>.<minor>.0 (the chart's default
#                  tag): the pinned kube-scheduler of .tools/bin/sharegpu-controlplane
#                  (e2e/controlplane, k8s.io/kubernetes v1.37.2), nothing else in the image
#
# Each archive is rebuilt only when one of its inputs is newer (--force: all). buildah's storage
# is .tools/images/storage (overlay). Needs root, buildah and mmdebstrap
# (scripts/install-node-packages.sh), gcc, and for kube-scheduler.tar the control plane binary
# (scripts/build-controlplane.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${SHAREGPU_IMAGES_DIR:-$ROOT/.tools/images}
CP_BIN=${SHAREGPU_CONTROLPLANE_BIN:-$ROOT/.tools/bin/sharegpu-controlplane}
SELF=$ROOT/scripts/build-node-images.sh
APP_VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/sharegpu/Chart.yaml)
HAMI_TAG=$(sed -n '/^  hami:/,/^  [a-z]/{s/^      tag: *\([^ #]*\).*/\1/p}' charts/sharegpu/values.yaml | head -n1)
BASE_REF=docker.io/library/python:3.12-slim-bookworm
SHAREGPU_REF=ghcr.io/sharegpu/sharegpu:$APP_VERSION
PAUSE_REF=sharegpu.local/pause:e2e
HAMI_REF=docker.io/projecthami/hami:$HAMI_TAG
HAMI_NOLIB_REF=sharegpu.local/hami-nolib:e2e
SCHED_REF=registry.k8s.io/kube-scheduler:v1.37.0  # the chart's default tag on a v1.37 cluster
SUITE=bookworm

fail() {
    echo "build-node-images: FAILED: $*" >&2
    exit 1
}
[ "${1:-}" = "--force" ] && FORCE=1
[ -n "$APP_VERSION" ] || fail "no appVersion in charts/sharegpu/Chart.yaml"
[ -n "$HAMI_TAG" ] || fail "no agent.hami.image.tag in charts/sharegpu/values.yaml"
# the image built here is the working tree's: it carries a released version's tag only at that
# release's tag
if [[ "$APP_VERSION" != *-* ]]; then
    tagged=$(git rev-parse -q --verify "refs/tags/v$APP_VERSION^{commit}" 2>/dev/null) \
        || fail "appVersion $APP_VERSION is a released version and there is no tag v$APP_VERSION: the image built from this tree is not $SHAREGPU_REF (between releases the chart carries a pre-release, e.g. 0.2.0-dev; docs/release.md)"
    [ "$(git rev-parse HEAD)" = "$tagged" ] \
        || fail "appVersion $APP_VERSION is a released version and HEAD is not v$APP_VERSION: the image built from this tree is not $SHAREGPU_REF"
    [ -z "$(git status --porcelain -- Dockerfile pyproject.toml README.md LICENSE constraints.txt src)" ] \
        || fail "appVersion $APP_VERSION is a released version and the image's inputs have uncommitted changes: the image built from this tree is not $SHAREGPU_REF"
fi
for t in buildah mmdebstrap gcc; do
    command -v "$t" >/dev/null || fail "$t is missing (scripts/install-node-packages.sh)"
done
[ "$(id -u)" = 0 ] || fail "buildah and mmdebstrap run as root here"

mkdir -p "$OUT/storage" "$OUT/run"
export CONTAINERS_STORAGE_CONF=$OUT/storage.conf
cat >"$CONTAINERS_STORAGE_CONF" <<EOF
[storage]
driver = "overlay"
graphroot = "$OUT/storage"
runroot = "$OUT/run"
EOF

# stale FILE INPUT...: FILE is missing or an input (file or directory tree) is newer
stale() {
    local file=$1
    shift
    [ -n "${FORCE:-}" ] && return 0
    [ -f "$file" ] || return 0
    [ -n "$(find "$@" "$SELF" -newer "$file" -print -quit 2>/dev/null)" ]
}
timed() {  # timed NAME CMD...: run, print the time
    local t0=$(date +%s)
    "$@"
    echo "build-node-images: $1 done in $(($(date +%s) - t0))s"
}
commit_from_rootfs() {  # REF ROOTFS_TAR [extra buildah config args...]
    local ref=$1 tar=$2
    shift 2
    local c
    c=$(buildah from --pull=never scratch)
    buildah add --quiet "$c" "$tar" / >/dev/null
    buildah config "$@" "$c"
    buildah commit --quiet --rm "$c" "$ref" >/dev/null
}
archive() {  # REF FILE
    rm -f "$2.tmp"
    buildah push --quiet "$1" "docker-archive:$2.tmp:$1" >/dev/null
    mv -f "$2.tmp" "$2"
    echo "build-node-images: $2 ($1, $(du -h "$2" | cut -f1))"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$OUT/refs.env" <<EOF
BASE_REF=$BASE_REF
SHAREGPU_REF=$SHAREGPU_REF
PAUSE_REF=$PAUSE_REF
HAMI_REF=$HAMI_REF
HAMI_NOLIB_REF=$HAMI_NOLIB_REF
SCHED_REF=$SCHED_REF
EOF

# ---- the stand-in base -----------------------------------------------------------------------
make_base() {
    if stale "$OUT/base-rootfs.tar"; then
        mmdebstrap --quiet --variant=minbase --include=python3,python3-pip,ca-certificates \
            --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
            --customize-hook='ln -sf /usr/bin/python3 "$1"/usr/local/bin/python3' \
            --customize-hook='ln -sf /usr/bin/python3 "$1"/usr/local/bin/python' \
            --customize-hook='ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip3' \
            --customize-hook='ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip' \
            --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
            "$SUITE" "$OUT/base-rootfs.tmp.tar" || fail "mmdebstrap"
        mv -f "$OUT/base-rootfs.tmp.tar" "$OUT/base-rootfs.tar"
    fi
    if stale "$OUT/base.tar" "$OUT/base-rootfs.tar" || ! buildah inspect --type image "$BASE_REF" >/dev/null 2>&1; then
        buildah rmi -f "$BASE_REF" >/dev/null 2>&1 || true
        commit_from_rootfs "$BASE_REF" "$OUT/base-rootfs.tar" \
            --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
            --env LANG=C.UTF-8 --cmd python3 \
            --label org.opencontainers.image.description="sharegpu e2e stand-in for $BASE_REF (Debian $SUITE)"
        archive "$BASE_REF" "$OUT/base.tar"
    fi
}
timed make_base

# ---- the project's image, from its Dockerfile ----------------------------------------------
make_sharegpu() {
    if stale "$OUT/sharegpu.tar" Dockerfile pyproject.toml README.md LICENSE constraints.txt src \
        "$OUT/base.tar" scripts/build-image.sh; then
        bash scripts/build-image.sh --tag "$SHAREGPU_REF" --base "$BASE_REF" \
            --output-archive "$OUT/sharegpu.tar.tmp"
        mv -f "$OUT/sharegpu.tar.tmp" "$OUT/sharegpu.tar"
    fi
}
timed make_sharegpu

# ---- pause ---------------------------------------------------------------------------------
make_pause() {
    stale "$OUT/pause.tar" || return 0
    cat >"$work/pause.c" <<'EOF'
/* The pod sandbox's process: sleeps until SIGINT/SIGTERM, reaps children. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction q = {.sa_handler = quit}, r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &q, NULL);
    sigaction(SIGTERM, &q, NULL);
    sigaction(SIGCHLD, &r, NULL);
    for (;;) pause();
}
EOF
    gcc -static -O2 -Wall -o "$work/pause" "$work/pause.c" || fail "compiling pause.c (static: libc6-dev)"
    local c
    c=$(buildah from --pull=never scratch)
    buildah copy --quiet "$c" "$work/pause" /pause >/dev/null
    buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
    buildah commit --quiet --rm "$c" "$PAUSE_REF" >/dev/null
    archive "$PAUSE_REF" "$OUT/pause.tar"
}
timed make_pause

# ---- HAMi stand-in ---------------------------------------------------------------------------
make_hami() {
    stale "$OUT/hami.tar" tests/isolation/standin_vgpu.c "$OUT/base-rootfs.tar" \
        charts/sharegpu/values.yaml || return 0
    gcc -shared -fPIC -O1 -Wall -o "$work/libvgpu.so" tests/isolation/standin_vgpu.c -ldl -lpthread \
        || fail "compiling tests/isolation/standin_vgpu.c"
    local label="sharegpu e2e stand-in for $HAMI_REF: tests/isolation/standin_vgpu.c as libvgpu.so"
    commit_from_rootfs "$HAMI_NOLIB_REF" "$OUT/base-rootfs.tar" --cmd /bin/sh \
        --label org.opencontainers.image.description="$label (without the library)"
    archive "$HAMI_NOLIB_REF" "$OUT/hami-nolib.tar"
    local c
    c=$(buildah from --pull=never "$HAMI_NOLIB_REF")
    buildah run --isolation chroot "$c" -- mkdir -p /k8s-vgpu/lib/nvidia
    buildah copy --quiet --chmod 0755 "$c" "$work/libvgpu.so" "/k8s-vgpu/lib/nvidia/libvgpu.so.$HAMI_TAG" >/dev/null
    buildah config --label org.opencontainers.image.description="$label" "$c"
    buildah commit --quiet --rm "$c" "$HAMI_REF" >/dev/null
    archive "$HAMI_REF" "$OUT/hami.tar"
}
timed make_hami

# ---- kube-scheduler ------------------------------------------------------------------------
make_scheduler() {
    [ -x "$CP_BIN" ] || fail "$CP_BIN is missing (scripts/build-controlplane.sh)"
    stale "$OUT/kube-scheduler.tar" "$CP_BIN" || return 0
    mkdir -p "$work/sched/usr/local/bin"
    cp "$CP_BIN" "$work/sched/usr/local/bin/sharegpu-controlplane"
    ln -s sharegpu-controlplane "$work/sched/usr/local/bin/kube-scheduler"
    local c
    c=$(buildah from --pull=never scratch)
    buildah copy --quiet "$c" "$work/sched" / >/dev/null
    buildah config --env PATH=/usr/local/bin --user 65532:65532 \
        --label org.opencontainers.image.description="kube-scheduler of sharegpu's e2e control plane (k8s.io/kubernetes v1.37.2)" "$c"
    buildah commit --quiet --rm "$c" "$SCHED_REF" >/dev/null
    archive "$SCHED_REF" "$OUT/kube-scheduler.tar"
}
timed make_scheduler

echo "build-node-images: images in $OUT"
