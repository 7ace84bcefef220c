// Experimental bf16 grouped GEMM (group dimension = M, ragged rows per expert) for sm_90a,
// built on CUTLASS 3.x ptr-array / grouped TMA warp-specialized kernels.
//
// This ONE source is compiled once per (variant, layout) by build.sh:
//   -DGMM_VARIANT_ID=<1..7> (= variants a..g) tile / cluster / schedule choice (table below)
//   -DGMM_LAYOUT_NN=<0|1>  0: "tn"  A=[T,K] row-major, W=[E,N,K] row-major (B_e = W[e]^T, K-contiguous)
//                          1: "nn"  A=[T,K] row-major, W=[E,K,N] row-major (B_e = W[e],   N-contiguous)
// D = [T,N] row-major, bf16 out, fp32 accumulate, alpha=1, beta=0, no C operand (ElementC=void).
//
// Exported C ABI (NAME = gmm_<variant name>_<tn|nn>):
//   int    NAME(const void* A, const void* W, void* D, const int* offs, int E, int T, int N, int K,
//              void* workspace, size_t workspace_bytes, cudaStream_t stream);
//   size_t NAME_workspace(int E);
// offs: device int32[E], cumulative row ENDS (offs[E-1] == T expected; not checked on host).
// Everything per-group (shapes, pointers, strides) is computed on the device; no host sync.

#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#ifndef GMM_VARIANT_ID
#error "define GMM_VARIANT_ID (1..7 = variants a..g)"
#endif
#ifndef GMM_LAYOUT_NN
#error "define GMM_LAYOUT_NN (0 or 1)"
#endif

// Defined in gmm_options.cu (shared by all variants): 0 = Heuristic, 1 = AlongM (CUTLASS grouped default), 2 = AlongN.
extern "C" int gmm_raster_order_get();

#define GMM_CAT_(a, b) a##b
#define GMM_CAT(a, b) GMM_CAT_(a, b)
// Named (not anonymous) per-TU namespace: nvcc's stub generation breaks on an anonymous namespace here
// (it collides with cute's own anonymous namespace), and all TUs are linked into one .so.
#define GMM_NS GMM_CAT(GMM_CAT(gmm_impl_v, GMM_VARIANT_ID), GMM_CAT(_nn, GMM_LAYOUT_NN))

namespace GMM_NS {
using namespace cute;

// ------------------------------------------------------------------------------------------------
// Variant table
// ------------------------------------------------------------------------------------------------
using Coop     = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CoopEpi  = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Ping     = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using PingEpi  = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

#if   GMM_VARIANT_ID == 1   // (a) 128x256x64, cluster 1x2 (A multicast along N), cooperative
using VTile = Shape<_128, _256, _64>; using VCluster = Shape<_1, _2, _1>;
using VSched = Coop; using VEpi = CoopEpi;
#define GMM_VNAME m128n256_c1x2_coop
#elif GMM_VARIANT_ID == 2   // (b) 128x128x64, cluster 1x1, cooperative
using VTile = Shape<_128, _128, _64>; using VCluster = Shape<_1, _1, _1>;
using VSched = Coop; using VEpi = CoopEpi;
#define GMM_VNAME m128n128_c1x1_coop
#elif GMM_VARIANT_ID == 3   // (c) 128x128x64, cluster 1x2, cooperative
using VTile = Shape<_128, _128, _64>; using VCluster = Shape<_1, _2, _1>;
using VSched = Coop; using VEpi = CoopEpi;
#define GMM_VNAME m128n128_c1x2_coop
#elif GMM_VARIANT_ID == 4   // (d) 64x256x64, cluster 1x2, ping-pong (M granularity 64)
using VTile = Shape<_64, _256, _64>; using VCluster = Shape<_1, _2, _1>;
using VSched = Ping; using VEpi = PingEpi;
#define GMM_VNAME m64n256_c1x2_pp
#elif GMM_VARIANT_ID == 5   // (e) 128x256x64, cluster 2x1 (B multicast along M), cooperative: ~torch control
using VTile = Shape<_128, _256, _64>; using VCluster = Shape<_2, _1, _1>;
using VSched = Coop; using VEpi = CoopEpi;
#define GMM_VNAME m128n256_c2x1_coop
#elif GMM_VARIANT_ID == 6   // (f) 128x128x64, cluster 1x2, ping-pong
using VTile = Shape<_128, _128, _64>; using VCluster = Shape<_1, _2, _1>;
using VSched = Ping; using VEpi = PingEpi;
#define GMM_VNAME m128n128_c1x2_pp
#elif GMM_VARIANT_ID == 7   // (g) 128x256x64, cluster 1x1 (no multicast), cooperative
using VTile = Shape<_128, _256, _64>; using VCluster = Shape<_1, _1, _1>;
using VSched = Coop; using VEpi = CoopEpi;
#define GMM_VNAME m128n256_c1x1_coop
#else
#error "unknown GMM_VARIANT_ID"
#endif

#if GMM_LAYOUT_NN
using LayoutB = cutlass::layout::RowMajor;      // B (K x N) N-contiguous: W[e] is [K,N] row-major
#define GMM_LNAME _nn
#else
using LayoutB = cutlass::layout::ColumnMajor;   // B (K x N) K-contiguous: W[e] is [N,K] row-major
#define GMM_LNAME _tn
#endif

#define GMM_FN      GMM_CAT(GMM_CAT(gmm_, GMM_VNAME), GMM_LNAME)
#define GMM_FN_WS   GMM_CAT(GMM_FN, _workspace)

// ------------------------------------------------------------------------------------------------
// Kernel type
// ------------------------------------------------------------------------------------------------
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // per group <M,N,K>
using Elem   = cutlass::bfloat16_t;
using Acc    = float;
using LayoutA = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlign = 128 / cutlass::sizeof_bits<Elem>::value;  // 8 elements = 16 bytes

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    VTile, VCluster,
    cutlass::epilogue::collective::EpilogueTileAuto,
    Acc, Acc,
    void, LayoutD*, kAlign,          // no C operand
    Elem, LayoutD*, kAlign,
    VEpi>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Elem, LayoutA*, kAlign,
    Elem, LayoutB*, kAlign,
    Acc,
    VTile, VCluster,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    VSched>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using UShape  = typename ProblemShape::UnderlyingProblemShape;

// ------------------------------------------------------------------------------------------------
// Our own part of the workspace: per-group arrays, built on device.
// ------------------------------------------------------------------------------------------------
constexpr size_t kAlignBytes = 256;
inline size_t ws_round_up(size_t x) { return (x + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

struct Carve {
  size_t shapes, ptrA, ptrB, ptrD, strA, strB, strD, cutlass_ws, total;
};

inline Carve carve(int E, size_t cutlass_ws_bytes) {
  Carve c{};
  size_t o = 0;
  c.shapes = o; o += ws_round_up(sizeof(UShape) * E);
  c.ptrA   = o; o += ws_round_up(sizeof(void*) * E);
  c.ptrB   = o; o += ws_round_up(sizeof(void*) * E);
  c.ptrD   = o; o += ws_round_up(sizeof(void*) * E);
  c.strA   = o; o += ws_round_up(sizeof(StrideA) * E);
  c.strB   = o; o += ws_round_up(sizeof(StrideB) * E);
  c.strD   = o; o += ws_round_up(sizeof(StrideD) * E);
  c.cutlass_ws = o; o += ws_round_up(cutlass_ws_bytes);
  c.total = o;
  return c;
}

__global__ void build_group_args(
    const int* __restrict__ offs, int E, int N, int K,
    const Elem* A, const Elem* W, Elem* D,
    UShape* shapes, const Elem** ptrA, const Elem** ptrB, Elem** ptrD,
    StrideA* strA, StrideB* strB, StrideD* strD) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int start = (e == 0) ? 0 : offs[e - 1];
  int end = offs[e];
  int M = end - start;
  if (M < 0) M = 0;
  shapes[e] = UShape{M, N, K};
  ptrA[e] = A + int64_t(start) * K;
  ptrB[e] = W + int64_t(e) * N * K;
  ptrD[e] = D + int64_t(start) * N;
  strA[e] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  strB[e] = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  strD[e] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, N, 1));
}

int sm_count_cached() {
  static int cache[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
  if (cache[dev] == 0) cache[dev] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
  return cache[dev];
}

typename Gemm::Arguments make_args(int E, int sm_count, int dev, const Carve& c, uint8_t* ws) {
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{E, ws ? reinterpret_cast<UShape*>(ws + c.shapes) : nullptr, nullptr};
  args.mainloop.ptr_A = ws ? reinterpret_cast<const Elem**>(ws + c.ptrA) : nullptr;
  args.mainloop.dA    = ws ? reinterpret_cast<StrideA*>(ws + c.strA) : nullptr;
  args.mainloop.ptr_B = ws ? reinterpret_cast<const Elem**>(ws + c.ptrB) : nullptr;
  args.mainloop.dB    = ws ? reinterpret_cast<StrideB*>(ws + c.strB) : nullptr;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = ws ? reinterpret_cast<Elem**>(ws + c.ptrD) : nullptr;
  args.epilogue.dD    = ws ? reinterpret_cast<StrideD*>(ws + c.strD) : nullptr;
  args.hw_info.device_id = dev;
  args.hw_info.sm_count = sm_count;
  args.hw_info.max_active_clusters = 0;  // let the scheduler use its GH100 heuristic
  args.scheduler.max_swizzle_size = 1;   // swizzle>1 would pad each group's M tiles
  args.scheduler.raster_order =
      static_cast<cutlass::gemm::kernel::detail::RasterOrderOptions>(gmm_raster_order_get());
  return args;
}

size_t workspace_bytes_for(int E) {
  int dev = 0;
  cudaGetDevice(&dev);
  int sms = sm_count_cached();
  Carve c0 = carve(E, 0);
  typename Gemm::Arguments args = make_args(E, sms, dev, c0, nullptr);
  size_t cws = Gemm::get_workspace_size(args);
  return carve(E, cws).total;
}

}  // namespace GMM_NS

using namespace GMM_NS;

extern "C" size_t GMM_FN_WS(int E) { return workspace_bytes_for(E); }

extern "C" int GMM_FN(const void* A, const void* W, void* D, const int* offs, int E, int T, int N, int K,
                      void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  (void)T;
  (void)cudaGetLastError();  // clear a stale (non-sticky) error of this library's runtime instance
  if (E <= 0) return 0;
  if ((N % kAlign) != 0 || (K % kAlign) != 0) return -2;
  // 16 B for TMA base addresses; 64 B for the TMA descriptors CUTLASS keeps in the workspace.
  if ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(W) | reinterpret_cast<uintptr_t>(D)) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(workspace) % 64 != 0)
    return -3;

  int dev = 0;
  cudaGetDevice(&dev);
  int sms = sm_count_cached();
  uint8_t* ws = reinterpret_cast<uint8_t*>(workspace);
  Carve c0 = carve(E, 0);
  size_t cws = Gemm::get_workspace_size(make_args(E, sms, dev, c0, nullptr));
  Carve c = carve(E, cws);
  if (workspace_bytes < c.total) return -4;

  {
    int threads = 128;
    int blocks = (E + threads - 1) / threads;
    build_group_args<<<blocks, threads, 0, stream>>>(
        offs, E, N, K,
        reinterpret_cast<const Elem*>(A), reinterpret_cast<const Elem*>(W), reinterpret_cast<Elem*>(D),
        reinterpret_cast<UShape*>(ws + c.shapes),
        reinterpret_cast<const Elem**>(ws + c.ptrA), reinterpret_cast<const Elem**>(ws + c.ptrB),
        reinterpret_cast<Elem**>(ws + c.ptrD),
        reinterpret_cast<StrideA*>(ws + c.strA), reinterpret_cast<StrideB*>(ws + c.strB),
        reinterpret_cast<StrideD*>(ws + c.strD));
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return 1000 + int(err);
  }

  typename Gemm::Arguments args = make_args(E, sms, dev, c, ws);
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) return 100 + int(st);
  st = gemm.initialize(args, ws + c.cutlass_ws, stream);
  if (st != cutlass::Status::kSuccess) return 200 + int(st);
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? 1000 + int(err) : 300 + int(st);
  }
  return 0;
}
