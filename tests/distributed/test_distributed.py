"""ZeRO-3 over torch.distributed: ranks launched by torchrun (gloo, CPU) as subprocesses,
each against the same run in one process (and plain torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.distributed import Partition
from offload.params import slice_groups
from offload.params._groups import build_groups

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

WORKER = Path(__file__).with_name("worker.py")
STEPS, SAVE_AFTER = 5, 3


def run(directory: Path, name: str, nproc: int, **spec) -> dict:
    """Run worker.py on ``nproc`` ranks (torchrun) or in one process; its results."""
    spec.setdefault("nvme", str(directory / f"{name}-nvme-{{rank}}"))
    spec.setdefault("steps", STEPS)
    spec["out"] = str(directory / f"{name}.json")
    spec_path = directory / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), str(spec_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(WORKER), str(spec_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(Path(spec["out"]).read_text())
    result["ranks"] = [json.loads(Path(f"{spec['out']}.rank{r}").read_text()) for r in range(nproc)] \
        if not spec.get("torch") else [result]
    weights = Path(spec["out"] + ".pt")
    result["weights"] = torch.load(weights) if weights.exists() else None
    return result


def assert_same_run(run, ref, *, first_step: int = 0, weights_atol: float = 1e-4) -> None:
    """Losses to float32 rounding (the ranks sum their halves of the batch in another order),
    weights to what Adam makes of that rounding in its first steps (elements whose gradient
    is near zero move by up to lr per step either way)."""
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"][first_step:]),
                               rtol=1e-5, atol=1e-6)
    assert run["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        torch.testing.assert_close(run["weights"][name], value, rtol=1e-4, atol=weights_atol, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    return {
        "dir": d,
        "torch": run(d, "torch", 1, torch=True),
        "one": run(d, "one", 1, save=str(d / "ck-one"), save_after=SAVE_AFTER),
        "two": run(d, "two", 2, save=str(d / "ck-two"), save_after=SAVE_AFTER),
    }


def test_two_ranks_train_like_one_process_and_like_torch(runs):
    assert runs["two"]["world"] == 2 and runs["one"]["world"] == 1
    # after the first (recorded) pass, groups are all-gathered ahead of use
    assert all(r["gathered_ahead"] > 0 for r in runs["two"]["ranks"])
    assert_same_run(runs["two"], runs["one"])
    assert_same_run(runs["one"], runs["torch"])  # the reference itself equals plain torch
    assert_same_run(runs["two"], runs["torch"])
    # offload.unwrap on every rank gives each the whole trained model
    assert all(r["unwrapped_equal"] for r in runs["two"]["ranks"] + runs["one"]["ranks"])
    # the optimizer's state_dict() would hold a rank's slices and zeros (a trial saved it so)
    assert all("several ranks" in r.get("state_dict_refused", "") and "save_checkpoint" in r["state_dict_refused"]
               for r in runs["two"]["ranks"])


def test_ranks_built_with_other_seeds_that_load_one_checkpoint_train_alike(runs):
    """Values differing between ranks are refused only where they are the weights: with
    checkpoint= every rank's come from the file (built with another seed on rank 1 here)."""
    loaded = run(runs["dir"], "from-checkpoint", 2, from_checkpoint=True)
    assert all("error" not in r for r in loaded["ranks"])
    assert_same_run(loaded, runs["two"], weights_atol=0)


def test_each_rank_keeps_about_half_of_the_bytes(runs):
    one, ranks = runs["one"]["ranks"][0], runs["two"]["ranks"]
    for rank in ranks:
        # the parameter bytes: half of each group, padded to 256-byte multiples
        assert rank["slice_bytes"] <= one["slice_bytes"] / 2 + 256 * 2 * 40
        assert rank["slice_bytes"] >= one["slice_bytes"] / 2
        # its files (parameters and optimizer states; small tensors take a 4 KiB extent each)
        assert rank["nvme_bytes"] < 0.6 * one["nvme_bytes"]
    assert sum(r["nvme_bytes"] for r in ranks) < 1.2 * one["nvme_bytes"]


@pytest.mark.parametrize("param_tier", ["host", "device"])
def test_the_host_and_device_tiers_partition_too(runs, param_tier):
    """Parameters resting in host memory, or on the device (each rank its slices, gathered
    per use), with optimizer states in host memory."""
    other = run(runs["dir"], f"tier-{param_tier}", 2, tier="host", param_tier=param_tier)
    assert_same_run(other, runs["one"])
    assert all(r["nvme_bytes"] == 0 for r in other["ranks"])
    assert all(r["unwrapped_equal"] for r in other["ranks"])


def test_a_tight_device_budget_on_two_ranks(runs):
    """A device budget that holds a few groups: prefetches are dropped for demand fetches,
    gathers ahead are sometimes refused for room; every rank decides alike (its own count of
    what it holds, not the timing of its reads), so the collectives stay in step."""
    tight = run(runs["dir"], "tight", 2, device_budget="700KiB")
    assert_same_run(tight, runs["one"])
    assert all(r["gathered_ahead"] > 0 for r in tight["ranks"])


@pytest.mark.parametrize("saved,loaded", [("two", 1), ("one", 2), ("two", 3)],
                         ids=["2->1", "1->2", "2->3"])
def test_a_checkpoint_loads_into_another_world_size_and_continues(runs, saved, loaded):
    d = runs["dir"]
    ck = d / f"ck-{saved}"
    manifest = json.loads((ck / "manifest.json").read_text())
    if saved == "two":
        assert manifest["distributed"]["world_size"] == 2
        assert sorted(p.name for p in ck.iterdir()) == ["manifest.json", "rank-0", "rank-1"]
    resumed = run(d, f"resume-{saved}-{loaded}", loaded, load=str(ck))
    assert resumed["world"] == loaded
    assert_same_run(resumed, runs["one"], first_step=SAVE_AFTER)
    # and the saved state itself, read back in one process without a model
    if saved == "two":
        state = offload.load_state_dict_from(str(ck))
        assert set(state) == set(runs["torch"]["weights"])


def test_checkpointing_clipping_and_untied_llama_on_two_ranks(tmp_path):
    spec = dict(model="llama", checkpointing=True, clip=0.05, steps=4)
    assert_same_run(run(tmp_path, "llama2", 2, **spec), run(tmp_path, "llama1", 1, **spec),
                    weights_atol=2e-4)


def test_gradient_accumulation_on_two_ranks(runs):
    """Two backward passes per step (half the loss each): each reduces its gradients and the
    slices add up, as the single process's accumulators do."""
    assert_same_run(run(runs["dir"], "accum", 2, accum=True), runs["one"])


def test_update_during_backward_on_two_ranks(runs):
    early = run(runs["dir"], "early", 2, early=True)
    assert_same_run(early, runs["one"])


@pytest.mark.parametrize("fault,expected", [
    ("config", "different OffloadConfigs (compute_dtype"),
    ("model", "different models"),
    ("shared_path", "share nvme_path"),
    ("plain", "only parameters of the wrapped model"),
    ("adapter", "only parameters of the wrapped model"),  # (they trained apart on each rank, silently)
    ("seed", "different values of the model's parameters"),  # (mixed slice by slice, silently)
])
def test_ranks_that_disagree_are_refused_on_every_rank(tmp_path, fault, expected):
    result = run(tmp_path, fault, 2, fault=fault, steps=1)
    for rank in result["ranks"]:
        assert expected in rank.get("error", ""), rank
    if fault == "shared_path":
        assert "{rank}" in result["ranks"][0]["error"]


def test_a_save_that_fails_on_one_rank_fails_on_all_and_keeps_the_previous_checkpoint(tmp_path):
    result = run(tmp_path, "save-fault", 2, fault="save", steps=1, save=str(tmp_path / "ck"))
    for rank in result["ranks"]:
        assert "failed on 1 rank(s), nothing was replaced: rank 1: OSError" in rank["error"], rank
        assert "No space left on device (injected)" in rank["error"]
        assert rank["step_saved"] == 1  # the checkpoint before is whole, and loads
    assert not list(tmp_path.glob("ck.tmp-*"))  # the failed save left nothing behind


def test_a_load_that_fails_on_one_rank_fails_on_all(tmp_path):
    """A byte flipped in rank 1's file: rank 1 finds the checksum mismatch, and rank 0, whose
    own reads were fine, raises too, naming rank 1."""
    result = run(tmp_path, "load-fault", 2, fault="load", steps=1, save=str(tmp_path / "ck"))
    one, zero = result["ranks"][1]["error"], result["ranks"][0]["error"]
    assert "checksum mismatch" in one and "rank-1/model.bin" in one
    assert "failed on another rank: rank 1: CheckpointError" in zero and "checksum mismatch" in zero


def test_world_size_without_a_process_group_is_refused(tmp_path):
    result = run(tmp_path, "alone", 1, world_size=2, steps=1)
    assert "torch.distributed is not initialised" in result["error"]
    assert "torchrun --nproc_per_node 2" in result["error"]


def test_world_size_that_differs_from_the_process_group_is_refused(tmp_path):
    result = run(tmp_path, "three", 2, world_size=3, steps=1)
    for rank in result["ranks"]:
        assert "world_size=3" in rank["error"] and "2 ranks" in rank["error"]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_slices_cover_every_element_once(world):
    """Slices of real groups (tied embeddings, odd sizes, bf16) for any world size: equal
    sizes, 256-byte multiples, and every element of every parameter in exactly one slice."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=97, n_positions=13, n_embd=24, n_layer=2, n_head=3)
    model = transformers.GPT2LMHeadModel(cfg)
    groups, _ = build_groups(model, dtype=torch.bfloat16, resident_bytes=0, group_bytes=3000)
    whole = {g.key: torch.randint(0, 255, (g.nbytes,), dtype=torch.uint8) for g in groups}
    parts = [slice_groups(groups, Partition(None, r, world, r, "gloo")) for r in range(world)]
    for gi, group in enumerate(groups):
        sizes = {p[gi].nbytes for p in parts}
        assert len(sizes) == 1 and sizes.pop() % 256 == 0
        rebuilt = torch.cat([whole[group.key].new_zeros(0)] + [
            torch.nn.functional.pad(whole[group.key], (0, parts[0][gi].nbytes * world - group.nbytes))
            [p[gi].begin: p[gi].begin + p[gi].nbytes] for p in parts])
        assert torch.equal(rebuilt[: group.nbytes], whole[group.key])
        for si, slot in enumerate(group.slots):
            covered = torch.zeros(slot.numel, dtype=torch.int32)
            for p in parts:
                mine = p[gi].slots[si]
                assert mine.whole is slot and mine.param is slot.param
                covered[mine.first: mine.first + mine.count] += 1
                if not mine.count:
                    continue
                begin, end = mine.held  # within the slice, and the same bytes as in the whole group
                assert 0 <= begin < end <= p[gi].nbytes
                w0, w1 = slot.elements(mine.first, mine.count)
                assert (w0 - p[gi].begin, w1 - p[gi].begin) == (begin, end)
            assert torch.equal(covered, torch.ones_like(covered)), slot.names


def test_the_plan_of_one_rank(tmp_path):
    """offload.plan with world_size=N (before any process group exists): one rank's slices,
    and the whole groups it gathers while in use."""
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256))
    base = dict(device="cpu", nvme_path=str(tmp_path / "nvme-{rank}"), device_budget="64MiB", host_budget="256MiB")
    one = offload.plan(model, offload.OffloadConfig(**base))
    four = offload.plan(model, offload.OffloadConfig(**base, world_size=4))
    assert four.world == 4 and "per rank, 4 ranks" in str(four)
    assert str(tmp_path / "nvme-0") in str(four)
    params = sum(p.numel() * 4 for p in model.parameters())
    mine = sum(r.nbytes for r in four.rows if r.item.startswith("parameters, this rank"))
    assert params / 4 <= mine <= params / 4 + 256 * 4 * 40
    gathered = next(r for r in four.rows if r.item == "parameters gathered from all ranks")
    assert gathered.nbytes >= params
    assert four.disk_need < 0.3 * one.disk_need  # slices and their states, per rank


def test_at_the_plans_least_host_budget_every_rank_trains(tmp_path):
    """The plan for 3 ranks is the neediest rank's: at the least host budget it accepts
    (found to a page, before any process group exists), every rank builds its optimizer and
    trains. (It was rank 0's: the last rank's padded slices cut a larger shard, and that rank
    alone refused the budget in AdamW while the others went on into the forward.)"""
    import sys as _sys

    _sys.path.insert(0, str(WORKER.parent))
    from worker import build

    def fits(budget: int) -> bool:
        cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", world_size=3,
                                    nvme_path=str(tmp_path / "plan-{rank}"), device_budget="64MiB",
                                    host_budget=budget, resident_bytes=0)
        with offload.init_empty_weights():
            model = build("llama_tied")
        return offload.plan(model, cfg, optimizer="adamw").fits

    lo, hi = 16 << 10, 4 << 20
    while hi - lo > 4096:
        mid = (lo + hi) // 2 // 4096 * 4096
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    result = run(tmp_path, "least", 3, model="llama_tied", host_budget=hi, resident_bytes=0, steps=2)
    for rank in result["ranks"]:
        assert "error" not in rank, rank
        assert len(rank["losses"]) == 2
