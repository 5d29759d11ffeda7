//! Names of the environment variables braid reads or sets.
//!
//! Code elsewhere uses these constants and never spells a name itself, so
//! that the launcher and its workers cannot drift apart and this file is
//! the one list of what the environment changes. SLURM's variables are in
//! [`crate::slurm`]; `braid launch`'s `PET_<OPTION>` variables (torchrun's,
//! one for each option) are declared on its options; messages, help text,
//! build scripts and tests spell names as text.
//!
//! The first group is the launcher↔worker contract: the launcher writes
//! it and workers read it. Its first names are torchrun's, so programs
//! written for torchrun run unchanged under `braid launch`. The settings
//! after it are read by one part of braid each; none is needed, and most
//! exist for experiments and tests.

/// Global rank of this worker, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Rank of this worker among the workers of its node.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of workers in the whole job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Number of workers on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of this worker's node (torchrun's name for the node rank).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Address of the host where rank 0's rendezvous lives.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port on [`MASTER_ADDR`] that is free for the workers' own rendezvous.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Number of nodes (torchrun's name; written for torchrun's programs).
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// Rank among the workers of this worker's role: braid runs one role, so
/// the global rank (torchrun's name).
pub const ROLE_RANK: &str = "ROLE_RANK";
/// Number of workers of this worker's role: the world size (torchrun's).
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
/// The workers' role, `braid launch --role` (torchrun's name).
pub const ROLE_NAME: &str = "ROLE_NAME";
/// torchrun's name for [`BRAID_RUN_ID`].
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// torchrun's name for [`BRAID_RESTART_COUNT`].
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// torchrun's name for [`BRAID_MAX_RESTARTS`].
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// `True` when torchrun started the worker and its agent's own store
/// already listens on [`MASTER_PORT`] (braid's store then takes the port
/// after it; `braid launch` never sets it).
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// OpenMP's thread count: `braid launch` sets it to 1 for each of several
/// workers on a node unless it is set already, as torchrun does.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";

/// Identifier of the run, the same on every node and across restarts.
pub const BRAID_RUN_ID: &str = "BRAID_RUN_ID";
/// How many times the launcher has restarted the worker group so far.
pub const BRAID_RESTART_COUNT: &str = "BRAID_RESTART_COUNT";
/// How many restarts the launcher allows in total.
pub const BRAID_MAX_RESTARTS: &str = "BRAID_MAX_RESTARTS";
/// `host:port` of a braid rendezvous store that is already running (the
/// launcher's); workers connect to it instead of hosting one on rank 0.
pub const BRAID_STORE_ADDR: &str = "BRAID_STORE_ADDR";
/// Key prefix under which this attempt's workers keep their store keys, so
/// that restarts and concurrent groups never collide.
pub const BRAID_STORE_PREFIX: &str = "BRAID_STORE_PREFIX";
/// Shared secret the rendezvous store demands from every client.
pub const BRAID_STORE_TOKEN: &str = "BRAID_STORE_TOKEN";
/// Most connections a rendezvous store serves at once (it refuses more).
pub const BRAID_STORE_MAX_CONNECTIONS: &str = "BRAID_STORE_MAX_CONNECTIONS";
/// Default timeout in seconds for every blocking wait (store, collectives).
pub const BRAID_TIMEOUT: &str = "BRAID_TIMEOUT";
/// Directory for the run's logs and flight records
/// (`flight-rankNNNNN-attemptA.json`, `crate::flight::dump_file_name`): the
/// launcher's `--log-dir`, else a directory it names at start-up.
pub const BRAID_LOG_DIR: &str = "BRAID_LOG_DIR";
/// How many collective records each rank keeps for its flight record
/// (default 2048; 0 keeps only each communicator's last and current one).
pub const BRAID_FLIGHT_RECORDS: &str = "BRAID_FLIGHT_RECORDS";

// Settings read by one part of braid each, from the bottom of the stack
// up. Unset, each takes the default its description names.

// braid-store.

/// The host rank 0 binds the store it hosts to, on the store's port, when
/// no launcher's store is given (default: [`MASTER_ADDR`]).
pub const BRAID_STORE_BIND: &str = "BRAID_STORE_BIND";

// braid-comm.

/// The host communicator's backend: `auto` (the default), `shm`, `tcp` or
/// `hier`.
pub const BRAID_BACKEND: &str = "BRAID_BACKEND";
/// The all-reduce algorithm of the tcp and hier backends, `ring` or
/// `tree`, overriding the size table (`braid bench --algo` sets it).
pub const BRAID_ALGO: &str = "BRAID_ALGO";
/// `detail` (or `1`): every collective is checked to be the same call on
/// every rank before it runs.
pub const BRAID_DEBUG: &str = "BRAID_DEBUG";
/// This rank's host identity: ranks with the same one share memory
/// (default: the host name and the address that reaches the store).
pub const BRAID_HOST_ID: &str = "BRAID_HOST_ID";
/// Directory of the shm backend's segments (default: `/dev/shm`).
pub const BRAID_SHM_DIR: &str = "BRAID_SHM_DIR";
/// Bytes of each half of a rank's shm data slot (at least 4096).
pub const BRAID_SHM_HALF: &str = "BRAID_SHM_HALF";
/// Bytes of each shm point-to-point ring (at least 4096).
pub const BRAID_SHM_RING: &str = "BRAID_SHM_RING";
/// Helper threads per rank for the shm backend's copies and sums (1 to 16;
/// default: the host's cores shared among its ranks, at most 3).
pub const BRAID_SHM_THREADS: &str = "BRAID_SHM_THREADS";
/// Tests only: `RANK:PHASE:MS[,…]` makes rank RANK sleep MS milliseconds
/// in PHASE (`dump`: writing a flight record, read by braid-comm; `data`,
/// `compute`, `end`, `write`: braid-train's), to make a straggler.
pub const BRAID_TEST_DELAY: &str = "BRAID_TEST_DELAY";

// braid-cuda.

/// An NCCL library to load before the system's and Python wheels'.
pub const BRAID_NCCL_LIB: &str = "BRAID_NCCL_LIB";
/// Directory of the compiled-kernel cache (empty: no cache; default:
/// `$XDG_CACHE_HOME/braid/kernels`, else `~/.cache/braid/kernels`).
pub const BRAID_KERNEL_CACHE: &str = "BRAID_KERNEL_CACHE";
/// cuBLASLt's algorithm choice: `on` (the default: the fastest of the
/// bit-identical offers, timed once), `off` (the heuristic's first) or
/// `verbose`.
pub const BRAID_GEMM_TUNE: &str = "BRAID_GEMM_TUNE";
/// The priority of each device's main stream (lower is more urgent);
/// default: CUDA's default priority.
pub const BRAID_MAIN_STREAM_PRIORITY: &str = "BRAID_MAIN_STREAM_PRIORITY";

// braid-trace.

/// Most spans a process records (default 2,000,000).
pub const BRAID_TRACE_MAX_EVENTS: &str = "BRAID_TRACE_MAX_EVENTS";
/// NVTX ranges for Nsight: `1` asks for them, `0` refuses them; by
/// default a trace asks.
pub const BRAID_NVTX: &str = "BRAID_NVTX";

// braid-model (the GPU engines).

/// The bf16 engine's attention: `fused` (the flash kernels) or `batched`
/// (cuBLAS products around a softmax); default: fused where it runs.
pub const BRAID_ATTENTION: &str = "BRAID_ATTENTION";
/// The flash attention's forward kernel: `auto`, `mma`, `wgmma` or
/// `wgmma2` (the last two on compute capability 9.0 only).
pub const BRAID_FLASH_FORWARD: &str = "BRAID_FLASH_FORWARD";
/// The flash attention's backward kernels: `auto`, `mma` or `wgmma`.
pub const BRAID_FLASH_BACKWARD: &str = "BRAID_FLASH_BACKWARD";
/// The GPU decoder's attention: `pages` (16 bytes of a page row a lane,
/// the default), `warps` (a warp per position) or `block` (a thread per
/// position, the first kernel).
pub const BRAID_DECODE_ATTENTION: &str = "BRAID_DECODE_ATTENTION";
/// `0` or `off`: the GPU decoder runs its steady steps without CUDA
/// graphs (on by default).
pub const BRAID_DECODE_GRAPHS: &str = "BRAID_DECODE_GRAPHS";
/// `0` or `off`: the GPU decoder brings every row's logits back and the
/// host makes the greedy choices (by default a greedy row's choice is made
/// on the device and only it comes back).
pub const BRAID_DECODE_PICKS: &str = "BRAID_DECODE_PICKS";
/// The GPU decoder's KV cache: `f32` or `bf16` (half the bytes a step
/// reads; keys and values rounded to bf16 as they are written); unset,
/// the products' element.
pub const BRAID_DECODE_KV: &str = "BRAID_DECODE_KV";
/// `1` or `on`: the GPU decoder's bf16 products of up to 8 rows run on
/// braid's skinny kernel instead of cuBLASLt (off by default: on an H100
/// its versions without a split of K were slower, 1558M at one stream
/// 3.08 ms a token against 2.73; the split version is not yet measured).
pub const BRAID_DECODE_SKINNY: &str = "BRAID_DECODE_SKINNY";
/// `1` or `on`: the GPU decoder's bf16 products of up to 64 rows time
/// cuBLASLt's offers on first use, split over K included (deterministic
/// reductions only), instead of taking the heuristic's first (off by
/// default until measured).
pub const BRAID_DECODE_TUNE: &str = "BRAID_DECODE_TUNE";
/// The GPU decoder launches the kernels of its step that
/// wait for the one ahead (LayerNorms, the cache write, the pages
/// attention, the skinny products, which first ask for their weights
/// into L2) overlapping that kernel (Hopper's programmatic dependent
/// launch), so that launch gaps and weight reads hide under the kernel
/// ahead. On by default on a Hopper or later (`0` or `off` turns it off):
/// on an H100 (2026-12-07) it took a 124M layer's products at one row from
/// 19.2 to 13.3 µs with the NT kernel, and with `BRAID_DECODE_NT` served
/// 1558M one stream at 2.28 ms a token against 2.79 without either
/// (BENCHMARKS.md, the eighth serving round).
pub const BRAID_DECODE_OVERLAP: &str = "BRAID_DECODE_OVERLAP";
/// The GPU decoder keeps its bf16 layer weights output by
/// output (`[out, in]`, transposed), runs products of up to 8 rows and the
/// logits on braid's NT kernel (each warp reading whole weight rows) and
/// more rows by cuBLASLt reading the weights transposed (it turns the
/// skinny kernel off). On by default on a Hopper or later (`0` or `off`
/// turns it off; elsewhere unmeasured, so off unless `1` or `on`): on an
/// H100 (2026-12-07) a 124M layer's products at one row took 19.2 µs
/// against cuBLASLt's 34.0, and with `BRAID_DECODE_OVERLAP` 1558M served
/// one stream at 2.28 ms a token against 2.79 with neither, 124M at 0.44
/// against 0.58 (BENCHMARKS.md, the eighth serving round).
pub const BRAID_DECODE_NT: &str = "BRAID_DECODE_NT";
/// Which of the mixed GPU engine's products run in FP8, whatever
/// `--precision` (bf16 or fp8) says: `off`, `forward` (the forward pass's:
/// e4m3 inputs and weights, each scaled by its own amax, fast
/// accumulation) or `all` (or `1`; the backward pass's too, without tensor
/// parallelism: e5m2 output gradients, the weight gradients still added
/// into f32). Unset: `all` under `--precision fp8`, else `off`.
/// Experiments (issue 69); refused below compute capability 8.9.
pub const BRAID_FP8: &str = "BRAID_FP8";
/// A diagnosis of the FP8 products: the first N each said (shape,
/// epilogue, both operands' amax and dequantising scale, the result's
/// largest magnitude and how many of its values are not finite), each
/// waiting for the GPU. Unset: nothing said.
pub const BRAID_FP8_TRACE: &str = "BRAID_FP8_TRACE";
/// How the FP8 products scale their operands: `dynamic` (the default:
/// each by its own amax, measured in a pass of its own first) or `delayed`
/// (each by the amax the same operand had the step before, with a margin
/// of 2, its own measured while it is cast: one read, not two; cast again
/// by its own where it outgrew the margin). Not yet measured (issue 69).
pub const BRAID_FP8_SCALING: &str = "BRAID_FP8_SCALING";
/// The GPU engine's softmax + cross-entropy kernel: `warp` (the default:
/// a warp a row, the logits read twice) or `rows` (a block of 1,024
/// threads a row holding it in registers: read once; rows up to 65,536
/// logits, else the warp kernel). Not yet measured (issue 69).
pub const BRAID_CE: &str = "BRAID_CE";
/// With `BRAID_DECODE_NT`: at most this many blocks a multiprocessor in
/// an NT product's grid, each looping over its groups of outputs (room for
/// the next product to start early under `BRAID_DECODE_OVERLAP`); unset or
/// 0, a block per group (measurement only until a GPU has compared them).
pub const BRAID_DECODE_NT_BLOCKS: &str = "BRAID_DECODE_NT_BLOCKS";
/// With `BRAID_DECODE_FUSED_LN`: at most this many blocks a multiprocessor
/// in the grid of an NT product that normalises its rows itself, each
/// block normalising once and then looping over its groups of outputs
/// (uncapped, every block of every wave normalises the rows again); unset,
/// 2; 0, a block per group (as before 2026-12-07). Not yet measured.
pub const BRAID_DECODE_NT_LN_BLOCKS: &str = "BRAID_DECODE_NT_LN_BLOCKS";
/// With `BRAID_DECODE_NT` and `BRAID_DECODE_OVERLAP`: how the NT products
/// start, words separated by commas or `+` — `first` or `after` (the
/// kernel behind released before or after the wait for the one ahead),
/// `lines`, `bulk` or `none` (the weights asked for into L2 a line a lane,
/// by the copy engine in bulk, or not at all), from `after,lines`. Unset,
/// each product by its weights' size: up to 5 MB `first,bulk`, beyond
/// `after,none` (`NtStart::for_weights`). Measured on an H100
/// (2026-12-07), a layer's products at one row overlapped: 1558M 37.8 µs
/// by `after,lines`, 33.6 by `after,none`; 124M 21.5 by `after,lines`,
/// 18.3 by `first,bulk` (BENCHMARKS.md).
pub const BRAID_DECODE_NT_START: &str = "BRAID_DECODE_NT_START";
/// `1` or `on`: with `BRAID_DECODE_NT`, the LayerNorms before the QKV and
/// MLP products normalised inside the NT products of a few rows (each
/// block normalising its rows itself) rather than by kernels of their own.
/// Off by default: on an H100 (2026-12-07) 1558M served one stream at
/// 3.09 ms a token with it and the QKV product's cache writes, 2.74
/// without either, and 124M eight streams at 0.93 against 0.73
/// (BENCHMARKS.md).
pub const BRAID_DECODE_FUSED_LN: &str = "BRAID_DECODE_FUSED_LN";
/// With `BRAID_DECODE_NT`, a step's keys and values written into the
/// paged cache in the epilogue of the QKV product on the NT kernel rather
/// than by a kernel of their own: on unless `0` or `off`. On an H100
/// (2026-12-07) 1558M served one stream at 2.49 ms a token with it and
/// 2.54 without (BENCHMARKS.md).
pub const BRAID_DECODE_QKV_CACHE: &str = "BRAID_DECODE_QKV_CACHE";
/// `1` or `on`: with `BRAID_DECODE_NT`, a layer's MLP half of a few rows
/// (the attention's projection with the residual, LayerNorm 2, both MLP
/// products) in one kernel whose blocks meet at grid-wide barriers, each
/// block asking for its share of the next product's weights into L2
/// before it arrives, rather than four kernels that each wait for the one
/// ahead. Off by default: slower on an H100 (2026-12-07: 1558M's MLP half
/// at one row 44.2 µs against the four kernels' 27.5; one stream 3.47 ms a
/// token against 2.54; BENCHMARKS.md).
pub const BRAID_DECODE_MLP_KERNEL: &str = "BRAID_DECODE_MLP_KERNEL";
/// `1` or `on`: with `BRAID_DECODE_NT`, the LayerNorm after the
/// attention's projection and after the MLP's second product (the next
/// layer's first) done by that product's own grid, its last block to
/// finish normalising the rows, rather than by a kernel of its own. Off by
/// default: slower on an H100 (2026-12-07: 1558M one stream 2.65 ms a
/// token against 2.26 without; 124M eight streams 0.99 against 0.65;
/// BENCHMARKS.md).
pub const BRAID_DECODE_LN_TAIL: &str = "BRAID_DECODE_LN_TAIL";
/// Warps per block of the GPU decoder's pages attention kernel for every
/// step: 4, 8 or 16; unset or `auto`: 16 where a step's blocks (rows ×
/// heads) are no more than the GPU's multiprocessors, else 4. Every
/// instance computes the same bits (the positions are dealt to 16 virtual
/// warps whatever the block has). On an H100 (2026-12-07, before the
/// choice by rows), 16 served 1558M one stream at 2.93 ms a token against
/// 3.09 with 4, but 64 in flight at 5,835 tokens/s against 11,038.
pub const BRAID_DECODE_PAGE_WARPS: &str = "BRAID_DECODE_PAGE_WARPS";
/// `F,K,Q`: blocks per SM the head-size-128 flash kernels are planned for
/// (measurement only: the bits do not change).
pub const BRAID_FLASH128_BLOCKS: &str = "BRAID_FLASH128_BLOCKS";
/// Heads per group of the flash attention's blocks (0, the default: no
/// groups; measurement only).
pub const BRAID_FLASH_GROUP_HEADS: &str = "BRAID_FLASH_GROUP_HEADS";
/// `0`: biases and GELU in separate passes instead of cuBLASLt's fused
/// epilogues.
pub const BRAID_FUSED_EPILOGUES: &str = "BRAID_FUSED_EPILOGUES";
/// SMs the backward pass's products aim for (0, the default: all).
pub const BRAID_BACKWARD_SM_TARGET: &str = "BRAID_BACKWARD_SM_TARGET";
/// Set (and not `0`): the bf16 engine times its phases on the device and
/// prints them.
pub const BRAID_PROFILE: &str = "BRAID_PROFILE";

// braid-train.

/// GPU data parallelism's all-reduce: `auto` (the default: the copy
/// engines over 2 to 8 GPUs of one host, NCCL otherwise), `ce` or `nccl`.
pub const BRAID_GPU_ALLREDUCE: &str = "BRAID_GPU_ALLREDUCE";
/// `STEP`: the copy-engine reductions of that step timed and printed.
pub const BRAID_CE_TRACE: &str = "BRAID_CE_TRACE";
/// Where ZeRO-3's bf16 gathers run on GPUs: `auto` (the default), `ce`
/// (NCCL's copy engines) or `nccl` (its kernels).
pub const BRAID_ZERO3_GATHER_VIA: &str = "BRAID_ZERO3_GATHER_VIA";

// The braid binary (`braid train`'s memory-for-speed choices, made by
// the memory pre-flight unless set; `auto` or unset leaves it the choice).

/// `bf16` or `f32`: the dtype ZeRO-3 gathers bf16 runs' layers in.
pub const BRAID_ZERO3_GATHER: &str = "BRAID_ZERO3_GATHER";
/// `kept` or `capped`: ZeRO-3 keeps every freed block buffer for reuse,
/// or at most 4.
pub const BRAID_ZERO3_SPARES: &str = "BRAID_ZERO3_SPARES";
/// `on` or `off`: ZeRO-3 reduce-scatters the tied embeddings' gradients
/// in two parts (this one changes the order of a sum).
pub const BRAID_SPLIT_REDUCE: &str = "BRAID_SPLIT_REDUCE";
/// `on` or `off`: saved activations live in idle gradient memory.
pub const BRAID_SAVED_IN_GRADS: &str = "BRAID_SAVED_IN_GRADS";
/// `streamed` or `resident`: the bf16 weights cast layer by layer, or a
/// whole copy kept.
pub const BRAID_BF16_WEIGHTS: &str = "BRAID_BF16_WEIGHTS";
/// `stored` or `recomputed`: the fused attention's score gradients.
pub const BRAID_SCORE_GRADS: &str = "BRAID_SCORE_GRADS";
/// Under checkpointing: `kept`, `recomputed` or a number of layers (the
/// last ones) that keep the attention's state.
pub const BRAID_CKPT_ATTENTION: &str = "BRAID_CKPT_ATTENTION";
/// Under checkpointing: `recomputed` or `kept`, the attention's output.
pub const BRAID_CKPT_ATTENTION_OUTPUT: &str = "BRAID_CKPT_ATTENTION_OUTPUT";
/// `last` (the default) or `first`: a pipeline's first stage keeps its
/// embeddings after its layers (out of its bf16 copy), or in the whole
/// model's order.
pub const BRAID_PP_EMBEDDINGS: &str = "BRAID_PP_EMBEDDINGS";
/// `K`: `--tp`'s bf16 row-split products in K row blocks, each summed
/// beside the next (default 1).
pub const BRAID_TP_OVERLAP: &str = "BRAID_TP_OVERLAP";
/// `on` (the default) or `off`: `--tp` in bf16 sums input gradients
/// beside the weight gradients.
pub const BRAID_TP_GRAD_OVERLAP: &str = "BRAID_TP_GRAD_OVERLAP";
/// `bf16` (the default) or `f32`: the dtype of `--tp`'s row-split sums.
pub const BRAID_TP_SUMS: &str = "BRAID_TP_SUMS";
/// A file for the first step's gradients (one process only).
pub const BRAID_DUMP_GRADS: &str = "BRAID_DUMP_GRADS";
/// Removed (ZeRO-3's update beside the forward pass); only `off` is
/// accepted.
pub const BRAID_UPDATE_BESIDE: &str = "BRAID_UPDATE_BESIDE";
/// Set by `braid train --ps`'s rank process on the child that does its
/// role (server or worker): the attempt, 0 for the first and counting
/// each restart after the child died.
pub const BRAID_PS_CHILD: &str = "BRAID_PS_CHILD";
/// Tests and experiments only: `P[@RANK][:SEED]`, with probability P a
/// worker of a parameter-server run sleeps, between its forward and
/// backward passes, as long as its previous step took, once per step (the
/// transient stragglers of the SSP paper's experiments: its gradients come
/// a step's length late).
pub const BRAID_TEST_STRAGGLE: &str = "BRAID_TEST_STRAGGLE";
/// Tests and experiments only: the free GPU memory braid train's
/// pre-flight counts with instead of the GPU's (bytes, `K`/`M`/`G`
/// suffixes), to start a run it would refuse and see it run out of memory.
pub const BRAID_TEST_GPU_FREE: &str = "BRAID_TEST_GPU_FREE";

// Other programs' variables that braid reads.

/// The user's home directory (the kernel cache, NCCL's Python wheels).
pub const HOME: &str = "HOME";
/// The XDG cache directory (the kernel cache).
pub const XDG_CACHE_HOME: &str = "XDG_CACHE_HOME";
/// A Python virtual environment searched for NCCL's wheel.
pub const VIRTUAL_ENV: &str = "VIRTUAL_ENV";
/// A conda environment searched for NCCL's wheel.
pub const CONDA_PREFIX: &str = "CONDA_PREFIX";
/// The NVTX tool a profiler (`nsys`, `ncu`) attaches.
pub const NVTX_INJECTION64_PATH: &str = "NVTX_INJECTION64_PATH";
/// NCCL's CTA policy, which overrides the zero-CTA policy ZeRO-3's
/// copy-engine gathers ask for.
pub const NCCL_CTA_POLICY: &str = "NCCL_CTA_POLICY";
/// rayon's thread count: where set, `braid train` leaves its CPU thread
/// pool's size to it.
pub const RAYON_NUM_THREADS: &str = "RAYON_NUM_THREADS";
