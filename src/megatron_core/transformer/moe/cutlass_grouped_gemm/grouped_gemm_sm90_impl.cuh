// The kernel of one weight layout, included by grouped_gemm_sm90.cu inside a namespace that defines LayoutB
// (the CUTLASS collective builders are instantiated at namespace scope, not inside a class template).

using Elem = cutlass::bfloat16_t;
using Acc = float;
using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
constexpr int kAlign = 8;  // elements per 16 bytes

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
    Acc, Acc, void, cutlass::layout::RowMajor*, kAlign, Elem, cutlass::layout::RowMajor*, kAlign,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, cutlass::layout::RowMajor*, kAlign, Elem, LayoutB*,
    kAlign, Acc, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>::CollectiveOp;
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using Extent = typename ProblemShape::UnderlyingProblemShape;

constexpr size_t kSlice = 256;
inline size_t round_up(size_t bytes) { return (bytes + kSlice - 1) / kSlice * kSlice; }

// Offsets of the per-group arrays in the caller's workspace, then CUTLASS's own workspace.
struct Slices {
  size_t extents, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, cutlass, total;
};

inline Slices slices(int groups, size_t cutlass_bytes) {
  Slices s{};
  size_t at = 0;
  auto take = [&](size_t bytes) { size_t here = at; at += round_up(bytes); return here; };
  s.extents = take(sizeof(Extent) * groups);
  s.ptr_a = take(sizeof(void*) * groups);
  s.ptr_b = take(sizeof(void*) * groups);
  s.ptr_d = take(sizeof(void*) * groups);
  s.stride_a = take(sizeof(StrideA) * groups);
  s.stride_b = take(sizeof(StrideB) * groups);
  s.stride_d = take(sizeof(StrideD) * groups);
  s.cutlass = take(cutlass_bytes);
  s.total = at;
  return s;
}

__global__ void write_group_arguments(const int* __restrict__ offs, int groups, int n, int k, const Elem* a,
                                      const Elem* w, Elem* d, Extent* extents, const Elem** ptr_a,
                                      const Elem** ptr_b, Elem** ptr_d, StrideA* stride_a, StrideB* stride_b,
                                      StrideD* stride_d) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  int start = e == 0 ? 0 : offs[e - 1];
  int rows = offs[e] - start;
  if (rows < 0) rows = 0;
  extents[e] = Extent{rows, n, k};
  ptr_a[e] = a + int64_t(start) * k;
  ptr_b[e] = w + int64_t(e) * n * k;
  ptr_d[e] = d + int64_t(start) * n;
  stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(rows, k, 1));
  stride_b[e] = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
  stride_d[e] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(rows, n, 1));
}

inline int multiprocessors(int device) {
  static int known[64] = {0};
  if (device < 0 || device >= 64) return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  if (known[device] == 0) known[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return known[device];
}

inline Gemm::Arguments arguments(int groups, int device, const Slices& s, uint8_t* ws) {
  Gemm::Arguments args;
  auto at = [&](size_t offset) { return ws ? ws + offset : nullptr; };
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{groups, reinterpret_cast<Extent*>(at(s.extents)), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const Elem**>(at(s.ptr_a));
  args.mainloop.dA = reinterpret_cast<StrideA*>(at(s.stride_a));
  args.mainloop.ptr_B = reinterpret_cast<const Elem**>(at(s.ptr_b));
  args.mainloop.dB = reinterpret_cast<StrideB*>(at(s.stride_b));
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<Elem**>(at(s.ptr_d));
  args.epilogue.dD = reinterpret_cast<StrideD*>(at(s.stride_d));
  args.hw_info.device_id = device;
  args.hw_info.sm_count = multiprocessors(device);
  args.scheduler.max_swizzle_size = 1;  // a larger swizzle pads every group's row tiles
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
  return args;
}

inline Slices sized_slices(int groups, int device) {
  return slices(groups, Gemm::get_workspace_size(arguments(groups, device, slices(groups, 0), nullptr)));
}

inline size_t workspace_bytes(int groups) {
  int device = 0;
  cudaGetDevice(&device);
  return sized_slices(groups, device).total;
}

inline int run(const void* a, const void* w, void* d, const int* offs, int groups, int n, int k, void* workspace,
               size_t bytes, cudaStream_t stream) {
  (void)cudaGetLastError();
  if (groups <= 0) return 0;
  if (n % kAlign != 0 || k % kAlign != 0) return -2;
  auto address = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  if ((address(a) | address(w) | address(d)) % 16 != 0 || address(workspace) % 64 != 0) return -3;
  int device = 0;
  cudaGetDevice(&device);
  uint8_t* ws = reinterpret_cast<uint8_t*>(workspace);
  Slices s = sized_slices(groups, device);
  if (bytes < s.total) return -4;
  write_group_arguments<<<(groups + 127) / 128, 128, 0, stream>>>(
      offs, groups, n, k, reinterpret_cast<const Elem*>(a), reinterpret_cast<const Elem*>(w),
      reinterpret_cast<Elem*>(d), reinterpret_cast<Extent*>(ws + s.extents), reinterpret_cast<const Elem**>(ws + s.ptr_a),
      reinterpret_cast<const Elem**>(ws + s.ptr_b), reinterpret_cast<Elem**>(ws + s.ptr_d),
      reinterpret_cast<StrideA*>(ws + s.stride_a), reinterpret_cast<StrideB*>(ws + s.stride_b),
      reinterpret_cast<StrideD*>(ws + s.stride_d));
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return 1000 + int(error);
  Gemm gemm;
  Gemm::Arguments args = arguments(groups, device, s, ws);
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return 100 + int(status);
  status = gemm.initialize(args, ws + s.cutlass, stream);
  if (status != cutlass::Status::kSuccess) return 200 + int(status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    error = cudaGetLastError();
    return error != cudaSuccess ? 1000 + int(error) : 300 + int(status);
  }
  return 0;
}
