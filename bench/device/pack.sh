#!/bin/bash
# Builds what the device scripts carry into .dev/ at the repository root
# (ignored by git): braid, the five GPU test binaries and the braid-model
# library's unit tests (.dev/model-tests.gz: the GPU decoder's checks),
# debug info stripped and gzipped (ONLY=braid: braid alone), a copy of the
# peers' scripts (../shared/anchors, DeepSpeed's wheels included), and the
# commit they were built at. CARGO_TARGET_DIR is honoured (the builds are
# looked for there).
# PREV=REV also builds braid at commit REV (a `git archive` of it in
# target/prev-src, compiled into target/prev) as .dev/braid-prev.gz, the
# binary that `one.sh bits` and `one.sh proxy` compare against; .dev/commit
# then names both commits.
# Run it here, on the build machine; the device has no Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
# Where cargo builds (absolute: the test binaries name braid by it).
T=${CARGO_TARGET_DIR:-$root/target}
case $T in /*) ;; *) T=$root/$T ;; esac
mkdir -p .dev
if [ -n "${PREV:-}" ]; then
  rev=$(git rev-parse --short "$PREV^{commit}")
  src=$root/target/prev-src
  rm -rf "$src"
  mkdir -p "$src"
  git archive "$rev" | tar -x -C "$src"
  echo "building braid at $rev (release)"
  (cd "$src" && CARGO_TARGET_DIR="$T/prev" cargo build --release --bin braid)
  rm -rf "$src"
  objcopy --strip-debug "$T/prev/release/braid" .dev/braid-prev
  gzip -9f .dev/braid-prev
  echo "$rev" > .dev/prev-commit
fi
echo "building braid (release)"
cargo build --release --bin braid
objcopy --strip-debug "$T/release/braid" .dev/braid
gzip -9f .dev/braid
# ONLY=braid: braid alone (the scripts that run no test binary, parity.sh).
tests="gpu gpu_zero gpu_faults gpu_tp gpu_pp"
[ "${ONLY:-}" = braid ] && tests=""
for t in $tests; do
  echo "building the $t test binary"
  exe=$(cargo test --release -p braid --test "$t" --no-run 2>&1 |
    grep -o "release/deps/$t-[0-9a-f]*" | tail -1)
  [ -n "$exe" ] || { echo "pack.sh: no $t test binary found" >&2; exit 1; }
  objcopy --strip-debug "$T/$exe" ".dev/${t/_/-}-tests"
  gzip -9f ".dev/${t/_/-}-tests"
done
# The braid-model library's unit tests: the GPU decoder's checks
# (bench/device/serve.sh check runs those matching "decode").
if [ "${ONLY:-}" != braid ]; then
  echo "building the braid-model library's test binary"
  exe=$(cargo test --release -p braid-model --lib --no-run 2>&1 |
    grep -o "release/deps/braid_model-[0-9a-f]*" | tail -1)
  [ -n "$exe" ] || { echo "pack.sh: no braid-model test binary found" >&2; exit 1; }
  objcopy --strip-debug "$T/$exe" .dev/model-tests
  gzip -9f .dev/model-tests
fi
rm -rf .dev/anchors
# ../shared beside the main checkout (a worktree elsewhere has none of its own).
main_checkout=$(cd "$(git rev-parse --git-common-dir)/.." && pwd)
cp -r "$main_checkout/../shared/anchors" .dev/anchors
# The test binaries run braid from the path they were built under
# ($T/release/braid): setup.sh links that path on the device.
pwd > .dev/built-at
echo "$T" >> .dev/built-at
git rev-parse --short HEAD > .dev/commit
git diff --quiet HEAD || echo "dirty" >> .dev/commit
if [ -f .dev/braid-prev.gz ] && [ -f .dev/prev-commit ]; then
  echo "prev $(cat .dev/prev-commit)" >> .dev/commit
fi
ls -l .dev
echo "packed at $(tr '\n' ' ' < .dev/commit)"
