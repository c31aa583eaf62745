// Host glue shared by the CUDA entry points: the device guard, the launch on the current stream,
// and the block size. Under TURBOSPEC_EMULATE (tests/ops/cuda_emu) the same entry points run their
// kernels on the CPU, one fiber per CUDA thread.
#pragma once

#ifdef TURBOSPEC_EMULATE

#define TS_KERNEL_DEVICE c10::DeviceType::CPU
#define TS_DEVICE_GUARD(tensor) (void)(tensor)
#define TS_LAUNCH(kernel, grid, block, ...) ::emu::launch(kernel, grid, block, __VA_ARGS__)

#else

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define TS_KERNEL_DEVICE c10::DeviceType::CUDA
#define TS_DEVICE_GUARD(tensor) const c10::cuda::CUDAGuard ts_device_guard_((tensor).device())
// Kernels run on the caller's current stream, asynchronously: no host synchronisation.
#define TS_LAUNCH(kernel, grid, block, ...)                                               \
  do {                                                                                    \
    kernel<<<(grid), (block), 0, at::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__);        \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                       \
  } while (0)

#endif

namespace turbospec {
namespace gpu {

// Threads per block for kernels that sweep a vocabulary row: enough to keep the loads in flight
// on large vocabularies, few on small ones (every block-wide reduction costs a few syncs).
inline int row_block_threads(int64_t vocab) {
#ifdef TURBOSPEC_EMULATE
  if (::emu::block_threads_override > 0) return ::emu::block_threads_override;
#endif
  return vocab >= 16384 ? 512 : vocab >= 1024 ? 256 : 64;
}

}  // namespace gpu
}  // namespace turbospec
