"""What importing torch_ext replaces in torch, checked: nothing but the two DDP methods the lanes' group check
wraps (docs/guides/switching-on.md, "What importing torch_ext changes").

A lane refuses a process group that DDP or FSDP also uses in backward (torch_ext/collectives/lanes.py). It scans
live objects for them once per group, and again after one is made: so DDP's constructor and its
``register_comm_hook`` are wrapped at import, and FSDP's two constructors at a lane's first use after
``torch.distributed.fsdp`` was imported (importing it at torch_ext's import would cost ~1.7 s). Everything else
torch_ext installs (its engine, the RNG getters of an overlap window, pipelining's patches) it installs when asked
and undoes.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Run in a fresh interpreter: the attributes of these modules and of their torch classes, by identity, before and
# after `import torch_ext`. torch._dynamo is imported first: torch_ext imports it, and it replaces torch.manual_seed.
SNAPSHOT = r"""
import importlib, json
import torch, torch._dynamo

MODULES = (
    "torch", "torch.autograd", "torch.autograd.graph", "torch.autograd.function", "torch.autograd.variable",
    "torch.nn.parallel", "torch.nn.parallel.distributed", "torch.distributed", "torch.distributed.distributed_c10d",
    "torch.utils.checkpoint", "torch.random",
)

def snapshot():
    seen = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attribute, value in list(vars(module).items()):
            seen[f"{name}.{attribute}"] = id(value)
            if isinstance(value, type) and str(getattr(value, "__module__", "")).startswith("torch"):
                for member, member_value in list(vars(value).items()):
                    seen[f"{name}.{attribute}.{member}"] = id(member_value)
    return seen

before = snapshot()
import torch_ext
after = snapshot()
print(json.dumps(sorted(name for name, identity in before.items() if after.get(name) != identity)))
"""

EXPECTED = [
    "torch.nn.parallel.DistributedDataParallel.__init__",
    "torch.nn.parallel.DistributedDataParallel.register_comm_hook",
    "torch.nn.parallel.distributed.DistributedDataParallel.__init__",
    "torch.nn.parallel.distributed.DistributedDataParallel.register_comm_hook",
]


def test_importing_torch_ext_replaces_only_ddps_two_methods():
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SNAPSHOT], capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == EXPECTED


def test_the_wrapped_methods_keep_their_names_and_documents():
    import torch

    import torch_ext  # noqa: F401 - the import is what is tested

    for method in ("__init__", "register_comm_hook"):
        wrapped = getattr(torch.nn.parallel.DistributedDataParallel, method)
        assert wrapped.__name__ == method
        assert wrapped.__wrapped__.__doc__ == wrapped.__doc__
