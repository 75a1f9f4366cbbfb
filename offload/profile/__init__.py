"""Measure the links offload uses (disk, host memory, CPU optimizer, host-device) and
recommend a configuration; ``offload-profile`` is the command line (:mod:`.cli`).

    report = offload.profile.run_profile("/mnt/nvme/offload", 1 << 30)
    cfg, reasons = offload.profile.recommend(report, model_bytes=14 << 30)

The report is cached as ``<path>/offload-profile.json``; ``OffloadConfig(io="auto")``
(the default) takes the I/O engine's settings from the cached profile of its
``nvme_path`` (or of the nearest parent directory on the same file system).
"""

from .._profile_cache import CACHE_NAME, find_profile
from ._recommend import recommend
from ._run import check_target, run_profile

__all__ = ["run_profile", "recommend", "find_profile", "check_target", "CACHE_NAME"]
