// CUDA kernels of the bev voxel-pooling ops (schemas and CPU kernels: pool.cpp).
//
// Same plan-driven, atomics-free scheme as the CPU: a voxel sums its run
// order[offsets[v]:offsets[v+1]] in order, so results are bitwise reproducible. Kernels run
// on the current stream, check their launches, and never synchronise with the host; the
// only data-dependent work (run lengths) is read on the device. Indices are int64; half
// types accumulate in float.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.h"

namespace bev {
namespace {

constexpr int kTileVoxels = 32;    // consecutive voxels per block (the coalesced output row)
constexpr int kTileChannels = 32;  // channels per block: one per lane
constexpr int kRowsPerPass = 8;    // blockDim.y; each thread covers kTileVoxels / kRowsPerPass voxels

__device__ __forceinline__ void run_bounds(const int64_t* offsets, int64_t v, int64_t N, int64_t& begin,
                                           int64_t& end) {
  begin = min(max(offsets[v], int64_t(0)), N);
  end = min(max(offsets[v + 1], begin), N);
}

// Forward, block = (32 voxels of one sample) x (32 channels). Lanes run over channels so
// every feature row read is coalesced; the tile is transposed through shared memory so the
// (B, C, S) output is written in coalesced 32-voxel rows too.
template <typename scalar_t, bool kFused>
__global__ void pool_forward_kernel(const scalar_t* __restrict__ feats, const scalar_t* __restrict__ depth,
                                    const int64_t* __restrict__ order, const int64_t* __restrict__ offsets,
                                    scalar_t* __restrict__ out, int64_t S, int64_t tiles_per_batch, int64_t N,
                                    int64_t C, int64_t D, int64_t HW) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t tile[kTileVoxels][kTileChannels + 1];
  const int64_t b = blockIdx.x / tiles_per_batch;
  const int64_t s0 = (blockIdx.x % tiles_per_batch) * kTileVoxels;
  const int64_t width = min(int64_t(kTileVoxels), S - s0);
  const int64_t v0 = b * S + s0;
  const int64_t c0 = int64_t(blockIdx.y) * kTileChannels;
  const int lane = threadIdx.x;
  const int64_t c = c0 + lane;

  for (int j = threadIdx.y; j < kTileVoxels; j += kRowsPerPass) {
    acc_t acc = 0;
    if (j < width && c < C) {
      int64_t begin, end;
      run_bounds(offsets, v0 + j, N, begin, end);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = order[i];
        if (p < 0 || p >= N) continue;
        if constexpr (kFused) {
          const int64_t row = (p / (D * HW)) * HW + p % HW;
          acc += static_cast<acc_t>(depth[p]) * static_cast<acc_t>(feats[row * C + c]);
        } else {
          acc += static_cast<acc_t>(feats[p * C + c]);
        }
      }
    }
    tile[j][lane] = acc;
  }
  __syncthreads();
  for (int k = threadIdx.y; k < kTileChannels; k += kRowsPerPass) {
    if (c0 + k < C && lane < width) out[(b * C + c0 + k) * S + s0 + lane] = static_cast<scalar_t>(tile[lane][k]);
  }
}

// voxel_sum backward: the gather grad_feats[p] = G[key(p)] (zero for ignored points) from
// voxel-major rows G; block = 8 points x 32 channel lanes, coalesced reads and writes.
template <typename scalar_t>
__global__ void gather_rows_kernel(const scalar_t* __restrict__ G, const int64_t* __restrict__ keys,
                                   scalar_t* __restrict__ grad_feats, int64_t N, int64_t C, int64_t V) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (p >= N) return;
  const int64_t k = keys[p];
  const bool inside = k >= 0 && k < V;
  for (int64_t c = threadIdx.x; c < C; c += 32) grad_feats[p * C + c] = inside ? G[k * C + c] : scalar_t(0);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  // Butterfly over a full warp: a fixed reduction tree, so the result is deterministic.
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// bev_pool backward, one warp per feature pixel (which owns exactly its D points), lanes over
// channels; G is grad_out as voxel-major (V, C) rows:
//   grad_depth[p] = <G[key(p)], feats[pix]>,  grad_feats[pix] = sum_d depth[p_d] * G[key(p_d)].
template <typename scalar_t>
__global__ void bev_pool_backward_kernel(const scalar_t* __restrict__ G, const scalar_t* __restrict__ depth,
                                         const scalar_t* __restrict__ feats, const int64_t* __restrict__ keys,
                                         scalar_t* __restrict__ grad_depth, scalar_t* __restrict__ grad_feats,
                                         int64_t pixels, int64_t D, int64_t HW, int64_t C, int64_t V) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t pix = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (pix >= pixels) return;  // whole warp leaves together
  const int lane = threadIdx.x;
  const int64_t bn = pix / HW, hw = pix % HW;
  const scalar_t* frow = feats + pix * C;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t p = (bn * D + d) * HW + hw;
    const int64_t k = keys[p];
    acc_t partial = 0;
    if (k >= 0 && k < V) {
      const scalar_t* grow = G + k * C;
      for (int64_t c = lane; c < C; c += 32) partial += static_cast<acc_t>(grow[c]) * static_cast<acc_t>(frow[c]);
    }
    const acc_t dot = warp_sum(partial);
    if (lane == 0) grad_depth[p] = static_cast<scalar_t>(dot);
  }
  for (int64_t c = lane; c < C; c += 32) {
    acc_t acc = 0;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t p = (bn * D + d) * HW + hw;
      const int64_t k = keys[p];
      if (k >= 0 && k < V) acc += static_cast<acc_t>(depth[p]) * static_cast<acc_t>(G[k * C + c]);
    }
    grad_feats[pix * C + c] = static_cast<scalar_t>(acc);
  }
}

dim3 tile_grid(const GridDims& g, int64_t C, int64_t& tiles_per_batch) {
  tiles_per_batch = (g.per_batch() + kTileVoxels - 1) / kTileVoxels;
  const int64_t x = g.B * tiles_per_batch, y = (C + kTileChannels - 1) / kTileChannels;
  TORCH_CHECK(x < (int64_t(1) << 31) && y < 65536, "grid too large for one launch: ", x, " x ", y, " blocks");
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

std::tuple<at::Tensor, at::Tensor> sort_keys_cuda(const at::Tensor& keys, int64_t num_voxels) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1, "keys must be a 1-D int64 tensor");
  const c10::cuda::CUDAGuard guard(keys.device());
  // Device radix sort (stable) + a fixed-size searchsorted: no host sync, deterministic.
  auto order = at::argsort(keys, /*stable=*/true);
  auto boundaries = at::arange(num_voxels + 1, keys.options());
  auto offsets = at::searchsorted(keys.index_select(0, order), boundaries);
  return {order, offsets};
}

at::Tensor voxel_sum_cuda(const at::Tensor& feats_in, const at::Tensor& keys, const at::Tensor& order,
                          const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  check_float(feats_in, "feats");
  TORCH_CHECK(feats_in.dim() == 2, "feats must be (N, C), got ", feats_in.sizes());
  const GridDims g = check_grid(grid_shape);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  auto feats = feats_in.contiguous();
  const int64_t N = feats.size(0), C = feats.size(1);
  check_index(keys, "keys", N, feats);
  check_index(order, "order", N, feats);
  check_index(offsets, "offsets", g.voxels() + 1, feats);
  auto out = at::empty({g.B, C, g.Z, g.X, g.Y}, feats.options());
  if (out.numel() == 0) return out;
  auto ord = order.contiguous(), off = offsets.contiguous();
  int64_t tiles_per_batch;
  const dim3 blocks = tile_grid(g, C, tiles_per_batch);
  const dim3 threads(kTileChannels, kRowsPerPass);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "voxel_sum_cuda", [&] {
    pool_forward_kernel<scalar_t, false><<<blocks, threads, 0, stream>>>(
        feats.data_ptr<scalar_t>(), nullptr, ord.data_ptr<int64_t>(), off.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), g.per_batch(), tiles_per_batch, N, C, 1, 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor bev_pool_cuda(const at::Tensor& depth_in, const at::Tensor& feats_in, const at::Tensor& keys,
                         const at::Tensor& order, const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  const FrustumDims f = check_frustum(depth_in, feats_in);
  const GridDims g = check_grid(grid_shape);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  auto depth = depth_in.contiguous(), feats = feats_in.contiguous();
  const int64_t N = f.points();
  check_index(keys, "keys", N, feats);
  check_index(order, "order", N, feats);
  check_index(offsets, "offsets", g.voxels() + 1, feats);
  auto out = at::empty({g.B, f.C, g.Z, g.X, g.Y}, feats.options());
  if (out.numel() == 0) return out;
  auto ord = order.contiguous(), off = offsets.contiguous();
  int64_t tiles_per_batch;
  const dim3 blocks = tile_grid(g, f.C, tiles_per_batch);
  const dim3 threads(kTileChannels, kRowsPerPass);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "bev_pool_cuda", [&] {
    pool_forward_kernel<scalar_t, true><<<blocks, threads, 0, stream>>>(
        feats.data_ptr<scalar_t>(), depth.data_ptr<scalar_t>(), ord.data_ptr<int64_t>(), off.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), g.per_batch(), tiles_per_batch, N, f.C, f.D, f.HW);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor voxel_sum_backward_cuda(const at::Tensor& grad_in, const at::Tensor& keys, const at::Tensor& offsets) {
  check_float(grad_in, "grad_out");
  TORCH_CHECK(grad_in.dim() == 5, "grad_out must be (B, C, Z, X, Y), got ", grad_in.sizes());
  const GridDims g{grad_in.size(0), grad_in.size(2), grad_in.size(3), grad_in.size(4)};
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const int64_t N = keys.numel(), C = grad_in.size(1), V = g.voxels();
  check_index(keys, "keys", N, grad_in);
  check_index(offsets, "offsets", V + 1, grad_in);
  // Voxel-major rows (one dense transpose on the current stream), then a coalesced gather.
  auto G = grad_in.permute({0, 2, 3, 4, 1}).contiguous();
  auto k = keys.contiguous();
  auto grad_feats = at::empty({N, C}, grad_in.options());
  if (grad_feats.numel() == 0) return grad_feats;
  constexpr int kPointsPerBlock = 8;
  const int64_t blocks = (N + kPointsPerBlock - 1) / kPointsPerBlock;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "too many points for one launch: ", N);
  const dim3 threads(32, kPointsPerBlock);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, G.scalar_type(), "voxel_sum_backward_cuda", [&] {
    gather_rows_kernel<scalar_t><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        G.data_ptr<scalar_t>(), k.data_ptr<int64_t>(), grad_feats.data_ptr<scalar_t>(), N, C, V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_feats;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cuda(const at::Tensor& grad_in, const at::Tensor& depth_in,
                                                          const at::Tensor& feats_in, const at::Tensor& keys,
                                                          const at::Tensor& offsets) {
  const FrustumDims f = check_frustum(depth_in, feats_in);
  TORCH_CHECK(grad_in.dim() == 5 && grad_in.size(1) == f.C, "grad_out must be (B, C, Z, X, Y) with C=", f.C,
              ", got ", grad_in.sizes());
  TORCH_CHECK(grad_in.scalar_type() == feats_in.scalar_type(), "grad_out must have the dtype of feats");
  check_index(keys, "keys", f.points(), feats_in);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  const int64_t V = grad_in.size(0) * grad_in.size(2) * grad_in.size(3) * grad_in.size(4);
  check_index(offsets, "offsets", V + 1, feats_in);
  // Voxel-major rows: each point reads its voxel's gradient as one coalesced row.
  auto G = grad_in.permute({0, 2, 3, 4, 1}).contiguous();
  auto depth = depth_in.contiguous(), feats = feats_in.contiguous(), k = keys.contiguous();
  auto grad_depth = at::empty_like(depth), grad_feats = at::empty_like(feats);
  const int64_t pixels = f.pixels();
  if (depth.numel() == 0) {
    grad_feats.zero_();
    return {grad_depth, grad_feats};
  }
  constexpr int kWarpsPerBlock = 8;
  const int64_t blocks = (pixels + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "too many feature pixels for one launch: ", pixels);
  const dim3 threads(32, kWarpsPerBlock);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "bev_pool_backward_cuda", [&] {
    bev_pool_backward_kernel<scalar_t><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        G.data_ptr<scalar_t>(), depth.data_ptr<scalar_t>(), feats.data_ptr<scalar_t>(), k.data_ptr<int64_t>(),
        grad_depth.data_ptr<scalar_t>(), grad_feats.data_ptr<scalar_t>(), pixels, f.D, f.HW, f.C, V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_depth, grad_feats};
}

}  // namespace

TORCH_LIBRARY_IMPL(bev, CUDA, m) {
  m.impl("sort_keys", &sort_keys_cuda);
  m.impl("voxel_sum", &voxel_sum_cuda);
  m.impl("voxel_sum_backward", &voxel_sum_backward_cuda);
  m.impl("bev_pool", &bev_pool_cuda);
  m.impl("bev_pool_backward", &bev_pool_backward_cuda);
}

}  // namespace bev
