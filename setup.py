"""Builds torch_ext and its C++ engine (csrc/) with torch.utils.cpp_extension and ninja.

MAX_JOBS sets ninja's parallelism (cpp_extension reads it); each translation unit
costs 20-50 s of the PyTorch headers on a 2-core machine, so csrc/ is split by
responsibility and ninja rebuilds only what changed.
"""

import glob
import json
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PIN = "2.13.0"
TRITON_REQUIREMENT = "triton==3.9.*; platform_system == 'Linux'"
# TorchRec's tests (tests/distributed/test_torchrec.py) and its dependencies, less the CUDA fbgemm-gpu its
# metadata asks for: torchrec itself is installed with --no-deps (README quickstart). fbgemm's compatibility
# table pairs fbgemm-gpu-cpu 1.8 with torch 2.13.
TORCHREC_DEPENDENCIES = [
    "fbgemm-gpu-cpu==1.8.0; platform_system == 'Linux'",
    "tensordict==0.15.3",
    "torchmetrics==1.0.3",
    "pyre-extensions==0.0.32",
    "iopath==0.1.10",
]
# Libraries whose programs the tests run on torch_ext's engine, each light and pure Python on CPU:
# Megatron-core's and DeepSpeed's synchronous MoE all_to_all (tests/distributed/test_sync_collectives.py,
# benchmarks/moe_sync; megatron-core 0.16.1 is the last release for Python 3.11; DeepSpeed builds no ops at
# install, and JIT-builds only a CPU comm op at its first init_distributed) and a Hugging Face training loop
# (tests/test_plan_cache.py).
CLIENT_LIBRARIES = ["megatron-core==0.16.1", "deepspeed==0.19.8", "transformers==5.24.0"]
# What torchtitan's Trainer imports beyond torchtitan itself (installed with --no-deps, README quickstart), for
# torch_ext.integrations.torchtitan's test. datasets 5.2: torchtitan 0.3.0 asks for <4.8, whose releases want
# huggingface_hub<2, older than transformers 5.24 needs; 5.2 takes hub 2.x, and torchtitan's trainer runs with it.
TORCHTITAN_TRAINER_DEPENDENCIES = ["torchdata==0.11.0", "tensorboard==2.21.0", "datasets==5.2.0"]
# The documentation (docs/, built by .ci/run with warnings as errors): Sphinx, and myst-parser for the guides in
# Markdown. Pinned together: myst-parser 5.2 supports Sphinx 8-9; both install on Python 3.11.
DOCS_REQUIREMENTS = ["sphinx==9.0.4", "myst-parser==5.2.0"]
# Lint, run by .ci/run: ruff (check and format; config in pyproject.toml) and clang-format (.clang-format). Pinned:
# a new release's rules or formatting would fail CI on code that did not change.
LINT_REQUIREMENTS = ["ruff==0.17.5", "clang-format==23.1.3"]
# benchmarks/ and its subpackages (harness/, the benchmarks that are packages).
BENCHMARK_PACKAGES = find_packages(where=HERE, include=["benchmarks", "benchmarks.*"])


class BuildWithInfo(BuildExtension):
    """Writes torch_ext/_build_info.json beside the extension: the torch it was compiled against.

    torch_ext/_loader.py compares it with the torch it finds at import time, so a mismatch fails
    with both versions named instead of an undefined-symbol error.
    """

    def run(self):
        super().run()
        targets = [os.path.join(HERE, "torch_ext")]
        if not self.inplace:
            targets.append(os.path.join(self.build_lib, "torch_ext"))
        for directory in targets:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "_build_info.json"), "w") as f:
                json.dump({"torch_version": torch.__version__}, f)
                f.write("\n")


setup(
    name="torch_ext",
    version="0.1.0",
    description="An autograd engine for PyTorch with control over backward order",
    packages=[
        *find_packages(include=["torch_ext", "torch_ext.*"]),
        # The Triton kernels, installed inside torch_ext: a top-level triton_kernels would clash with the package
        # of that name that PyPI's triton-kernels (Triton's own) installs. torch_ext/__init__.py gives a checkout
        # run in place the same name.
        "torch_ext._triton_kernels",
        # The benchmarks (benchmarks/: the registry, the harness, each benchmark), installed inside torch_ext as
        # torch_ext.benchmarks: `python -m torch_ext bench` (the README's main job, also the torch-ext console script)
        # runs them from a wheel too, each as `python -m torch_ext.benchmarks.<name>`, found through
        # benchmarks/registry.py. Without them a wheel's bench would have nothing to run.
        *(f"torch_ext.{package}" for package in BENCHMARK_PACKAGES),
    ],
    package_dir={
        "torch_ext._triton_kernels": "triton_kernels",
        **{f"torch_ext.{package}": package.replace(".", "/") for package in BENCHMARK_PACKAGES},
    },
    python_requires=">=3.10",
    install_requires=[f"torch=={TORCH_PIN}"],
    extras_require={
        # The GPU kernels of triton_kernels/ (torch_ext._triton_kernels); without triton the ops run their torch
        # references. Pinned to the minor version the kernels were tested with; it requires no other package (no
        # torch). Linux only: there are no other wheels.
        "triton": [TRITON_REQUIREMENT],
        # tests/triton/ runs the kernels on CPU through Triton's interpreter.
        "test": [
            "pytest",
            "hypothesis",
            TRITON_REQUIREMENT,
            "matplotlib",
            "tqdm",
            *TORCHREC_DEPENDENCIES,
            *CLIENT_LIBRARIES,
            *TORCHTITAN_TRAINER_DEPENDENCIES,
            # .ci/run builds the docs after the tests, from the README's install command, and lints.
            *DOCS_REQUIREMENTS,
            *LINT_REQUIREMENTS,
        ],
        "docs": DOCS_REQUIREMENTS,
        # `python -m torch_ext bench`: its plots and progress bar (without them it prints lines and no plots).
        "bench": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["torch-ext = torch_ext.__main__:main"]},
    ext_modules=[
        CppExtension(
            "torch_ext._C",
            # csrc/'s folders are its layers: collectives/ (collective roles and their cache), engine/ (the
            # engine core, its own layers in plan/, host/, run/ and split/), overlap/ (the microbatch overlap's
            # window and collective gate), bindings/ (Python and torch.library).
            # Headers are included by that path.
            sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)),
            include_dirs=[os.path.join(HERE, "csrc")],
            # TORCH_EXT_CXXFLAGS come after these, so they win, and TORCH_EXT_LDFLAGS go to the linker: a
            # sanitizer build (tools/sanitize.sh) sets "-fsanitize=address,undefined ... -g -O1" with them.
            # (CFLAGS reach the compiler too, but before -O2 -g0, losing the debug information.)
            extra_compile_args={"cxx": ["-O2", "-g0", *os.environ.get("TORCH_EXT_CXXFLAGS", "").split()]},
            extra_link_args=os.environ.get("TORCH_EXT_LDFLAGS", "").split(),
        )
    ],
    cmdclass={"build_ext": BuildWithInfo.with_options(use_ninja=True)},
)
