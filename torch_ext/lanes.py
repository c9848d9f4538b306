"""Deprecated: collective lanes moved to ``torch_ext.collectives.lanes`` (:func:`torch_ext.run_in_lane`).

This path still imports, and warns, for one release.
"""

import sys

from torch_ext._api import warn_deprecated
from torch_ext.collectives import lanes

warn_deprecated("torch_ext.lanes", "torch_ext.collectives.lanes", ", or torch_ext.run_in_lane")
# The old path is the module itself, not a copy of its names: its private names, and any monkeypatch of them,
# are the ones the engine's lane group resolver reads.
sys.modules[__name__] = lanes
