// Device code of the bev voxel-pooling ops: the kernels, their device helpers and the launch
// geometry. pool_cuda.cu launches them on a GPU; the test-only SIMT emulation
// (tests/cuda_emulation/) compiles this very file with a plain C++ compiler and runs it on the
// CPU with CUDA semantics, so nothing here may be host-only (no ATen tensors, no TORCH_CHECK,
// no std:: containers): built-ins, __shared__ arrays, warp shuffles and plain arithmetic only.
//
// Same plan-driven, atomics-free scheme as the CPU kernels: voxel v sums its run
// order[offsets[v]:offsets[v+1]] in order, so results are bitwise reproducible. Indices are
// int64 throughout; half types accumulate in float (at::opmath_type).
#pragma once

#if !defined(__CUDACC__) && !defined(BEV_SIMT_EMULATION)
#error "pool_kernels.cuh is device code: include it from a .cu file or through tests/cuda_emulation/simt.h"
#endif

#include <ATen/OpMathType.h>

#include <cstdint>

namespace bev {
namespace kernels {

constexpr int kWarp = 32;
constexpr int kTileVoxels = 32;    // consecutive voxels per forward block (the coalesced output row)
constexpr int kTileChannels = 32;  // channels per forward block: one per lane
constexpr int kRowsPerBlock = 8;   // blockDim.y: warps per block; a forward thread covers kTileVoxels / 8 voxels

// The forward block's transpose tile (+1 column: lanes reading a tile column hit distinct banks).
template <typename acc_t>
using ForwardTile = acc_t[kTileVoxels][kTileChannels + 1];

// ------------------------------------------------------------------------------------------
// Index helpers: int64 in, int64 out, callable on the host too (tested past 2^31).
// ------------------------------------------------------------------------------------------
// Fused point p = ((b*Nc + n)*D + d)*HW + hw reads the feature row (b*Nc + n)*HW + hw.
__host__ __device__ __forceinline__ int64_t frustum_feature_row(int64_t p, int64_t D, int64_t HW) {
  return (p / (D * HW)) * HW + p % HW;
}

// The point of depth bin d of feature pixel pix = bn*HW + hw.
__host__ __device__ __forceinline__ int64_t frustum_point(int64_t pix, int64_t d, int64_t D, int64_t HW) {
  return ((pix / HW) * D + d) * HW + pix % HW;
}

// Element (b, c, s) of an output grid (B, C, S).
__host__ __device__ __forceinline__ int64_t grid_index(int64_t b, int64_t c, int64_t s, int64_t C, int64_t S) {
  return (b * C + c) * S + s;
}

// A voxel's run [begin, end) in `order`, clamped to [0, N]: a malformed plan never reads out of bounds.
__device__ __forceinline__ void run_bounds(const int64_t* offsets, int64_t v, int64_t N, int64_t& begin,
                                           int64_t& end) {
  begin = min(max(offsets[v], int64_t(0)), N);
  end = min(max(offsets[v + 1], begin), N);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  // Butterfly over a full warp: a fixed reduction tree, so the result is deterministic.
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// ------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------
// Forward, block = (32 voxels of one sample) x (32 channels). Lanes run over channels so
// every feature row read is coalesced; the tile is transposed through shared memory so the
// (B, C, S) output is written in coalesced 32-voxel rows too.
template <typename scalar_t, bool kFused>
__global__ void pool_forward_kernel(const scalar_t* __restrict__ feats, const scalar_t* __restrict__ depth,
                                    const int64_t* __restrict__ order, const int64_t* __restrict__ offsets,
                                    scalar_t* __restrict__ out, int64_t S, int64_t tiles_per_batch, int64_t N,
                                    int64_t C, int64_t D, int64_t HW) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ ForwardTile<acc_t> tile;
  const int64_t b = blockIdx.x / tiles_per_batch;
  const int64_t s0 = (blockIdx.x % tiles_per_batch) * kTileVoxels;
  const int64_t width = min(int64_t(kTileVoxels), S - s0);
  const int64_t v0 = b * S + s0;
  const int64_t c0 = int64_t(blockIdx.y) * kTileChannels;
  const int lane = threadIdx.x;
  const int64_t c = c0 + lane;

  for (int j = threadIdx.y; j < kTileVoxels; j += kRowsPerBlock) {
    acc_t acc = 0;
    if (j < width && c < C) {
      int64_t begin, end;
      run_bounds(offsets, v0 + j, N, begin, end);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = order[i];
        if (p < 0 || p >= N) continue;
        if constexpr (kFused) {
          acc += static_cast<acc_t>(depth[p]) * static_cast<acc_t>(feats[frustum_feature_row(p, D, HW) * C + c]);
        } else {
          acc += static_cast<acc_t>(feats[p * C + c]);
        }
      }
    }
    tile[j][lane] = acc;
  }
  __syncthreads();
  for (int k = threadIdx.y; k < kTileChannels; k += kRowsPerBlock) {
    if (c0 + k < C && lane < width) out[grid_index(b, c0 + k, s0 + lane, C, S)] = static_cast<scalar_t>(tile[lane][k]);
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
  for (int64_t c = threadIdx.x; c < C; c += kWarp) grad_feats[p * C + c] = inside ? G[k * C + c] : scalar_t(0);
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
  const scalar_t* frow = feats + pix * C;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t p = frustum_point(pix, d, D, HW);
    const int64_t k = keys[p];
    acc_t partial = 0;
    if (k >= 0 && k < V) {
      const scalar_t* grow = G + k * C;
      for (int64_t c = lane; c < C; c += kWarp) partial += static_cast<acc_t>(grow[c]) * static_cast<acc_t>(frow[c]);
    }
    const acc_t dot = warp_sum(partial);
    if (lane == 0) grad_depth[p] = static_cast<scalar_t>(dot);
  }
  for (int64_t c = lane; c < C; c += kWarp) {
    acc_t acc = 0;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t p = frustum_point(pix, d, D, HW);
      const int64_t k = keys[p];
      if (k >= 0 && k < V) acc += static_cast<acc_t>(depth[p]) * static_cast<acc_t>(G[k * C + c]);
    }
    grad_feats[pix * C + c] = static_cast<scalar_t>(acc);
  }
}

// ------------------------------------------------------------------------------------------
// Launch geometry (host): the one definition used by the CUDA launcher and the emulation.
// Sizes stay int64 so that fits_one_launch can see a grid too large for one launch.
// ------------------------------------------------------------------------------------------
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxBlockThreads = 1024;
constexpr int64_t kMaxStaticSharedBytes = 48 * 1024;  // without an opt-in

struct Launch {
  int64_t grid_x, grid_y;
  int64_t block_x, block_y;
  int64_t tiles_per_batch;  // pool_forward_kernel only
  int64_t shared_bytes;     // static __shared__ memory per block
};

// pool_forward_kernel over B samples of S voxels and C channels.
template <typename scalar_t>
inline Launch forward_launch(int64_t B, int64_t S, int64_t C) {
  const int64_t tiles_per_batch = (S + kTileVoxels - 1) / kTileVoxels;
  return {B * tiles_per_batch, (C + kTileChannels - 1) / kTileChannels, kTileChannels, kRowsPerBlock,
          tiles_per_batch, int64_t(sizeof(ForwardTile<at::opmath_type<scalar_t>>))};
}

// gather_rows_kernel (rows = points) and bev_pool_backward_kernel (rows = feature pixels):
// one warp per row.
inline Launch rows_launch(int64_t rows) {
  return {(rows + kRowsPerBlock - 1) / kRowsPerBlock, 1, kWarp, kRowsPerBlock, 0, 0};
}

inline bool fits_one_launch(const Launch& l) {
  return l.grid_x >= 1 && l.grid_x <= kMaxGridX && l.grid_y >= 1 && l.grid_y <= kMaxGridYZ &&
         l.block_x * l.block_y <= kMaxBlockThreads && l.block_x % kWarp == 0 &&
         l.shared_bytes <= kMaxStaticSharedBytes;
}

inline dim3 grid_dim(const Launch& l) { return dim3(unsigned(l.grid_x), unsigned(l.grid_y)); }
inline dim3 block_dim(const Launch& l) { return dim3(unsigned(l.block_x), unsigned(l.block_y)); }

}  // namespace kernels
}  // namespace bev
