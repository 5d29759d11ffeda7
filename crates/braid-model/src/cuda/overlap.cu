// Put before kernels.cu and mixed.cu by sources.rs.
//
// Overlapped launches (Hopper's programmatic dependent launch): a kernel
// the host launches overlapping the one ahead of it may start early, and
// must call overlap_wait() — which returns once that kernel has finished
// and its writes are visible — before it reads what that kernel wrote or
// writes what it reads. overlap_release() lets the kernel behind this one
// start (to reach its own wait). Both are no-ops in a kernel launched the
// ordinary way, and below sm_90.
__device__ __forceinline__ void overlap_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void overlap_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
