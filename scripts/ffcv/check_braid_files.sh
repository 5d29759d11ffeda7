#!/usr/bin/env bash
# Writes .beton files with braid (every field type, 4 KiB to 8 MiB pages,
# token windows, JSON lines) and checks that the real ffcv package reads
# every value equal (check_braid_files.py). Needs setup.sh's venv; records
# the result in scripts/ffcv/check_braid_files.last.txt.
#
# Usage: scripts/ffcv/check_braid_files.sh [VENV_DIR]   (default /work/ffcv-venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-/work/ffcv-venv}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

cargo build -q --release --bin braid
cargo run -q --release -p braid-data --example interop_files -- "$OUT"
BRAID=target/release/braid
$BRAID data write "$OUT/tokens_u16.beton" --tokens synthetic --seq 32 --page-size 65536 2>/dev/null
printf '{"a": 1, "b": "\\u00e9"}\n{"b": [1, 2, {"c": null}]}\n"text"\n3.5\n[]\n' > "$OUT/lines.jsonl"
$BRAID data write "$OUT/lines.beton" --jsonl "$OUT/lines.jsonl" --page-size 4096 2>/dev/null

{
    echo "# $(date -u +%F) braid $(git rev-parse --short HEAD), ffcv $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("ffcv"))')"
    status=0
    for f in "$OUT"/*.beton; do
        # One process per file: ffcv's Loader threads are left behind otherwise.
        timeout 300 "$VENV/bin/python" -W ignore scripts/ffcv/check_braid_files.py "$BRAID" "$f" || status=1
    done
    echo "# exit $status"
} 2>&1 | tee scripts/ffcv/check_braid_files.last.txt
grep -q "^# exit 0" scripts/ffcv/check_braid_files.last.txt
