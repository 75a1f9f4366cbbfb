"""``python -m offload.profile``: the same as the ``offload-profile`` command."""

import sys

from .cli import main

sys.exit(main())
