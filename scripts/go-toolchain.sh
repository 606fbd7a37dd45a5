# Sourced by the scripts that build test tooling from pinned Go modules (build-controlplane.sh,
# build-node.sh, install-tools.sh): sets GO to a Go toolchain, and GOTOOLCHAIN when the local Go
# is older than GO_MIN (an older Go fetches the toolchain the go.mod files ask for through the
# module proxy). The caller defines GO_MIN and fail().
GO=${GO:-$(command -v go || true)}
[ -z "$GO" ] && [ -x /usr/local/go/bin/go ] && GO=/usr/local/go/bin/go
[ -n "$GO" ] || fail "no Go toolchain found (install Go >= $GO_MIN or set GO=/path/to/go)"
have=$("$GO" env GOVERSION 2>/dev/null | sed -E 's/^go([0-9]+\.[0-9]+).*/\1/') \
    || fail "'$GO env GOVERSION' did not run"
if [ "$(printf '%s\n%s\n' "$GO_MIN" "$have" | sort -V | head -n1)" != "$GO_MIN" ]; then
    export GOTOOLCHAIN=go1.26.8
    echo "$(basename "$0" .sh): local Go is $have; using GOTOOLCHAIN=$GOTOOLCHAIN"
fi
