"""The update rules: AdamW, Adam and SGD over the shards of :class:`OffloadOptimizer`
(``_optimizer``), each as its torch namesake computes it.

``_update`` gets, per torch param group present in a shard, lists of fp32 CPU tensors (the
parameters or master rows, the gradients, each state row) and the per-segment step counts;
``grad_scale`` divides the gradients (the loss scale; a clip factor has multiplied them
already), in place, as torch's fused kernels do.
"""

from __future__ import annotations

import logging

import torch

from ._optimizer import OffloadOptimizer

__all__ = ["AdamW", "Adam", "SGD", "state_rows"]

log = logging.getLogger(__name__)


class AdamW(OffloadOptimizer):
    """AdamW (decoupled weight decay) with states in the optimizer tier; torch's fused CPU
    kernel does the update. Arguments as ``torch.optim.AdamW`` plus those of
    :class:`OffloadOptimizer`."""

    _decoupled = True
    # (in its state dict's groups: a torch optimizer that loads it keeps to the fused kernel)
    _torch_settings = {"fused": True, "foreach": None, "capturable": False, "differentiable": False}

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, **kwargs):
        _check_adam_args(lr, betas, eps, weight_decay)
        _check_kernel_args(type(self).__name__, foreach, fused, capturable, differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=kwargs.pop("decoupled_weight_decay",
                                                                            self._decoupled))
        super().__init__(params, defaults, **kwargs)

    @classmethod
    def _rows_for(cls, group: dict) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())

    def _update(self, group, params, grads, rows, steps, grad_scale) -> None:
        # torch's fused kernel, called as torch.optim.adamw's fused path calls it (every tensor
        # here is an fp32 CPU tensor, so its grouping by device and dtype is skipped)
        beta1, beta2 = group["betas"]
        scale = None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32)
        # (per group, as torch's Adam: a loaded state dict may change it)
        decoupled = group.get("decoupled_weight_decay", self._decoupled)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        torch._foreach_add_(steps, 1)
        kernel(params, grads, rows[0], rows[1], rows[2] if group["amsgrad"] else [], steps,
               amsgrad=group["amsgrad"], lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
               weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
               grad_scale=scale, found_inf=None)


class Adam(AdamW):
    """Adam with L2 weight decay (added to the gradient), as ``torch.optim.Adam``;
    ``decoupled_weight_decay=True`` makes it AdamW, as torch's does."""

    _decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 decoupled_weight_decay: bool = False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=decoupled_weight_decay, **kwargs)


class SGD(OffloadOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, as ``torch.optim.SGD``."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, differentiable: bool = False, **kwargs):
        _check_kernel_args("SGD", foreach, fused, False, differentiable)
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"invalid SGD hyperparameters: lr={lr}, momentum={momentum}, "
                             f"weight_decay={weight_decay} (all must be >= 0)")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, **kwargs)

    @classmethod
    def _rows_for(cls, group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group.get("momentum", 0) != 0 else ()

    def _update(self, group, params, grads, rows, steps, grad_scale) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        updates = []
        for i, (p, g) in enumerate(zip(params, grads)):
            if grad_scale != 1.0:  # in place, as torch's fused kernels unscale (_unscaled_in_place)
                g = g.div_(grad_scale)
            if group["maximize"]:
                g = -g
            if wd != 0:
                g = g.add(p, alpha=wd)
            if momentum != 0:
                buf = rows[0][i]
                if float(steps[i]) == 0:
                    buf.copy_(g)
                else:
                    buf.mul_(momentum).add_(g, alpha=1 - group["dampening"])
                g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
            updates.append(g)
            steps[i] += 1
        # (one call for all, as torch's foreach SGD makes it: parameters of a model wrapped after
        # this optimizer was built are written together, their copies taken before any write)
        torch._foreach_add_(params, updates, alpha=-lr)


def state_rows(kind: str) -> tuple[str, ...]:
    """The state rows ``offload.plan`` counts for an optimizer of ``kind``: AdamW and Adam
    with their defaults, SGD with momentum (without it SGD keeps none)."""
    settings = {"adamw": (AdamW, {}), "adam": (Adam, {}), "sgd": (SGD, {"momentum": 0.9})}
    if kind not in settings:
        raise ValueError(f"optimizer={kind!r}: use 'adamw', 'adam', 'sgd' or None")
    cls, group = settings[kind]
    return cls._rows_for(group)


def _check_kernel_args(name: str, foreach, fused, capturable, differentiable) -> None:
    """torch's kernel choices, as code written for a torch optimizer passes them: the update
    here is always the same (Adam's and AdamW's is torch's fused CPU kernel, whose last bits
    differ from its foreach and for-loop kernels: said where another was asked for; SGD's
    equals all three of torch's); what needs autograd or CUDA graphs through it is refused."""
    if differentiable:
        raise ValueError(f"offload.{name}(differentiable=True): the update runs outside autograd on "
                         "offloaded states; use a torch optimizer on parameters offload does not stream")
    if capturable:
        raise ValueError(f"offload.{name}(capturable=True): CUDA graph capture of the step is not supported "
                         "(the update runs on the CPU, shard by shard); drop the argument")
    if name != "SGD" and (fused is False or foreach is not None):
        log.info("offload.%s runs the update as torch's fused kernel whatever foreach=%s, fused=%s ask: results "
                 "equal torch.optim.%s(fused=True), and differ from its foreach and for-loop kernels in the "
                 "last bits", name, foreach, fused, name)


def _check_adam_args(lr, betas, eps, weight_decay) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"invalid learning rate {lr}: must be >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"invalid eps {eps}: must be >= 0")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
