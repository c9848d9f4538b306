"""The conventions of torch_ext's public API.

Names follow PyTorch's: a process-wide on/off setting is ``is_<x>_enabled()`` and ``set_<x>_enabled(bool)``
(``torch.is_grad_enabled``/``torch.set_grad_enabled``), any other setting ``get_<x>()`` and ``set_<x>(value)``
(``torch.get_default_dtype``/``torch.set_default_dtype``), and a predicate ``is_<x>()``. A setter applies at
once and returns a :class:`Undo`, so that ``with torch_ext.set_<x>(...):`` limits it to a block, as
``torch.set_grad_enabled`` does.
"""

from __future__ import annotations

from collections.abc import Callable


class Undo:
    """What a torch_ext setter returns. The setting is already made; used as a context manager, the block's end
    undoes it (restores the setting from before the call)::

        torch_ext.set_auto_collective_priority_enabled(False)  # from now on
        with torch_ext.set_auto_collective_priority_enabled(False):  # in this block only
            ...
    """

    __slots__ = ("_undo", "_what")

    def __init__(self, what: str, undo: Callable[[], object]) -> None:
        # what: the call, as in "enable()", for the repr.
        self._what = what
        self._undo = undo

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        self._undo()

    def __repr__(self) -> str:
        return f"<torch_ext.{self._what}: done; as a context manager, undone at the block's end>"
