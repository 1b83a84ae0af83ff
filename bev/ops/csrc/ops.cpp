// Operator schemas of the bev voxel-pooling ops: the one place they are declared.
// Kernels are registered per device: csrc/cpu/pool_cpu.cpp (CPU), csrc/cuda/pool_cuda.cu (CUDA);
// autograd and fake (meta) kernels in bev/ops/_native.py. Names with a leading underscore are
// internal steps (plan construction, backward passes), not public API.
#include <torch/extension.h>

TORCH_LIBRARY(bev, m) {
  m.def("voxel_sum(Tensor feats, Tensor keys, Tensor order, Tensor offsets, int[] grid_shape) -> Tensor");
  m.def("bev_pool(Tensor depth, Tensor feats, Tensor keys, Tensor order, Tensor offsets, int[] grid_shape) -> Tensor");
  m.def("_voxel_keys(Tensor coords, int[] grid_shape, bool batch_column) -> Tensor");
  m.def("_sort_keys(Tensor keys, int num_voxels) -> (Tensor order, Tensor offsets)");
  m.def("_voxel_sum_backward(Tensor grad_out, Tensor keys, Tensor order, Tensor offsets) -> Tensor");
  m.def("_bev_pool_backward(Tensor grad_out, Tensor depth, Tensor feats, Tensor keys, Tensor offsets) -> (Tensor, Tensor)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Native kernels of bev.ops (operators are registered under torch.ops.bev)";
  module.def("cuda_built", [] {
#ifdef BEV_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
