// Operator schemas of the bev ops (voxel pooling; the synthetic world's ray caster and LiDAR): the one place they
// are declared. Kernels are registered per device: csrc/cpu/pool_cpu.cpp, csrc/cpu/raycast_cpu.cpp and
// csrc/cpu/lidar_cpu.cpp (CPU), csrc/cuda/pool_cuda.cu (CUDA); autograd and fake (meta) kernels in
// bev/ops/_native.py. Names with a leading underscore are internal steps (plan construction, backward passes, the
// ray caster, the LiDAR's cloud), not public API.
//
// The Python module bev.ops._C is written with the plain C API, not pybind11 or
// <torch/extension.h>: it only has to load (registering the ops) and say whether the CUDA kernels
// were built, and those headers would more than double the extension's compile time.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(bev, m) {
  m.def("voxel_sum(Tensor feats, Tensor keys, Tensor order, Tensor offsets, int[] grid_shape) -> Tensor");
  m.def("bev_pool(Tensor depth, Tensor feats, Tensor keys, Tensor order, Tensor offsets, int[] grid_shape) -> Tensor");
  m.def("_voxel_keys(Tensor coords, int[] grid_shape, bool batch_column) -> Tensor");
  m.def("_sort_keys(Tensor keys, int num_voxels) -> (Tensor order, Tensor offsets)");
  m.def("_voxel_sum_backward(Tensor grad_out, Tensor keys, Tensor order, Tensor offsets) -> Tensor");
  m.def("_bev_pool_backward(Tensor grad_out, Tensor depth, Tensor feats, Tensor keys, Tensor offsets) -> (Tensor, Tensor)");
  // The synthetic world's ray caster (CPU only; kernel csrc/cpu/raycast_cpu.cpp, wrapper bev/synthetic/native.py).
  m.def(
      "_raycast_zbuffer(Tensor rays, Tensor parts, Tensor rects, Tensor ground_key, Tensor group, int num_groups, "
      "bool faces) -> (Tensor key, Tensor face, Tensor coverage)");
  m.def(
      "_raycast_shade(Tensor key, Tensor face, Tensor rays, Tensor parts, Tensor origin, Tensor half, Tensor glass, "
      "Tensor colours, Tensor label, Tensor(a!) image, Tensor(b!) depth, Tensor(c!) ids) -> ()");
  m.def(
      "_raycast_rects(Tensor corners, Tensor rotation, Tensor translation, Tensor intrinsic, Tensor post_rot, "
      "Tensor post_tran, int H, int W, float near) -> Tensor");
  m.def(
      "_raycast_ground(Tensor gx, Tensor gy, Tensor pixels, Tensor clear, Tensor fog, Tensor texels, Tensor grass, "
      "Tensor(a!) image, float e0, float e1, float c, float s, float scale, float unit, int col0, int row0, int size, "
      "int side) -> ()");
  m.def("_raycast_rgb8(Tensor image) -> Tensor");
  // The synthetic LiDAR's point cloud (CPU only; kernels csrc/cpu/lidar_cpu.cpp, wrappers bev/synthetic/native.py).
  m.def("_lidar_returns(Tensor depth, Tensor rays, Tensor origin, Tensor jitter) -> (Tensor points, Tensor beam)");
  m.def("_lidar_off_faces(Tensor(a!) points, Tensor centre, Tensor R, Tensor half, Tensor reach) -> ()");
  m.def(
      "_lidar_cloud(Tensor points, Tensor value, Tensor ring, Tensor rotation, Tensor translation) -> "
      "(Tensor cloud, Tensor ego)");
  m.def("_lidar_count(Tensor points, Tensor centre, Tensor R, Tensor half, Tensor reach) -> Tensor");
  m.def(
      "_lidar_intensity(Tensor points, Tensor part, Tensor part_value, Tensor spread, Tensor ground_value, "
      "Tensor labels, float e0, float e1, float m00, float m01, float m10, float m11, float scale, int col0, "
      "int row0, int size, int side) -> Tensor");
}

namespace {

PyObject* cuda_built(PyObject*, PyObject*) {
#ifdef BEV_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef methods[] = {
    {"cuda_built", cuda_built, METH_NOARGS, "Whether the CUDA kernels were compiled into this build."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_C", "Native kernels of bev.ops (operators are registered under torch.ops.bev)",
    -1, methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
