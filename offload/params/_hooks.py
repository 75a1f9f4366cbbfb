"""Hooks: translate module events into coordinator calls. Nothing else lives here.

forward pre-hook    acquire the module's groups
forward post-hook   release them; on outputs that need a gradient, a hook that acquires
                    them again when backward reaches the module
post-backward       post-hooks on the nodes the module's forward made release them once
                    backward has run them (_backward_end: no node added to the graph);
                    what they cannot see (inputs without gradients) is released at the end
                    of backward

Note: saved tensors. Autograd keeps what an operation saved for backward: the parameter
itself (``layer_norm``, a parent's ``w @ x``) or a view of its data (``weight.t()`` for a
linear layer). Between forward and backward its group's buffer is released and reused for
another group. While a managed forward (or a demand call) runs, ``saved_tensors_hooks``
replace a managed parameter, and any saved tensor that lives in a materialized group
buffer, by a reference (group, byte offset, shape, strides, the group's write count) and
rebuild the view from the group's buffer of the moment when backward unpacks it. A group
written in place since the forward is refused there, as torch refuses a modified saved
tensor; so is a second-order backward (``create_graph=True``), which would record the
rebuilt views, not the parameters, in its graph. A module's output that is a view of its
group's buffer is replaced by a copy before the group is released.

Note: interrupted passes. A KeyboardInterrupt (any BaseException) skips torch's
``always_call`` hooks, so a forward stopped by Ctrl-C never releases what it acquired, and a
backward stopped by it never runs its end-of-backward callback. The next root forward
notices and drops what they held: a forward still open at the same or a deeper call depth
cannot be enclosing this one (a nested call is always deeper), and an end-of-backward
queued by a graph task that is not running any more will never run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..activations import ActivationOffloader, KeptTensor, SavedHandle, kept
from .._autograd import graph_task, in_backward, queue_end_of_backward
from ._coordinator import Coordinator
from ._demand import owner_of_param, refuse_copy
from ._backward_end import BackwardEnd, input_edges
from ._eager import EagerForwards
from ._transforms import NO_STORAGE_SAVED, refuse_func_transforms, storage_address
from ._groups import ParamGroup

__all__ = ["ModuleHooks"]


@dataclass(frozen=True)
class _SavedRef:
    """A saved tensor that lives in a group's buffer: rebuilt from the buffer of the moment."""

    group: ParamGroup
    dtype: torch.dtype
    offset: int  # bytes from the start of the group's flat buffer
    shape: torch.Size
    stride: tuple[int, ...]
    version: int  # the group's write count when saved


class ModuleHooks:
    def __init__(self, model: nn.Module, needs: dict[nn.Module, list[ParamGroup]],
                 coordinator: Coordinator):
        self.model, self.needs, self.coordinator = model, needs, coordinator
        self._handles: list[Any] = []
        self._eager = EagerForwards()  # (torch.compile runs what offload manages uncompiled)
        self._saved_hooks: list[Any] = []
        self._open_forwards: list[tuple[int, bool]] = []  # (call depth, pushed saved hooks)
        self._calls: list[tuple[list, Any]] = []  # modules running with grad: (groups, input_edges() or None)
        self._backward_queued = False
        self._backward_task: int | None = None
        # groups fetched in backward for an op whose module's hooks did not fetch them (a
        # parent used a child's weight): held while the autograd node that needs them runs
        self._node_holds: list[tuple[Any, ParamGroup]] = []
        # saved activations past their budget go here (OffloadConfig.activation_tier); None: stay
        self.activations: ActivationOffloader | None = None
        coordinator.on_park = self._queue_end_of_backward

    # -- attach / remove -----------------------------------------------------------------------
    def attach(self) -> None:
        root, eager = self.model, self._eager
        self._handles.append(root.register_forward_pre_hook(eager.hook(self._root_pre), prepend=True))
        self._handles.append(root.register_forward_hook(eager.hook(self._root_post), always_call=True))
        eager.make_eager(root, root=True)
        for module, groups in self.needs.items():
            if all(g.resident for g in groups):
                continue
            managed = [g for g in groups if not g.resident]
            self._handles.append(module.register_forward_pre_hook(eager.hook(
                lambda m, args, kwargs, gs=managed: self._pre_forward(gs, args, kwargs)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(eager.hook(
                lambda m, args, out, gs=managed: self._post_forward(gs, out)), always_call=True))
            if module is not root:
                eager.make_eager(module)

    def __deepcopy__(self, memo):
        refuse_copy()

    def __reduce_ex__(self, protocol):
        refuse_copy()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._eager.restore()
        while self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        self._open_forwards.clear()
        self._calls.clear()
        self._node_holds.clear()

    def forward_open(self) -> bool:
        """Whether a forward of the model is running."""
        return bool(self._open_forwards)

    def saving(self) -> Any:
        """Saved tensors of what runs in this block go through this model's references."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- root: pass boundaries and saved tensors -------------------------------------------------
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        refuse_func_transforms()
        depth = _call_depth()
        self._drop_interrupted(depth)
        grad = torch.is_grad_enabled()
        self.coordinator.begin_pass("grad" if grad else "nograd")
        if self.activations is not None:  # (a no-grad pass works off what earlier graphs released)
            if grad:
                self.activations.begin_forward(self._model_storages())
            else:
                self.activations.settle()
        if grad:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._saved_hooks.append(ctx)
        self._open_forwards.append((depth, grad))

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open_forwards:
            _, pushed = self._open_forwards.pop()
            if pushed and self._saved_hooks:
                self._saved_hooks.pop().__exit__(None, None, None)
            if pushed and self.activations is not None and not self._open_forwards:
                self.activations.end_forward()
        if not torch.is_grad_enabled():
            self.coordinator.end_pass()

    def _model_storages(self) -> set[int]:
        """Addresses of the model's own tensors (unmanaged parameters, buffers): saved views of
        them are not activations."""
        with torch._C.DisableTorchFunctionSubclass():
            return {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())
                    if t.device.type != "meta"}

    def _drop_interrupted(self, depth: int) -> None:
        """Release what a forward or backward stopped by a BaseException still holds."""
        dropped = False
        while self._open_forwards and self._open_forwards[-1][0] >= depth:
            _, pushed = self._open_forwards.pop()
            if pushed and self._saved_hooks:
                self._saved_hooks.pop().__exit__(None, None, None)
            dropped = True
        if dropped and not self._open_forwards:
            self._calls.clear()
            self.coordinator.abandon_forward()
        if self._backward_queued and graph_task() != self._backward_task:
            self._backward_queued = False
            self._release_backward()
            self.coordinator.abandon_pass()

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter):  # a managed one is saved as its slot of the group
            owner = owner_of_param(tensor)
            if owner is None or owner.group.resident or owner.access.coordinator is not self.coordinator:
                return kept(tensor)
            slot = owner.slot
            return _SavedRef(owner.group, slot.dtype, slot.offset, slot.shape, _contiguous(slot.shape),
                             self.coordinator.written_version(owner.group))
        with torch._C.DisableTorchFunctionSubclass():
            if tensor.device.type == "meta":
                return tensor
            if tensor.layout is not torch.strided:
                # (a sparse tensor has no one storage to look at; its values may view a group
                # that is gone by the backward, as PEFT's SHiRA builds one from a parameter:
                # kept as a copy of its own, in memory)
                return kept(tensor.detach().clone())
            ptr = storage_address(tensor)
            if ptr is None:
                raise RuntimeError(NO_STORAGE_SAVED)
            group = self.coordinator.by_storage.get(ptr)
            if group is None:  # (detached: a saved output held as itself would keep its node alive)
                return kept(tensor.detach()) if self.activations is None else self.activations.pack(tensor)
            flat = self.coordinator.flat_of(group)
            offset = tensor.storage_offset() * tensor.element_size() - flat.storage_offset()
            return _SavedRef(group, tensor.dtype, offset, tensor.shape, tensor.stride(),
                             self.coordinator.written_version(group))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, KeptTensor):
            return packed.get()
        if isinstance(packed, SavedHandle):
            return packed.owner.unpack(packed)
        if not isinstance(packed, _SavedRef):
            return packed
        self._check_unpack(packed)
        if not in_backward():  # read outside backward (grad_fn._saved_*): a copy, fetched for it
            self.coordinator.acquire(packed.group, "demand", record=False)
            try:
                return _rebuild(packed, self.coordinator.flat_of(packed.group)).clone()
            finally:
                self.coordinator.release(packed.group, "demand")
        if self.coordinator.flat_of(packed.group) is None:  # backward reached an op before its module's hook: fetch now
            self._release_node_holds()
            self.coordinator.acquire(packed.group, "backward")
            self._queue_end_of_backward()
            self._node_holds.append((torch._C._current_autograd_node(), packed.group))
        return _rebuild(packed, self.coordinator.flat_of(packed.group))

    def _check_unpack(self, packed: _SavedRef) -> None:
        if self.coordinator.written_version(packed.group) != packed.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: parameter group {packed.group.key!r} was written after the forward that saved "
                "it (offload keeps its newest bytes only). Write parameters after backward, or run the "
                "forward again")
        if torch.is_grad_enabled() and in_backward():
            raise RuntimeError(
                "a second-order backward (create_graph=True, e.g. a gradient penalty) through a model "
                "wrapped by offload: the graph it records would hold the rebuilt parameter views, not the "
                "parameters, so its gradients would be wrong. Compute it without offload, or unwrap the "
                "model first")

    def _release_node_holds(self) -> None:
        """Release the groups fetched for autograd nodes that have finished: on the thread
        that runs backward's nodes one at a time, a node other than the current one is done
        (on CUDA its kernels are queued, and the store fences a freed slot before reuse)."""
        if not self._node_holds:
            return
        current = torch._C._current_autograd_node()
        keep = []
        for node, group in self._node_holds:
            if node is current:
                keep.append((node, group))
            else:
                self.coordinator.release(group, "backward")
        self._node_holds = keep

    # -- modules -----------------------------------------------------------------------------------
    def _pre_forward(self, groups: list[ParamGroup], args: tuple, kwargs: dict) -> Any:
        refuse_func_transforms()
        for group in groups:
            self.coordinator.acquire(group, "forward")
        if not torch.is_grad_enabled():
            return None
        inputs = [a for a in args if _needs_grad(a)] + [v for v in kwargs.values() if _needs_grad(v)]
        self._calls.append((groups, input_edges(inputs) if inputs else None))  # (None in inference mode)
        return None

    def _post_forward(self, groups: list[ParamGroup], output: Any) -> Any:
        leaves = tree_flatten(output)[0]
        if self._aliases_of(groups, leaves):
            output = self._own_outputs(groups, output)
            leaves = tree_flatten(output)[0]
        for group in groups:
            self.coordinator.release(group, "forward")
        if not torch.is_grad_enabled():
            return output
        inputs = None
        if self._calls and self._calls[-1][0] is groups:
            inputs = self._calls.pop()[1]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        # Note: where no input needs a gradient (an embedding of token ids), nothing would
        # mark the end of this module's backward (_backward_end), so the group would stay
        # held to the end of the whole backward. Its backward needs the group only through
        # saved tensors, which fetch it for their autograd node (_unpack).
        if inputs is None or not tensors:
            return output
        tracked = BackwardEnd.attach(tensors, *inputs, lambda gs=groups: self._post_backward(gs))
        if tracked is None:
            return output
        end, nodes = tracked
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads, gs=groups, end=end, nodes=nodes: self._pre_backward(gs, end, nodes), mode="any")
        return output

    def _post_backward(self, groups: list[ParamGroup]) -> None:
        for group in groups:
            self.coordinator.release(group, "backward")

    def _buffers(self, groups: list[ParamGroup]) -> set[int]:
        out = set()
        for group in groups:
            flat = self.coordinator.flat_of(group)
            if flat is not None:
                out.add(flat.untyped_storage().data_ptr())
        return out

    def _aliases_of(self, groups: list[ParamGroup], leaves: list) -> bool:
        """Whether an output is a view of the module's group buffers (a slice of its weight)."""
        buffers = None
        for t in leaves:
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                buffers = self._buffers(groups) if buffers is None else buffers
                if not buffers:
                    return False
                if storage_address(t) in buffers:
                    return True
        return False

    def _own_outputs(self, groups: list[ParamGroup], output: Any) -> Any:
        """Outputs that view the module's group buffers become copies: the buffers are
        released next and may be reused."""
        buffers = self._buffers(groups)

        def own(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
                return t
            return t.clone() if storage_address(t) in buffers else t

        return tree_map(own, output)

    def _pre_backward(self, groups: list[ParamGroup], end: BackwardEnd, nodes: list) -> None:
        self._release_node_holds()
        self._queue_end_of_backward()
        for group in groups:
            self.coordinator.acquire(group, "backward")
        end.arm(nodes)

    def _queue_end_of_backward(self) -> None:
        if self._backward_queued and graph_task() != self._backward_task:
            self._backward_queued = False  # queued by a backward that was interrupted
            self._release_backward()
        if not self._backward_queued:
            self._backward_queued = True
            self._backward_task = graph_task()
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._backward_queued = False
        self._release_backward()
        self.coordinator.end_pass()

    def _release_backward(self) -> None:
        self._node_holds.clear()  # released with every other backward hold
        self.coordinator.release_backward()


def _call_depth() -> int:
    """Frames on the calling thread's stack (cheap: a walk of a linked list)."""
    frame, depth = sys._getframe(1), 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def _rebuild(packed: _SavedRef, flat: torch.Tensor) -> torch.Tensor:
    """The saved tensor, as a view of the group's buffer of the moment."""
    itemsize = torch.empty((), dtype=packed.dtype).element_size()
    out = torch.empty(0, dtype=packed.dtype, device=flat.device)
    return out.set_(flat.untyped_storage(), (flat.storage_offset() + packed.offset) // itemsize,
                    packed.shape, packed.stride)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()
