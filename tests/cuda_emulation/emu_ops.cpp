// The CUDA ops of bev.ops run on the CPU under the SIMT emulation (simt.h): the kernels of
// bev/ops/csrc/cuda/pool_kernels.cuh and the host side of pool_launchers.h, compiled unchanged
// from the source tree; only the launch policy differs from pool_cuda.cu. Registered as
// torch.ops.bev_simt.* (no Python binding code to compile); built and wrapped by
// tests/helpers/cuda_emulation.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <ATen/OpMathType.h>

#include "simt.h"  // after the torch headers: it defines CUDA's keywords

#include "cuda/pool_launchers.h"

namespace {

using namespace bev::kernels;

// Launch policy of pool_launchers.h: every block and thread of the launch, emulated.
struct EmulatedLaunch {
  template <typename... KernelArgs, typename... Args>
  void operator()(void (*kernel)(KernelArgs...), const Launch& l, Args... args) const {
    simt::launch(grid_dim(l), block_dim(l), [=] { kernel(args...); });
  }
};

at::Tensor voxel_sum(const at::Tensor& feats, const at::Tensor& keys, const at::Tensor& order,
                     const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  return voxel_sum_launch(EmulatedLaunch{}, feats, keys, order, offsets, grid_shape);
}

at::Tensor bev_pool(const at::Tensor& depth, const at::Tensor& feats, const at::Tensor& keys, const at::Tensor& order,
                    const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  return bev_pool_launch(EmulatedLaunch{}, depth, feats, keys, order, offsets, grid_shape);
}

at::Tensor voxel_sum_backward(const at::Tensor& grad_out, const at::Tensor& keys, const at::Tensor& order,
                              const at::Tensor& offsets) {
  return voxel_sum_backward_launch(EmulatedLaunch{}, grad_out, keys, order, offsets);
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward(const at::Tensor& grad_out, const at::Tensor& depth,
                                                     const at::Tensor& feats, const at::Tensor& keys,
                                                     const at::Tensor& offsets) {
  return bev_pool_backward_launch(EmulatedLaunch{}, grad_out, depth, feats, keys, offsets);
}

// A launch as (grid_x, grid_y, block_x, block_y, tiles_per_batch, shared_bytes, fits_one_launch).
std::vector<int64_t> as_list(const Launch& l) {
  return {l.grid_x, l.grid_y, l.block_x, l.block_y, l.tiles_per_batch, l.shared_bytes, fits_one_launch(l) ? 1 : 0};
}

// The launchers' geometry for a dtype ("float16", "bfloat16", "float32", "float64").
std::vector<int64_t> forward_launch_dims(int64_t B, int64_t S, int64_t C, c10::string_view dtype) {
  if (dtype == "float16") return as_list(forward_launch<at::Half>(B, S, C));
  if (dtype == "bfloat16") return as_list(forward_launch<at::BFloat16>(B, S, C));
  if (dtype == "float32") return as_list(forward_launch<float>(B, S, C));
  if (dtype == "float64") return as_list(forward_launch<double>(B, S, C));
  TORCH_CHECK(false, "unknown dtype ", dtype);
}

std::vector<int64_t> rows_launch_dims(int64_t rows) { return as_list(rows_launch(rows)); }

// (warp, tile_voxels, tile_channels, rows_per_block)
std::vector<int64_t> kernel_sizes() { return {kWarp, kTileVoxels, kTileChannels, kRowsPerBlock}; }

// A kernel that uses a shuffle in a partial warp: the emulation must refuse it, as a GPU
// gives undefined results.
void partial_warp_shuffle_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, float(threadIdx.x), 1);
}

// A kernel whose threads read shared memory written by other threads without a barrier
// (`base` differs per call, so values left in shared memory by an earlier call are wrong too).
void missing_barrier_kernel(float* out, float base) {
  __shared__ float values[64];
  values[threadIdx.x] = base + float(threadIdx.x);
  out[threadIdx.x] = values[blockDim.x - 1 - threadIdx.x];
}

at::Tensor run_test_kernel(c10::string_view name, int64_t threads, double base) {
  auto out = at::full({threads}, -1.0f);
  float* p = out.data_ptr<float>();
  const float b = float(base);
  if (name == "partial_warp_shuffle") simt::launch(dim3(1), dim3(unsigned(threads)), [=] { partial_warp_shuffle_kernel(p); });
  else if (name == "missing_barrier") simt::launch(dim3(1), dim3(unsigned(threads)), [=] { missing_barrier_kernel(p, b); });
  else TORCH_CHECK(false, "unknown test kernel ", name);
  return out;
}

}  // namespace

TORCH_LIBRARY(bev_simt, m) {
  m.def("voxel_sum", &voxel_sum);
  m.def("bev_pool", &bev_pool);
  m.def("voxel_sum_backward", &voxel_sum_backward);
  m.def("bev_pool_backward", &bev_pool_backward);
  m.def("forward_launch", &forward_launch_dims);
  m.def("rows_launch", &rows_launch_dims);
  m.def("frustum_feature_row", &frustum_feature_row);
  m.def("frustum_point", &frustum_point);
  m.def("grid_index", &grid_index);
  m.def("kernel_sizes", &kernel_sizes);
  m.def("run_test_kernel", &run_test_kernel);
}
