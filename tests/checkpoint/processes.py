"""The checkpoint tests' training runs in a fresh process (``child.py``), and their JSON reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = os.path.join(os.path.dirname(__file__), "child.py")


def child(*args, kill=None, fallback=False, timeout=240):
    env = dict(os.environ)
    env.pop("CHILD_KILL_AT", None)
    if kill:
        env["CHILD_KILL_AT"] = kill
    code = None
    if fallback:  # the file system has no renameat2 RENAME_EXCHANGE: two renames
        code = ("import sys, runpy; import offload.checkpoint._format as f; f._exchange = lambda a, b: False; "
                f"sys.argv = {[CHILD, *map(str, args)]!r}; runpy.run_path({CHILD!r}, run_name='__main__')")
    cmd = [sys.executable, "-c", code] if code else [sys.executable, CHILD, *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def read(path):
    with open(path) as fh:
        return json.load(fh)
