"""Triton kernels for torch_ext's GPU hot path, apart from their op registrations (torch_ext/kernels.py).

Each ``<name>.py`` holds ``@triton.jit`` kernels and their launchers and needs triton; each ``<name>_ref.py``
holds the plain-torch references, needs only torch, and is what the ops run on CPU.
"""
