#!/usr/bin/env bash
# Build sharegpu's image from the repository's Dockerfile.
#
#   scripts/build-image.sh --tag TAG [--builder buildah|docker] [--platform LIST] [--push]
#                          [--output-archive FILE] [--base REF]
#
#   --tag             the image reference to build (e.g. ghcr.io/sharegpu/sharegpu:0.2.0-dev)
#   --builder         buildah (default; the tests: rootful, --isolation chroot, --pull=never:
#                     the Dockerfile's FROM must be in buildah's local storage already) or
#                     docker (the release: docker buildx, multi-platform, may push)
#   --platform        comma-separated platforms, e.g. linux/amd64,linux/arm64 (default: the host's)
#   --push            push TAG to its registry after the build
#   --output-archive  also write the image to FILE (buildah: a docker-archive, which
#                     `ctr images import` and `docker load` read; several platforms: an OCI
#                     archive of the manifest list; docker: an OCI archive from buildx)
#   --base            the base image instead of the Dockerfile's pinned digest (the tests'
#                     stand-in, which has a tag and no digest)
#
# The image's OCI labels get the chart's appVersion (org.opencontainers.image.version) and the
# checkout's commit (org.opencontainers.image.revision, "-dirty" when the image's inputs have
# uncommitted changes).
# buildah only: the build's RUN steps get the host's CA bundle (SHAREGPU_BUILD_CA_BUNDLE, else
# $SSL_CERT_FILE, else /etc/ssl/certs/ca-certificates.crt when present) mounted at
# /etc/ssl/certs/ca-certificates.crt and a pip.conf naming it, so pip reaches PyPI through a
# TLS-intercepting proxy; nothing of it stays in the image. CONTAINERS_STORAGE_CONF, when set,
# picks buildah's storage (scripts/build-node-images.sh uses one under .tools/).
# Prints the image's size and the build's duration.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
fail() {
    echo "build-image: FAILED: $*" >&2
    exit 1
}

TAG="" BUILDER=buildah PLATFORM="" PUSH="" ARCHIVE="" BASE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) [ $# -ge 2 ] || usage; TAG=$2; shift 2 ;;
        --tag=*) TAG=${1#*=}; shift ;;
        --builder) [ $# -ge 2 ] || usage; BUILDER=$2; shift 2 ;;
        --builder=*) BUILDER=${1#*=}; shift ;;
        --platform) [ $# -ge 2 ] || usage; PLATFORM=$2; shift 2 ;;
        --platform=*) PLATFORM=${1#*=}; shift ;;
        --push) PUSH=1; shift ;;
        --output-archive) [ $# -ge 2 ] || usage; ARCHIVE=$2; shift 2 ;;
        --output-archive=*) ARCHIVE=${1#*=}; shift ;;
        --base) [ $# -ge 2 ] || usage; BASE=$2; shift 2 ;;
        --base=*) BASE=${1#*=}; shift ;;
        -h|--help) usage ;;
        *) echo "build-image: unknown argument '$1'" >&2; usage ;;
    esac
done
[ -n "$TAG" ] || fail "--tag is required"
case "$BUILDER" in buildah|docker) ;; *) fail "--builder must be buildah or docker, not '$BUILDER'" ;; esac
if [ -n "$ARCHIVE" ]; then
    mkdir -p "$(dirname "$ARCHIVE")"
    ARCHIVE=$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")
fi
multi=""
[[ "$PLATFORM" == *,* ]] && multi=1
version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/sharegpu/Chart.yaml)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git status --porcelain -- Dockerfile pyproject.toml README.md LICENSE constraints.txt src 2>/dev/null)" ]; then
    revision=$revision-dirty
fi
build_args=(--build-arg "VERSION=${version:-unknown}" --build-arg "REVISION=$revision")
[ -n "$BASE" ] && build_args+=(--build-arg "BASE_IMAGE=$BASE")
start=$(date +%s)

if [ "$BUILDER" = docker ]; then
    command -v docker >/dev/null || fail "docker is not installed (--builder docker needs docker buildx)"
    docker buildx version >/dev/null 2>&1 || fail "docker buildx is not available"
    args=(buildx build --file Dockerfile --tag "$TAG" "${build_args[@]}")
    [ -n "$PLATFORM" ] && args+=(--platform "$PLATFORM")
    outputs=()
    [ -n "$PUSH" ] && outputs+=(--output "type=registry")
    [ -n "$ARCHIVE" ] && outputs+=(--output "type=oci,dest=$ARCHIVE")
    # one platform, nothing pushed or written: load it into the local docker
    [ ${#outputs[@]} -eq 0 ] && [ -z "$multi" ] && outputs+=(--load)
    docker "${args[@]}" "${outputs[@]}" . || fail "docker buildx build exited non-zero"
    echo "build-image: built $TAG with docker buildx in $(($(date +%s) - start))s"
    exit 0
fi

command -v buildah >/dev/null || fail "buildah is not installed (apt-get install buildah)"
ca=${SHAREGPU_BUILD_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(bud --pull=never --isolation chroot --file Dockerfile "${build_args[@]}")
if [ -f "$ca" ]; then
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$work/pip.conf"
    args+=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro" --volume "$work/pip.conf:/etc/pip.conf:ro")
fi
if [ -n "$multi" ]; then
    buildah manifest rm "$TAG" >/dev/null 2>&1 || true
    args+=(--platform "$PLATFORM" --manifest "$TAG")
else
    [ -n "$PLATFORM" ] && args+=(--platform "$PLATFORM")
    args+=(--tag "$TAG")
fi
buildah "${args[@]}" . || fail "buildah bud exited non-zero (the Dockerfile's FROM must be in buildah's local storage: --pull=never)"
elapsed=$(($(date +%s) - start))
if [ -n "$multi" ]; then
    [ -n "$ARCHIVE" ] && { rm -f "$ARCHIVE"; buildah manifest push --all "$TAG" "oci-archive:$ARCHIVE:$TAG" >/dev/null; }
    [ -n "$PUSH" ] && buildah manifest push --all "$TAG" "docker://$TAG"
    echo "build-image: built $TAG ($PLATFORM) with buildah in ${elapsed}s"
    exit 0
fi
if [ -n "$ARCHIVE" ]; then
    rm -f "$ARCHIVE"
    buildah push --quiet "$TAG" "docker-archive:$ARCHIVE:$TAG" >/dev/null || fail "writing $ARCHIVE"
fi
[ -n "$PUSH" ] && { buildah push "$TAG" "docker://$TAG" || fail "pushing $TAG"; }
size=$(buildah images --format '{{.Size}}' "$TAG" | head -n1)
echo "build-image: built $TAG with buildah in ${elapsed}s; image size $size${ARCHIVE:+; archive $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))}"
