// CUDA registrations of the bev voxel-pooling ops (schemas: csrc/ops.cpp). The kernels are in
// pool_kernels.cuh and their host side in pool_launchers.h, both shared with the SIMT
// emulation that runs the very same kernels in the CPU test suite; this file adds what only a
// GPU has: the device guard and launches on the current stream, checked.
//
// Kernels never synchronise with the host; the only data-dependent work (run lengths) is read
// on the device.
// Only the ATen headers used here (<ATen/ATen.h> is most of the build's compile time).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/pool_launchers.h"

namespace bev {
namespace {

using namespace kernels;

// Launch policy of pool_launchers.h: the current stream, and a launch-error check.
struct CudaLaunch {
  template <typename... KernelArgs, typename... Args>
  void operator()(void (*kernel)(KernelArgs...), const Launch& l, Args... args) const {
    kernel<<<grid_dim(l), block_dim(l), 0, at::cuda::getCurrentCUDAStream()>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

std::tuple<at::Tensor, at::Tensor> sort_keys_cuda(const at::Tensor& keys, int64_t num_voxels) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1, "keys must be a 1-D int64 tensor");
  const c10::cuda::CUDAGuard guard(keys.device());
  // Device radix sort (stable) + a fixed-size searchsorted: no host sync, deterministic.
  auto order = at::argsort(keys, /*stable=*/true);
  auto boundaries = at::arange(num_voxels + 1, keys.options());
  auto offsets = at::searchsorted(keys.index_select(0, order), boundaries);
  return {order, offsets};
}

at::Tensor voxel_sum_cuda(const at::Tensor& feats, const at::Tensor& keys, const at::Tensor& order,
                          const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  const c10::cuda::CUDAGuard guard(feats.device());
  return voxel_sum_launch(CudaLaunch{}, feats, keys, order, offsets, grid_shape);
}

at::Tensor bev_pool_cuda(const at::Tensor& depth, const at::Tensor& feats, const at::Tensor& keys,
                         const at::Tensor& order, const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  const c10::cuda::CUDAGuard guard(feats.device());
  return bev_pool_launch(CudaLaunch{}, depth, feats, keys, order, offsets, grid_shape);
}

at::Tensor voxel_sum_backward_cuda(const at::Tensor& grad_out, const at::Tensor& keys, const at::Tensor& order,
                                  const at::Tensor& offsets) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return voxel_sum_backward_launch(CudaLaunch{}, grad_out, keys, order, offsets);
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cuda(const at::Tensor& grad_out, const at::Tensor& depth,
                                                          const at::Tensor& feats, const at::Tensor& keys,
                                                          const at::Tensor& offsets) {
  const c10::cuda::CUDAGuard guard(feats.device());
  return bev_pool_backward_launch(CudaLaunch{}, grad_out, depth, feats, keys, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(bev, CUDA, m) {
  m.impl("voxel_sum", &voxel_sum_cuda);
  m.impl("bev_pool", &bev_pool_cuda);
  m.impl("_sort_keys", &sort_keys_cuda);
  m.impl("_voxel_sum_backward", &voxel_sum_backward_cuda);
  m.impl("_bev_pool_backward", &bev_pool_backward_cuda);
}

}  // namespace bev
