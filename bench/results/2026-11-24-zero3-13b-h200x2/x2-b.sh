#!/bin/bash
# 2 H200s: the ZeRO-3 GPU tests' 2-GPU legs, then DeepSpeed ZeRO-3 on the 12.85B model.
export NCCL_NVLS_ENABLE=0
mkdir -p /work/main/target/release
gunzip -c .dev/braid.gz > /tmp/braid && chmod +x /tmp/braid && ln -sf /tmp/braid /work/main/target/release/braid
gunzip -c .dev/gpu-tests.gz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout 200 /tmp/gpu-tests --test-threads 1 --nocapture zero3 sharded > $OUT/gpu-tests.txt 2>&1; echo "exit $?" >> $OUT/gpu-tests.txt
grep -E "^test |test result|panicked|exit|ZeRO-3|max \|diff\|" $OUT/gpu-tests.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/anchors/wheels/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site
(cd .dev/anchors && timeout 300 torchrun --nproc_per_node 2 ds_gpt2_bench.py --zero 3 --act-ckpt --model L40-H40-C5120 --B 8 --steps 8 --warmup 3 > $OUT/ds-13b.txt 2>&1; echo "exit $?" >> $OUT/ds-13b.txt)
echo "ds-13b: $(grep -h 'RESULT\|exit\|Error' $OUT/ds-13b.txt | tail -4 | tr '\n' ' ')"
