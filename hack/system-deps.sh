#!/usr/bin/env bash
# System packages the tests need: Debian's prometheus (a real Prometheus server), openssl
# (test-plane certificates) and a C compiler (the engine's CPU decode-attention kernel is built
# with it on first use). Installs only what is missing; needs root for apt-get.
set -euo pipefail
missing=()
command -v prometheus >/dev/null || [ -x /usr/bin/prometheus ] || missing+=(prometheus)
command -v openssl >/dev/null || missing+=(openssl)
command -v go >/dev/null || missing+=(golang-go)
command -v cc >/dev/null || missing+=(gcc libc6-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}" >&2
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq >&2
  # The package's maintainer scripts try to start a service; in containers there is none to start.
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
fi
