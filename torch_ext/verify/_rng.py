"""The random number generators verify snapshots: both runs must draw the same numbers (dropout, a batch drawn
from the global generators), and the caller's generators must be as they were when verify returns.

Kept apart from the snapshot of tensors (``_snapshot``) because which generators exist depends on what the process
has initialized (CUDA) or imported (NumPy), which this module alone has to know about.
"""

from __future__ import annotations

import dataclasses
import random
import sys

import torch


@dataclasses.dataclass
class _RngState:
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: tuple
    numpy: tuple | None

    @classmethod
    def capture(cls) -> _RngState:
        numpy = sys.modules.get("numpy")
        return cls(
            cpu=torch.get_rng_state(),
            # Only once initialized: reading CUDA's generators would initialize it.
            cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            python=random.getstate(),
            numpy=numpy.random.get_state() if numpy is not None else None,
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
