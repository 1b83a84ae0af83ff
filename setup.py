"""Builds the native voxel-pooling extension `bev.ops._C`.

CPU kernels always; CUDA kernels too when nvcc and a CUDA build of torch are present
(set BEV_FORCE_CPU=1 to skip them). Without a compiler the package still installs and
bev.ops falls back to the pure-torch reference with one warning.
"""

import glob
import os
import shutil

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("BEV_NO_EXTENSION") != "1":
    import torch
    from torch.utils import cpp_extension

    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join("bev", "ops", "csrc")  # schemas in ops.cpp, kernels per device in cpu/ and cuda/

    def sources(pattern):
        return sorted(glob.glob(os.path.join(csrc, "**", pattern), recursive=True))

    cpp, cu = sources("*.cpp"), sources("*.cu")
    headers = sources("*.h") + sources("*.cuh")
    include_dirs = [os.path.join(here, csrc)]
    with_cuda = (
        bool(cu)
        and os.environ.get("BEV_FORCE_CPU") != "1"
        and torch.version.cuda is not None
        and (cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None)
    )
    # No -std flag: each torch version adds the standard its headers need (C++17 or C++20).
    cxx = ["-O3", "-fopenmp"]
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "bev.ops._C",
            cpp + cu,
            define_macros=[("BEV_WITH_CUDA", None)],
            depends=headers,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=["-fopenmp"],
        )
    elif cpp:
        ext = cpp_extension.CppExtension(
            "bev.ops._C",
            cpp,
            depends=headers,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = None
    if ext is not None:
        ext_modules = [ext]
        cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
