// Grouped GEMM over experts' row blocks for Hopper (sm_90a), on CUTLASS 3's ptr-array grouped kernels.
//
// Group e multiplies rows offs[e-1] .. offs[e] of A ([T, K], row-major) by expert e's weight and writes the
// same rows of D ([T, N], row-major); bf16 in and out, fp32 accumulation. The row tiles are 128 high (PyTorch's
// grouped_mm rounds each expert's rows to 256 on this GPU), in 1x2 clusters along N, ping-pong schedule.
//   "tn" (forward):        W [E, N, K] row-major, D = A @ W[e]^T
//   "nn" (data gradient):  W [E, K, N] row-major, D = A @ W[e]
// The per-group shapes, pointers and strides are written on the device from `offs` (int32 cumulative row ends),
// so a call never waits for the GPU. Exported (C ABI, for ctypes):
//   int    mcore_gmm_tn(A, W, D, offs, E, N, K, workspace, workspace_bytes, stream)   0 on success
//   int    mcore_gmm_nn(...)                                                          same arguments
//   size_t mcore_gmm_workspace_bytes(E)                                               for either layout
// Error codes: -2 N or K not a multiple of 8, -3 misaligned pointer, -4 workspace too small,
// 100 + s can_implement, 200 + s initialize, 300 + s run (s: cutlass::Status), 1000 + e a CUDA error e.

#include <cstdint>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

// One namespace per weight layout (see grouped_gemm_sm90_impl.cuh).
namespace mcore_gmm_forward {
using LayoutB = cutlass::layout::ColumnMajor;  // B = W[e]^T, K-contiguous
#include "grouped_gemm_sm90_impl.cuh"
}  // namespace mcore_gmm_forward

namespace mcore_gmm_data_grad {
using LayoutB = cutlass::layout::RowMajor;  // B = W[e], N-contiguous
#include "grouped_gemm_sm90_impl.cuh"
}  // namespace mcore_gmm_data_grad

extern "C" size_t mcore_gmm_workspace_bytes(int groups) {
  size_t forward = mcore_gmm_forward::workspace_bytes(groups);
  size_t data_grad = mcore_gmm_data_grad::workspace_bytes(groups);
  return forward > data_grad ? forward : data_grad;
}

extern "C" int mcore_gmm_tn(const void* a, const void* w, void* d, const int* offs, int groups, int n, int k,
                            void* workspace, size_t bytes, cudaStream_t stream) {
  return mcore_gmm_forward::run(a, w, d, offs, groups, n, k, workspace, bytes, stream);
}

extern "C" int mcore_gmm_nn(const void* a, const void* w, void* d, const int* offs, int groups, int n, int k,
                            void* workspace, size_t bytes, cudaStream_t stream) {
  return mcore_gmm_data_grad::run(a, w, d, offs, groups, n, k, workspace, bytes, stream);
}
