#!/usr/bin/env bash
# braid's shm all-reduce against Open MPI's MPI_Allreduce on this machine,
# interleaved in one run so both see the same machine state. Prints the
# median of REPS runs per figure (out-of-place, as MPI's anchor measures)
# and braid/MPI ratios.
#   bench/cpu_vs_mpi.sh [REPS]      (needs: mpicc, mpirun; cargo build --release first)
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-5}
BRAID=./target/release/braid
MPI_SRC=${MPI_SRC:-../shared/anchors/mpi_allreduce_bench.c}
mpicc -O2 -o /tmp/braid_mpi_ar "$MPI_SRC"
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for np in 2 4; do
  : > /tmp/cmp_mpi_$np; : > /tmp/cmp_braid_$np
  for rep in $(seq "$REPS"); do
    mpirun --oversubscribe --allow-run-as-root -np "$np" /tmp/braid_mpi_ar >> /tmp/cmp_mpi_$np
    # Like the MPI anchor, one process measures a sequence of sizes (8 B
    # to 64 MB in powers of two, which include 8 B, 1 MB and 64 MB).
    "$BRAID" bench all_reduce --np "$np" -b 8 -e 64M -f 2 -w 5 2>/dev/null \
      | grep '^\[rank 0\] ' | grep -v '#' | sed 's/^\[rank 0\] //' >> /tmp/cmp_braid_$np
  done
  for s in 8 1048576 67108864; do
    mpi_t=$(awk -v s="bytes=$s" '$4==s {sub("time_us=","",$5); print $5}' /tmp/cmp_mpi_$np | median)
    mpi_bw=$(awk -v s="bytes=$s" '$4==s {sub("busbw=","",$6); print $6}' /tmp/cmp_mpi_$np | median)
    br_t=$(awk -v s="$s" '$1==s {print $6}' /tmp/cmp_braid_$np | median)
    br_bw=$(awk -v s="$s" '$1==s {print $8}' /tmp/cmp_braid_$np | median)
    if [ "$s" = 8 ]; then
      echo "np=$np bytes=$s time_us braid=$br_t mpi=$mpi_t ratio(braid/mpi)=$(awk -v a="$br_t" -v b="$mpi_t" 'BEGIN{printf "%.2f", a/b}')"
    else
      echo "np=$np bytes=$s busbw_GBps braid=$br_bw mpi=$mpi_bw ratio(braid/mpi)=$(awk -v a="$br_bw" -v b="$mpi_bw" 'BEGIN{printf "%.2f", a/b}')"
    fi
  done
done
