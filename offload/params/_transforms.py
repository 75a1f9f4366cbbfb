"""Where torch's function transforms meet offload's hooks: torch.func's jvp and grad are
refused (they would wrap the group buffers offload makes inside them), vmap runs (it wraps
only what meets its batched inputs), and a tensor without a storage to look at (a batched
or wrapped one) is told apart from a view of a group buffer."""

from __future__ import annotations

import torch

__all__ = ["refuse_func_transforms", "storage_address", "NO_STORAGE_SAVED"]

# (what the saved-tensor hooks say of a saved tensor they cannot tell from a group buffer's view)
NO_STORAGE_SAVED = (
    "offload: a tensor saved for backward in a wrapped model's forward has no storage it can look at: "
    "forward-mode AD (torch.autograd.forward_ad) with gradients on is not supported through offload's "
    "parameter streaming. Run it under torch.no_grad() (it needs no backward there), or on the model "
    "unwrapped (offload.unwrap)")


def refuse_func_transforms() -> None:
    """torch.func's jvp and grad wrap every tensor made inside them, the group buffers
    offload materializes too, which then cannot be reused or looked at; vmap wraps only
    what meets its batched inputs, and runs."""
    stack = getattr(torch._C._functorch, "get_interpreter_stack", lambda: None)() or []
    for interpreter in stack:
        kind = interpreter.key()
        if kind != torch._C._functorch.TransformType.Vmap:
            raise RuntimeError(
                f"offload: a wrapped model's forward inside torch.func's {kind.name.lower()} transform is not "
                "supported (it would wrap the weight buffers offload streams). torch.func.vmap of the model "
                "works, and forward-mode AD under torch.no_grad() (torch.autograd.forward_ad) gives the same "
                "tangents as torch.func.jvp; else run it on the model unwrapped (offload.unwrap)")


def storage_address(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage lives, or None for a tensor without one to look at (torch.func's
    batched and wrapped tensors): not a view of a group buffer offload can copy, and one that
    wraps such a view keeps the buffer from reuse (the pool leaves viewed buffers alone)."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
