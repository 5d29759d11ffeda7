# Sourced by the device scripts: unpacks .dev/ into /tmp (braid, the
# previous braid where carried, the GPU test binaries), points the GPU
# tests' compiled-in braid path at it, keeps NVLink multicast off, and
# records the machine. Needs $OUT (the device tool sets it). Logs go to
# $L and come back as one archive ($OUT/logs.tgz, by `finish`): the tool
# brings back only a few files.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for f in braid braid-prev gpu-tests gpu-zero-tests gpu-faults-tests gpu-tp-tests gpu-pp-tests model-tests; do
  if [ -f ".dev/$f.gz" ]; then
    gunzip -c ".dev/$f.gz" > "/tmp/$f" && chmod +x "/tmp/$f"
  else
    rm -f "/tmp/$f" # not carried this call: none from an earlier one
  fi
done
B=/tmp/braid
# The test binaries run braid from the path they were built with: the
# checkout pack.sh ran in (.dev/built-at's first line; /work/main before it
# said) and the target directory it built in (its second line, where
# CARGO_TARGET_DIR moved it).
{
  echo /work/main/target
  head -n 1 .dev/built-at 2> /dev/null | sed 's|$|/target|'
  sed -n 2p .dev/built-at 2> /dev/null
} | while read -r target; do
  [ -n "$target" ] || continue
  mkdir -p "$target/release"
  ln -sf /tmp/braid "$target/release/braid"
done
ANCHORS=$PWD/.dev/anchors
L=/tmp/logs
mkdir -p "$L"
# A machine may come back with an earlier session's logs: keep this
# session's (the calls of the last hour), drop the rest before they are
# packed with this call's.
find "$L" -mindepth 1 -mmin +60 -delete 2> /dev/null
{
  echo "braid at $(tr '\n' ' ' < .dev/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  nproc
} > "$L/device.txt" 2>&1
cat "$L/device.txt"
# Installs DeepSpeed from the wheels beside the anchors (no network there).
ds_install() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$ANCHORS"/wheels/*.whl > "$L/pip.txt" 2>&1
  export PYTHONPATH=/tmp/site
}
# Packs the logs into $OUT.
finish() {
  tar czf "$OUT/logs.tgz" -C /tmp logs
}
