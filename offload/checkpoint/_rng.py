"""The random number generators' state as JSON-able data, for ``save_checkpoint(extra=...)``."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """The state of torch's CPU generator, every CUDA device's generator, Python's
    ``random`` and NumPy's global generator, as a JSON-able dict."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _encode(torch.get_rng_state()),
                             "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (after a round trip through JSON)."""
    if not isinstance(state, dict) or "torch" not in state:
        raise ValueError("set_rng_state expects the dict returned by offload.rng_state()")
    torch.set_rng_state(_decode(state["torch"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        states = [_decode(s) for s in state["cuda"]]
        if len(states) != torch.cuda.device_count():
            raise ValueError(f"the RNG state has {len(states)} CUDA generators, this machine "
                             f"{torch.cuda.device_count()} devices")
        torch.cuda.set_rng_state_all(states)
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
