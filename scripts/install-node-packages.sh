#!/usr/bin/env bash
# Installs the Debian packages the real-node tests need, once (skipped when all are present):
#   buildah                       builds the images (the project's Dockerfile among them)
#   mmdebstrap                    makes the stand-in base root filesystem from Debian packages
#   containernetworking-plugins   the bridge, host-local, loopback and portmap CNI plugins
#   libseccomp-dev, pkg-config    runc's seccomp support (scripts/build-node.sh)
#   gcc, libc6-dev                runc's nsenter stage, the pause binary, the C stand-ins
#   iptables, iproute2            kube-proxy's rules, the fixture's bridge and netns clean-up
#   ipset                         kube-router's NetworkPolicy rules (scripts/build-kube-router.sh)
# Needs root and Debian/Ubuntu's apt (the CI machine and these test machines).
set -euo pipefail
PACKAGES=(buildah mmdebstrap containernetworking-plugins libseccomp-dev pkg-config gcc libc6-dev
          iptables iproute2 ipset)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "install-node-packages: missing ${missing[*]}; run as root (apt-get install)" >&2
    exit 1
fi
command -v apt-get >/dev/null || { echo "install-node-packages: no apt-get; install ${missing[*]}" >&2; exit 1; }
echo "install-node-packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
