"""Which microbatch's backward this thread runs for :func:`torch_ext.overlap_microbatches`.

State below both of its readers: the overlap (``torch_ext.microbatch_overlap``) sets it on its backward thread, and
the collective order check (``torch_ext.collectives.order_check``) compares it across ranks, so that neither
imports the other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_handed = threading.local()


def handed_backward() -> tuple[int, str] | None:
    """The backward this thread runs for an overlap, as ``(microbatch, the rule for the next forward's collectives)``
    (a ``forward_collectives`` value); None on any other thread."""
    return getattr(_handed, "backward", None)


@contextlib.contextmanager
def handing(microbatch: int, rule: str) -> Iterator[None]:
    """This thread runs microbatch ``microbatch``'s backward, the next forward's collectives starting by ``rule``."""
    _handed.backward = (microbatch, rule)
    try:
        yield
    finally:
        _handed.backward = None
