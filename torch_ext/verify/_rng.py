"""The random number generators verify snapshots: both runs must draw the same numbers (dropout, a batch drawn
from the global generators), and the caller's generators must be as they were when verify returns.

Kept apart from the snapshot of tensors (``_snapshot``) because which generators exist depends on what the process
has initialized (the accelerator: CUDA or another) or imported (NumPy), which this module alone has to know about.
"""

from __future__ import annotations

import dataclasses
import random
import sys

import torch


@dataclasses.dataclass
class _RngState:
    cpu: torch.Tensor
    # The accelerator's type and its generators' states, one a device.
    accelerator: tuple[str, list[torch.Tensor]] | None
    python: tuple
    numpy: tuple | None

    @classmethod
    def capture(cls) -> _RngState:
        numpy = sys.modules.get("numpy")
        return cls(
            cpu=torch.get_rng_state(),
            accelerator=_accelerator_rng_states(),
            python=random.getstate(),
            numpy=numpy.random.get_state() if numpy is not None else None,
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            device_type, states = self.accelerator
            torch.get_device_module(device_type).set_rng_state_all(states)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


def _accelerator_rng_states() -> tuple[str, list[torch.Tensor]] | None:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return None
    device_module = torch.get_device_module(accelerator)
    # Only once initialized: reading the generators would initialize the device (CUDA's context).
    if hasattr(device_module, "is_initialized") and not device_module.is_initialized():
        return None
    return accelerator.type, device_module.get_rng_state_all()
