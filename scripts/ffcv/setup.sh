#!/usr/bin/env bash
# Installs the real ffcv 1.0.2 in a venv, for writing braid's interop fixtures
# and running the FFCV peer benchmark; never needed by CI.
#
# Usage: scripts/ffcv/setup.sh [VENV_DIR]      (default: /work/ffcv-venv)
#
# Tested on Debian 12 (bookworm), Python 3.11, x86_64, 2 cores: ~2 min from
# scratch (plus download time; the venv is ~5.8 GB because PyPI's torch wheel
# pulls the CUDA libraries when the CPU-only torch index is unreachable).
# Idempotent: every step checks whether it is already done and skips it.
#
# Versions known to work together (pinned below):
#   numpy 2.4.6, numba 0.68.1 (llvmlite 0.50.0), torch 2.15.0, torchvision 0.29.2,
#   opencv-python-headless 5.0.0.93, ffcv 1.0.2 built against Debian's
#   libopencv-dev 4.6.0 and libturbojpeg0-dev 2.1.5. No older numpy/numba pin
#   is needed: ffcv's C extension is loaded via ctypes and does not use the
#   numpy C API.
#
# Notes:
# - ffcv is installed with --no-deps because its setup.py requires
#   'opencv-python' (GUI build); we use opencv-python-headless, which provides
#   the same cv2 module. `pip check` therefore reports
#   "ffcv 1.0.2 requires opencv-python, which is not installed" -- harmless.
# - --no-build-isolation: ffcv's setup.py imports distutils and calls
#   pkg-config for opencv4 + libturbojpeg; it builds against the venv's setuptools.
set -euo pipefail

VENV="${1:-/work/ffcv-venv}"
PY="${PYTHON:-python3}"

NUMPY_VER=2.4.6
NUMBA_VER=0.68.1
TORCH_VER=2.15.0
TORCHVISION_VER=0.29.2
OPENCV_VER=5.0.0.93
FFCV_VER=1.0.2
OTHER_DEPS=(terminaltables pytorch_pfn_extras fastargs assertpy tqdm psutil)
APT_PKGS=(pkg-config libopencv-dev libturbojpeg0-dev)

log() { echo "[ffcv-setup] $*"; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# 1. System libraries the C extension builds against.
missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
else
    log "apt packages already installed: ${APT_PKGS[*]}"
fi
log "pkg-config: opencv4 $(pkg-config --modversion opencv4), libturbojpeg $(pkg-config --modversion libturbojpeg)"

# 2. The venv.
if [ -x "$VENV/bin/python" ]; then
    log "venv exists: $VENV"
else
    log "creating venv $VENV with $($PY --version 2>&1)"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip)

# 3. Build tooling (needed because ffcv is built with --no-build-isolation).
if "$VPY" -c 'import setuptools, wheel' 2>/dev/null \
   && "$VPY" -c 'import setuptools,sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 70)'; then
    log "setuptools/wheel already present"
else
    log "pip install --upgrade pip setuptools wheel"
    "${PIP[@]}" install -q --upgrade pip setuptools wheel
fi

# 4. Runtime dependencies.
deps_ok() {
    "$VPY" - "$NUMPY_VER" "$NUMBA_VER" "$TORCH_VER" "$TORCHVISION_VER" <<'EOF' 2>/dev/null
import sys
import numpy, numba, torch, torchvision, cv2
import terminaltables, pytorch_pfn_extras, fastargs, assertpy, tqdm, psutil
want = sys.argv[1:]
have = [numpy.__version__, numba.__version__,
        torch.__version__.split('+')[0], torchvision.__version__.split('+')[0]]
sys.exit(0 if have == want else 1)
EOF
}
if deps_ok; then
    log "runtime deps already installed (numpy $NUMPY_VER, numba $NUMBA_VER, torch $TORCH_VER)"
else
    PKGS=("numpy==$NUMPY_VER" "numba==$NUMBA_VER" "opencv-python-headless==$OPENCV_VER"
          "torch==$TORCH_VER" "torchvision==$TORCHVISION_VER" "${OTHER_DEPS[@]}")
    if curl -sS -m 10 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
        log "pip install (CPU-only torch index + PyPI): ${PKGS[*]}"
        "${PIP[@]}" install --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple "${PKGS[@]}"
    else
        log "CPU-only torch index unreachable; pip install from PyPI (~5 GB, CUDA wheels): ${PKGS[*]}"
        "${PIP[@]}" install "${PKGS[@]}"
    fi
fi

# 5. ffcv itself (C extension against libturbojpeg + OpenCV via pkg-config).
if "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('ffcv') != '$FFCV_VER')" 2>/dev/null \
   && "$VPY" -c 'import ffcv._libffcv, ffcv.loader, ffcv.writer' 2>/dev/null; then
    log "ffcv $FFCV_VER already installed"
else
    log "pip install --no-build-isolation --no-deps ffcv==$FFCV_VER"
    "${PIP[@]}" install --no-build-isolation --no-deps --force-reinstall "ffcv==$FFCV_VER"
fi

# 6. Report.
"$VPY" - <<'EOF'
import importlib.metadata as m
import numpy, numba, torch, cv2
import ffcv._libffcv
from ffcv.loader import Loader, OrderOption
from ffcv.writer import DatasetWriter
print("[ffcv-setup] ok: ffcv", m.version("ffcv"), "| numpy", numpy.__version__,
      "| numba", numba.__version__, "| torch", torch.__version__,
      "| opencv", cv2.__version__)
EOF
log "done: use $VPY"
