"""``torch_ext.debug``: questions about what torch_ext does in this process, for debugging it and for tests.

None of them changes what a backward computes or the order it runs in:

- :func:`execution_order`: the nodes a backward would run, in torch_ext's order, without running them.
- :func:`is_current_node_supported`: which path sets the current autograd node while a node runs.
- :func:`collective_check_count`: how many exchanges the collective order check
  (:func:`torch_ext.check_collective_order`) has made.

Each is defined beside what it asks about (``torch_ext.order``, ``torch_ext.current_node``,
``torch_ext.collectives.order_check``); this is their one public name.
"""

from torch_ext.collectives.order_check import collective_check_count
from torch_ext.current_node import is_current_node_supported
from torch_ext.order import execution_order

__all__ = ["collective_check_count", "execution_order", "is_current_node_supported"]
