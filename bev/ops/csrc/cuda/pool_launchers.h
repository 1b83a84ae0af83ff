// Host side of the CUDA ops: argument checks, tensor preparation and launch geometry, written
// once for two launch policies. pool_cuda.cu passes one that launches on the current CUDA
// stream; the SIMT emulation of the test suite (tests/cuda_emulation/) passes one that runs the
// same kernels on the CPU. A policy is called as launch(kernel, Launch, kernel arguments...).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <tuple>

#include "common.h"
#include "cuda/pool_kernels.cuh"

namespace bev {
namespace kernels {

// Checked before every launch: a clear error rather than a failed launch.
inline void check_launch(const Launch& l, const char* what) {
  TORCH_CHECK(fits_one_launch(l), what, " is too large for one CUDA launch: grid ", l.grid_x, " x ", l.grid_y,
              " blocks of ", l.block_x, " x ", l.block_y, " threads, ", l.shared_bytes, " bytes of shared memory");
}

template <typename Launcher>
at::Tensor voxel_sum_launch(const Launcher& launch, const at::Tensor& feats_in, const at::Tensor& keys,
                            const at::Tensor& order, const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  check_float(feats_in, "feats");
  TORCH_CHECK(feats_in.dim() == 2, "feats must be (N, C), got ", feats_in.sizes());
  const GridDims g = check_grid(grid_shape);
  auto feats = feats_in.contiguous();
  const int64_t N = feats.size(0), C = feats.size(1);
  check_index(keys, "keys", N, feats);
  check_index(order, "order", N, feats);
  check_index(offsets, "offsets", g.voxels() + 1, feats);
  auto out = at::empty({g.B, C, g.Z, g.X, g.Y}, feats.options());
  if (out.numel() == 0) return out;
  auto ord = order.contiguous(), off = offsets.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "voxel_sum_cuda", [&] {
    const Launch l = forward_launch<scalar_t>(g.B, g.per_batch(), C);
    check_launch(l, "voxel_sum");
    launch(pool_forward_kernel<scalar_t, false>, l, feats.data_ptr<scalar_t>(), static_cast<const scalar_t*>(nullptr),
           ord.data_ptr<int64_t>(), off.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), g.per_batch(),
           l.tiles_per_batch, N, C, int64_t(1), int64_t(1));
  });
  return out;
}

template <typename Launcher>
at::Tensor bev_pool_launch(const Launcher& launch, const at::Tensor& depth_in, const at::Tensor& feats_in,
                           const at::Tensor& keys, const at::Tensor& order, const at::Tensor& offsets,
                           at::IntArrayRef grid_shape) {
  const FrustumDims f = check_frustum(depth_in, feats_in);
  const GridDims g = check_grid(grid_shape);
  auto depth = depth_in.contiguous(), feats = feats_in.contiguous();
  const int64_t N = f.points();
  check_index(keys, "keys", N, feats);
  check_index(order, "order", N, feats);
  check_index(offsets, "offsets", g.voxels() + 1, feats);
  auto out = at::empty({g.B, f.C, g.Z, g.X, g.Y}, feats.options());
  if (out.numel() == 0) return out;
  auto ord = order.contiguous(), off = offsets.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "bev_pool_cuda", [&] {
    const Launch l = forward_launch<scalar_t>(g.B, g.per_batch(), f.C);
    check_launch(l, "bev_pool");
    launch(pool_forward_kernel<scalar_t, true>, l, feats.data_ptr<scalar_t>(), depth.data_ptr<scalar_t>(),
           ord.data_ptr<int64_t>(), off.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), g.per_batch(),
           l.tiles_per_batch, N, f.C, f.D, f.HW);
  });
  return out;
}

template <typename Launcher>
at::Tensor voxel_sum_backward_launch(const Launcher& launch, const at::Tensor& grad_in, const at::Tensor& keys,
                                     const at::Tensor& order, const at::Tensor& offsets) {
  check_float(grad_in, "grad_out");
  TORCH_CHECK(grad_in.dim() == 5, "grad_out must be (B, C, Z, X, Y), got ", grad_in.sizes());
  const GridDims g{grad_in.size(0), grad_in.size(2), grad_in.size(3), grad_in.size(4)};
  const int64_t N = keys.numel(), C = grad_in.size(1), V = g.voxels();
  check_index(keys, "keys", N, grad_in);
  check_index(order, "order", N, grad_in);
  check_index(offsets, "offsets", V + 1, grad_in);
  // Voxel-major rows (one dense transpose), then a coalesced gather by key (order is not
  // needed: the CPU kernel walks the runs instead, to write rows without a table).
  auto G = grad_in.permute({0, 2, 3, 4, 1}).contiguous();
  auto k = keys.contiguous();
  auto grad_feats = at::empty({N, C}, grad_in.options());
  if (grad_feats.numel() == 0) return grad_feats;
  const Launch l = rows_launch(N);
  check_launch(l, "voxel_sum backward");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, G.scalar_type(), "voxel_sum_backward_cuda", [&] {
    launch(gather_rows_kernel<scalar_t>, l, G.data_ptr<scalar_t>(), k.data_ptr<int64_t>(),
           grad_feats.data_ptr<scalar_t>(), N, C, V);
  });
  return grad_feats;
}

template <typename Launcher>
std::tuple<at::Tensor, at::Tensor> bev_pool_backward_launch(const Launcher& launch, const at::Tensor& grad_in,
                                                            const at::Tensor& depth_in, const at::Tensor& feats_in,
                                                            const at::Tensor& keys, const at::Tensor& offsets) {
  const FrustumDims f = check_frustum(depth_in, feats_in);
  TORCH_CHECK(grad_in.dim() == 5 && grad_in.size(1) == f.C, "grad_out must be (B, C, Z, X, Y) with C=", f.C,
              ", got ", grad_in.sizes());
  TORCH_CHECK(grad_in.scalar_type() == feats_in.scalar_type(), "grad_out must have the dtype of feats");
  check_index(keys, "keys", f.points(), feats_in);
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
  const Launch l = rows_launch(pixels);
  check_launch(l, "bev_pool backward");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "bev_pool_backward_cuda", [&] {
    launch(bev_pool_backward_kernel<scalar_t>, l, G.data_ptr<scalar_t>(), depth.data_ptr<scalar_t>(),
           feats.data_ptr<scalar_t>(), k.data_ptr<int64_t>(), grad_depth.data_ptr<scalar_t>(),
           grad_feats.data_ptr<scalar_t>(), pixels, f.D, f.HW, f.C, V);
  });
  return {grad_depth, grad_feats};
}

}  // namespace kernels
}  // namespace bev
