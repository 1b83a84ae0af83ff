// Shared argument checks for the CPU and CUDA kernels of the bev voxel-pooling operators.
#pragma once

#include <ATen/core/Tensor.h>

namespace bev {

struct GridDims {
  int64_t B, Z, X, Y;
  int64_t per_batch() const { return Z * X * Y; }  // S: voxels of one sample
  int64_t voxels() const { return B * Z * X * Y; }  // V
};

inline GridDims check_grid(at::IntArrayRef grid_shape) {
  TORCH_CHECK(grid_shape.size() == 4, "grid_shape must be (B, Z, X, Y), got ", grid_shape);
  for (auto s : grid_shape) TORCH_CHECK(s > 0, "grid_shape sizes must be positive, got ", grid_shape);
  return {grid_shape[0], grid_shape[1], grid_shape[2], grid_shape[3]};
}

inline void check_index(const at::Tensor& t, const char* name, int64_t numel, const at::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == numel, name, " must have shape (", numel, "), got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but the features are on ", like.device());
}

inline void check_float(const at::Tensor& t, const char* name) {
  auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16, name,
              " must be float16/bfloat16/float32/float64, got ", s);
}

// Geometry of a fused bev_pool call: point p = ((b*Nc + n)*D + d)*HW + hw reads depth[p] and
// the feature row (b*Nc + n)*HW + hw.
struct FrustumDims {
  int64_t BN, D, HW, C;
  int64_t points() const { return BN * D * HW; }
  int64_t pixels() const { return BN * HW; }
};

inline FrustumDims check_frustum(const at::Tensor& depth, const at::Tensor& feats) {
  check_float(depth, "depth");
  TORCH_CHECK(depth.scalar_type() == feats.scalar_type(), "depth and feats must have the same dtype");
  TORCH_CHECK(depth.dim() == 5, "depth must be (B, Nc, D, H, W), got ", depth.sizes());
  TORCH_CHECK(feats.dim() == 5 && feats.size(0) == depth.size(0) && feats.size(1) == depth.size(1) &&
                  feats.size(2) == depth.size(3) && feats.size(3) == depth.size(4),
              "feats must be (B, Nc, H, W, C) matching depth ", depth.sizes(), ", got ", feats.sizes());
  TORCH_CHECK(depth.device() == feats.device(), "depth and feats must be on the same device");
  return {depth.size(0) * depth.size(1), depth.size(2), depth.size(3) * depth.size(4), feats.size(4)};
}

}  // namespace bev
