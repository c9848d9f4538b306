import os
import sys

import pytest
import torch

try:
    import torch_ext  # noqa: F401 - installed with `pip install --no-build-isolation -e .`
except ImportError:
    # Not installed: use the checkout this conftest lives in (built in place).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def seed_torch():
    torch.manual_seed(0)
