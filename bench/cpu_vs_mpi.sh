#!/usr/bin/env bash
# braid's shm all-reduce against Open MPI's MPI_Allreduce on this machine,
# interleaved in one run so both see the same machine state. Prints the
# median of REPS runs per figure and braid/MPI ratios.
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
    for s in 8 1M 64M; do
      iters=200; [ "$s" = 64M ] && iters=10
      "$BRAID" bench all_reduce --np "$np" -b "$s" -e "$s" -n "$iters" -w 5 2>/dev/null \
        | grep '^\[rank 0\] ' | grep -v '#' | sed 's/^\[rank 0\] //' >> /tmp/cmp_braid_$np
    done
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
