#!/usr/bin/env bash
# Builds the Kubernetes test plane from Go modules (no Docker, no release downloads):
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from k8s.io/kubernetes,
# etcd from go.etcd.io/etcd/server/v3, helm and kwok. Binaries are cached per version under
# $SPLITSERVE_CACHE/testplane-<versions>/bin; a second run returns at once. Prints the bin dir.
set -euo pipefail
KUBE_VERSION=${KUBE_VERSION:-v1.34.4}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
HELM_VERSION=${HELM_VERSION:-v3.19.4}
KWOK_VERSION=${KWOK_VERSION:-v0.7.0}
cache=${SPLITSERVE_CACHE:-$HOME/.cache/splitserve}
dir="$cache/testplane-k8s$KUBE_VERSION-etcd$ETCD_VERSION-helm$HELM_VERSION-kwok$KWOK_VERSION"
bin="$dir/bin"
want=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm kwok)
have_all() { for b in "${want[@]}"; do [ -x "$bin/$b" ] || return 1; done; }
if have_all; then echo "$bin"; exit 0; fi

export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
mkdir -p "$bin" "$dir/src"
log() { echo "[testplane-build $(date +%T)] $*" >&2; }
start=$(date +%s)

# k8s.io/kubernetes replaces its staging modules with local paths; a wrapper module
# requires the release and points each staging module at its published v0.X.Y tag.
build_kube() {
  local w="$dir/src/kubernetes" minor v0
  minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  v0="v0.${KUBE_VERSION#v1.}"
  mkdir -p "$w"
  cd "$w"
  local mod
  mod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  {
    echo "module splitserve.local/testplane/kubernetes"
    echo
    grep -E '^go [0-9.]+$' "$mod"
    echo
    echo "require k8s.io/kubernetes $KUBE_VERSION"
    echo
    echo "replace ("
    grep -E '=> \./staging/src/' "$mod" | awk -v v="$v0" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
  } > go.mod
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  go mod tidy -e >/dev/null 2>&1 || true
  log "resolving k8s.io/kubernetes $KUBE_VERSION"
  go get "k8s.io/kubernetes@$KUBE_VERSION" >&2
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kube-apiserver kube-controller-manager kube-scheduler kubectl"
  go build -trimpath -ldflags "$ld" -o "$bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2
}

# etcd's server module also uses replace directives for its sibling modules.
build_etcd() {
  local w="$dir/src/etcd"
  mkdir -p "$w"
  cd "$w"
  cat > go.mod <<GOMOD
module splitserve.local/testplane/etcd

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION

replace (
	go.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/pkg/v3 => go.etcd.io/etcd/client/pkg/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/v3 => go.etcd.io/etcd/client/v3 $ETCD_VERSION
	go.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 $ETCD_VERSION
)
GOMOD
  log "building etcd $ETCD_VERSION"
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3 >&2
}

build_plain() {  # modules without replace directives: go install works
  log "building $1@$2"
  GOBIN="$bin" go install -trimpath -ldflags "-s -w $3" "$1@$2" >&2
}

[ -x "$bin/kube-apiserver" ] && [ -x "$bin/kubectl" ] && [ -x "$bin/kube-scheduler" ] \
  && [ -x "$bin/kube-controller-manager" ] || build_kube
[ -x "$bin/etcd" ] || build_etcd
[ -x "$bin/helm" ] || build_plain helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
[ -x "$bin/kwok" ] || build_plain sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
have_all
echo "$(( $(date +%s) - start ))" > "$dir/cold-build-seconds"
log "done in $(cat "$dir/cold-build-seconds")s"
echo "$bin"
