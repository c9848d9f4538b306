"""Deprecated: the collective order check moved to ``torch_ext.collectives.order_check``
(:func:`torch_ext.check_collective_order`, :func:`torch_ext.collective_check_count`).

This path still imports, and warns, for one release.
"""

import sys

from torch_ext._api import warn_deprecated
from torch_ext.collectives import order_check

warn_deprecated(
    "torch_ext.collective_check",
    "torch_ext.collectives.order_check",
    ", or torch_ext.check_collective_order and torch_ext.collective_check_count",
)
# The old path is the module itself, not a copy of its names: its private names (the checker in use among them)
# are the ones the engine calls.
sys.modules[__name__] = order_check
