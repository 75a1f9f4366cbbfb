"""Two ranks on the simulated device: each rank's gradients go through the reduce-scatter
buckets and the side-stream drain; the run equals plain torch in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

WORKER = Path(__file__).parents[1] / "distributed" / "worker.py"


def _run(directory: Path, name: str, nproc: int, **spec) -> dict:
    spec.update(out=str(directory / f"{name}.json"), nvme=str(directory / f"{name}-nvme-{{rank}}"), steps=3)
    path = directory / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(WORKER), str(path)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
         str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(Path(spec["out"]).read_text())
    result["weights"] = torch.load(spec["out"] + ".pt")
    return result


@pytest.mark.parametrize("early", [False, True])
def test_two_ranks_on_the_simulated_device_train_like_torch(tmp_path, early):
    ref = _run(tmp_path, "torch", 1, torch=True)
    run = _run(tmp_path, "sim", 2, simdevice=True, early=early)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for name, value in ref["weights"].items():  # (tolerances of tests/distributed: another summation order)
        torch.testing.assert_close(run["weights"][name], value, rtol=1e-4, atol=1e-4, msg=name)
