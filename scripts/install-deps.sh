#!/usr/bin/env bash
# Installs everything the tests and demos need on a fresh Debian machine (as root), and
# checks the Rust toolchain components. Idempotent.
#   iproute2, iptables   network namespaces, veth links and loss for the netns tests
#   tcpdump              the RoCE capture test (scripts/roce-capture.sh)
#   debootstrap          the container base image (scripts/docker.sh)
#   docker.io, docker-compose   unless a Docker Engine / Compose is already installed
#   kubernetes-client    kubectl (kustomize), unless a kubectl is installed
#   python3-venv, python3-yaml  a venv at target/py (from PyPI, python/requirements-test.txt:
#                        kubernetes-validate, and numpy, pytest, torch and TorchRec for the
#                        bex Python package) and the checks
#   + the verbs build dependencies (scripts/install-verbs-deps.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(iproute2 iptables tcpdump debootstrap python3-venv python3-yaml curl)
command -v docker >/dev/null || packages+=(docker.io)
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || packages+=(docker-compose)
command -v kubectl >/dev/null || packages+=(kubernetes-client)
if [ "$(id -u)" -eq 0 ]; then
    missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    scripts/install-verbs-deps.sh >/dev/null
else
    echo "install-deps: not root; assuming system packages are present" >&2
fi

# One venv for the Python tools: kubernetes-validate (the Kubernetes schemas, offline once
# installed), and numpy, pytest, torch and TorchRec for the bex package (python/; pip fetches
# maturin to build it). torch is 5.5 GB installed, so the venv lives outside the clone, under
# ~/.cache/bex (BEX_PY_CACHE), keyed by the requirements' hash: a second clean clone reuses
# it. target/py links to it.
requirements=python/requirements-test.txt
torchrec=torchrec==1.9.2   # with --no-deps: see $requirements
key=$( (cat "$requirements"; echo "$torchrec") | sha256sum | cut -c1-12)
venv="${BEX_PY_CACHE:-$HOME/.cache/bex}/py-$key"
if [ ! -e "$venv/.complete" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -r "$requirements"
    "$venv/bin/pip" install -q --no-deps "$torchrec"
    touch "$venv/.complete"
fi
mkdir -p target
ln -sfn "$venv" target/py

for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        rustup component add "$component"
    fi
done
