"""Builds torch_ext and its C++ engine (csrc/) with torch.utils.cpp_extension and ninja.

MAX_JOBS sets ninja's parallelism (cpp_extension reads it); each translation unit
costs 20-50 s of the PyTorch headers on a 2-core machine, so csrc/ is split by
responsibility and ninja rebuilds only what changed.
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PIN = "2.13.0"


class BuildWithInfo(BuildExtension):
    """Writes torch_ext/_build_info.py beside the extension: the torch it was compiled against.

    torch_ext/__init__.py compares it with the torch it finds at import time, so a mismatch fails
    with both versions named instead of an undefined-symbol error.
    """

    def run(self):
        info_path = os.path.join(HERE, "torch_ext", "_build_info.py")
        with open(info_path, "w") as f:
            f.write("# Written by setup.py at build time.\n")
            f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        super().run()


setup(
    name="torch_ext",
    version="0.1.0",
    description="An autograd engine for PyTorch with control over backward order",
    packages=find_packages(include=["torch_ext", "torch_ext.*", "triton_kernels", "triton_kernels.*"]),
    python_requires=">=3.10",
    install_requires=[f"torch=={TORCH_PIN}"],
    extras_require={"test": ["pytest", "hypothesis"]},
    ext_modules=[
        CppExtension(
            "torch_ext._C",
            sorted(glob.glob(os.path.join("csrc", "*.cpp"))),
            extra_compile_args={"cxx": ["-O2", "-g0"]},
        )
    ],
    cmdclass={"build_ext": BuildWithInfo.with_options(use_ninja=True)},
)
