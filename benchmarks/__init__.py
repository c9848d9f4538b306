"""The benchmarks of torch_ext against stock PyTorch, which ``python -m torch_ext bench`` runs
(docs/benchmarks.md).

registry.py declares every benchmark bench runs and in what order; harness/ holds what they share. Each benchmark
is a module or a package of this one, run on its own as ``python -m benchmarks.<name> [--quick] [--out CSV]`` from
the checkout's top level; a wheel installs the package as ``torch_ext.benchmarks`` (``python -m
torch_ext.benchmarks.<name>``), so its modules import each other relatively.
"""
