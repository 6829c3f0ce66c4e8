#!/usr/bin/env bash
# The main job: start kvtierd as its own process, run a multi-turn chat workload
# of a real (random-weight) Llama through it, print hits by tier and TTFT, stop
# the daemon. Arguments go to examples/engine/run_demo.py (try --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/env.sh"
cd "$root"
exec python examples/engine/run_demo.py "$@"
