"""offload: train and run PyTorch models larger than GPU memory and RAM.

Parameters, gradients and optimizer states rest on the cheapest tier that can serve
them (device memory, host memory, NVMe files) and come back just in time.
The layers so far: ``offload.io`` (aligned buffers, the async file engine) and
``offload.store`` (the tiered tensor store).
"""

from ._units import format_size, parse_size

__version__ = "0.1.0"

__all__ = ["parse_size", "format_size", "__version__"]
