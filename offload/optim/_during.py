"""``update_during_backward()``, the facade's mixin: the block in which a backward updates
each shard as its gradients are final (``_early``'s ``EarlyUpdate`` does the work), and
how an update under way is dropped."""

from __future__ import annotations

import contextlib

from ._early import EarlyUpdate, refuse_to_start
from ._phase import OptimizerPhase

__all__ = ["BackwardUpdates"]


class BackwardUpdates:
    @contextlib.contextmanager
    def update_during_backward(self):
        """Within this block, a ``backward()`` updates each shard of a wrapped model's
        parameters as soon as their gradients are final, overlapping the optimizer's reads,
        update and write-backs with the rest of the backward pass; ``step()`` afterwards
        updates what is left (plain parameters, parameters that got no gradient in that
        pass) and ends the step::

            with opt.update_during_backward():
                loss.backward()
            opt.step()
            opt.zero_grad()

        The result equals ``backward(); step()`` exactly, under these rules (each checked):

        * the backward inside the block is the last of its step: earlier micro-batches of a
          gradient accumulation run outside it, and no other backward may come before
          ``step()``;
        * no gradient clipping (``clip_grad_norm_`` needs every gradient before the first
          update; it raises after this block) and no fp16 loss scaling (an overflow would
          have to skip the whole step): with either, the default update in the next forward
          overlaps the same work exactly;
        * each parameter receives its gradient once in that pass (true of a parameter used
          several times in one graph, and of activation checkpointing; a reentrant backward
          that reports a parameter twice raises, and the optimizer then refuses to step
          until a checkpoint or state dict is loaded);
        * the groups' settings (learning rate ...) are those the backward updated its first
          shard with: a change before ``step()`` raises ``SettingsChangedError`` there, the
          step taken with them.
        """
        self._settle()
        refuse_to_start(loss_scaling=self._scaler.enabled, clipped=self._clipped, shards=self._book.shards)
        self._sink.sync()
        self._phase.refuse_if_poisoned()
        if self._early is not None:
            raise RuntimeError("update_during_backward() was already used in this step: call step() "
                               "before the next one")
        self._ensure_layout()
        self._book.check_rows(type(self).__name__, self.param_groups)
        early = EarlyUpdate(self._book.shards, self._pipeline, self._writeback, self._phase, self.param_groups)
        self._phase.enter(OptimizerPhase.UPDATING_IN_BACKWARD)
        self._sink.listener = early
        try:
            yield self
        except BaseException:
            # the backward failed or was interrupted: nothing of it may be applied later
            self._drop_early()
            raise

    @property
    def _early(self) -> EarlyUpdate | None:
        """The update during backward under way, from its block to the step that ends it
        (the gradient sink's listener meanwhile)."""
        return self._sink.listener

    def _drop_early(self) -> None:
        """Abandon an update during backward (poisoned where a shard was updated)."""
        early, self._sink.listener = self._early, None
        try:
            if early is not None:
                early.abandon()
        finally:
            if self._phase.value is OptimizerPhase.UPDATING_IN_BACKWARD:
                self._phase.enter(OptimizerPhase.IDLE)
