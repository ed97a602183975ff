#!/usr/bin/env bash
# Installs the Debian packages replay's tests, examples and benchmarks need, if any are missing.
# The CUDA Toolkit (nvcc, 12.4 or newer) is a prerequisite and is not installed here.
set -euo pipefail
pkgs=(cmake ninja-build g++ python3 doctest-dev libfmt-dev nlohmann-json3-dev libcli11-dev libbenchmark-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
command -v nvcc >/dev/null 2>&1 || { echo "error: nvcc not found; install the CUDA Toolkit (12.4+) first" >&2; exit 1; }
