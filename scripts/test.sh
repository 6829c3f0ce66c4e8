#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k block_manager).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/env.sh"
cd "$root"
exec python -m pytest "$@"
