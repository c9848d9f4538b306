"""torchtitan, one switch: with gradient accumulation, each microbatch's backward in ``Trainer.train_step`` runs on
torch_ext's backward thread while torchtitan runs the next microbatch's forward (the overlap of
:func:`torch_ext.overlap_microbatches`), torchtitan's step itself unchanged.

torchtitan builds its trainer from the config its ``config_registry`` function returns (``--module``, ``--config``):
``config.build()`` makes the class the config is nested in. The switch is such a class, :class:`OverlappedTrainer`,
a ``Trainer`` subclass whose config is ``Trainer.Config`` with one more field; a registry function returns its
config where it returned ``Trainer.Config``::

    import dataclasses

    from torch_ext.integrations.torchtitan import OverlappedTrainer

    def llama3_debugmodel_overlapped() -> OverlappedTrainer.Config:
        config = llama3_debugmodel()  # a Trainer.Config
        return OverlappedTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

Nothing of torchtitan's is replaced. The subclass overrides the two methods torchtitan's own trainers (Flux's,
torchft's, graph_trainer's) override: ``train_step``, to open an overlap window for the step, and
``forward_backward_step``, to run torchtitan's own for every microbatch, each inside the window's
:meth:`~torch_ext.MicrobatchOverlap.deferring` but the last, so that ``_forward_backward_body``'s ``loss.backward()``
is handed to the backward thread and returns at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torchtitan.trainer import Trainer

from torch_ext.microbatch_overlap import ForwardCollectives, MicrobatchOverlap, _checked_rule
from torch_ext.microbatch_overlap import overlap_microbatches as _open_window

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+

_API = "torch_ext.integrations.torchtitan.OverlappedTrainer"


class OverlappedTrainer(Trainer):
    """torchtitan's ``Trainer`` with each step's gradient-accumulation microbatches overlapped: microbatch i's
    backward runs on torch_ext's backward thread, on torch_ext's engine, while torchtitan runs microbatch i+1's
    forward. Every loss, gradient and parameter is the same as ``Trainer``'s, bit for bit.

    For each step with two or more gradient-accumulation steps:

    - every microbatch but the last runs torchtitan's ``forward_backward_step`` inside the window's ``deferring()``:
      its ``loss.backward()`` is handed over and returns at once, and torchtitan goes on to the next microbatch;
    - the last microbatch's forward runs beside the backward before it, and its ``loss.backward()`` runs on the
      caller's thread, as torchtitan runs it, once that backward has finished; the window closes after it, before
      torchtitan clips the gradients (``clip_grad_norm_`` reads them and communicates) and steps the optimizers. A
      handed-over backward's error is raised there, naming its microbatch.

    A step with one gradient-accumulation step runs as ``Trainer``'s. Raises ValueError, at the step, for a
    pipeline-parallel trainer (its schedule runs every microbatch's backward inside ``pp_schedule.step``, and sends
    each input gradient to the previous stage as soon as it returns) and for a forward-backward function torchtitan
    captured in a CUDA graph (``training.disable_cuda_graphs=False`` on CUDA: a replay cannot be handed over).

    Untested with FSDP (``data_parallel_shard_degree > 1`` applies ``fully_shard``, whose backward hooks
    reduce-scatter every microbatch's gradients): under ``overlap_forward_collectives="after_backward_collectives"``
    such a collective, which torch_ext's engine did not plan, is refused with a RuntimeError on every rank;
    ``"after_backward"`` lets it run, the next forward's collectives waiting for the whole backward.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        overlap_forward_collectives: ForwardCollectives = "after_backward_collectives"
        """:func:`torch_ext.overlap_microbatches`'s rule for when the next forward's collectives may start
        (``"beside_backward_collectives"`` on gloo for a model whose forward communicates first)."""

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            _checked_rule(self.overlap_forward_collectives, _API)

    config: Config

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """torchtitan's ``Trainer.train_step`` inside an overlap window for the step (none with one
        gradient-accumulation step); raises ValueError for what the class refuses."""
        if self.gradient_accumulation_steps < 2:
            return super().train_step(data_iterator)
        self._check_overlappable()
        step = _OverlappedStep(self.config.overlap_forward_collectives, self.gradient_accumulation_steps)
        self._overlapped_step = step
        try:
            with step:
                return super().train_step(data_iterator)
        finally:
            self._overlapped_step = None

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """torchtitan's ``Trainer.forward_backward_step`` for one microbatch: inside the window's ``deferring()``
        but for the step's last, after which the window closes."""
        step = getattr(self, "_overlapped_step", None)
        if step is None:
            # A call outside train_step (a subclass's, a test's): torchtitan's, unchanged.
            return super().forward_backward_step(**kwargs)
        return step.microbatch(lambda: super(OverlappedTrainer, self).forward_backward_step(**kwargs))

    def _check_overlappable(self) -> None:
        if self.parallel_dims.pp_enabled:
            raise ValueError(
                f"{_API}: pipeline parallelism runs every microbatch's backward inside its schedule, which sends each "
                "input gradient to the previous stage as soon as it returns: not supported"
            )
        if self.fwd_bwd_fn != self._forward_backward_body:
            raise ValueError(
                f"{_API}: the forward-backward function is not torchtitan's eager _forward_backward_body (captured in "
                "a CUDA graph?): a replayed backward cannot be handed over; set training.disable_cuda_graphs"
            )


class _OverlappedStep:
    """One ``train_step``'s window: opened at the step's first microbatch, each microbatch's backward deferred but
    the last's, closed once the last microbatch's ``forward_backward_step`` has returned."""

    def __init__(self, rule: ForwardCollectives, microbatches: int) -> None:
        self._rule = rule
        self._microbatches = microbatches
        self._started = 0
        self._window: MicrobatchOverlap | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # torchtitan raised before the last microbatch's end: wait for the backward in flight all the same.
        window, self._window = self._window, None
        if window is not None:
            window.__exit__(exc_type, exc, traceback)

    def microbatch(self, forward_backward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Runs ``forward_backward``, torchtitan's ``forward_backward_step`` for the step's next microbatch."""
        last = self._started + 1 == self._microbatches
        self._started += 1
        if self._window is None:
            # After torchtitan's all-reduce of the step's token count, before the first forward.
            self._window = _open_window(self._rule)
        with self._window.deferring(enabled=not last):
            loss = forward_backward()
        if last:
            # The last backward ran on this thread, after the one before it: nothing is in flight.
            window, self._window = self._window, None
            window.close()
        return loss
