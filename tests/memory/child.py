"""Runs in a fresh interpreter for the memory tests (RSS and its high-water mark are the
process's own, so every figure here is this run's and nothing else's).

    python child.py train OUT.json WORKDIR ALLOCATOR STEPS   # plan, wrap, STEPS steps; the step log
    python child.py churn OUT.json ALLOCATOR                 # malloc's kept memory after a churn of tensors

``train``: a 4-layer GPT-2 (256 wide, 4096 tokens: about 4M parameters) built on the meta
device and streamed from a safetensors file written first, parameters and AdamW states on
NVMe, CPU device, batch 4 x 128. ``churn``: after ``wrap`` applied ``host_allocator``, 256
tensors of 1 MiB are made and every other one freed; twice.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from transformers import GPT2LMHeadModel  # (imported before offload: in the baseline, as a user's script has it)

import offload
from offload._memory import heap_use

GPT2 = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128, bos_token_id=0, eos_token_id=0)


def train(out: str, workdir: str, allocator: str, steps: int) -> None:
    checkpoint = os.path.join(workdir, "model")
    torch.manual_seed(0)
    GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(checkpoint)
    with offload.init_empty_weights():
        model = GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme",
                                nvme_path=os.path.join(workdir, "swap"), device_budget="8MiB", host_budget="96MiB",
                                file_size="64MiB", host_allocator=allocator, io_backend="direct",
                                log_path=os.path.join(workdir, "steps.jsonl"))
    ids = torch.randint(0, GPT2["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(1))
    plan = offload.plan(model, cfg, batch={"input_ids": ids, "labels": ids})
    model = offload.wrap(model, cfg, checkpoint=checkpoint)
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    pools = []
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        stats = offload.stats(model)
        pools.append([stats["mem_host_pool_bytes"], stats["mem_device_pool_bytes"], stats["host_bytes"],
                      stats["device_bytes"]])
    peak = offload.stats(model)["rss_peak_bytes"]
    opt.close()
    offload.close(model)
    records = [json.loads(line) for line in open(cfg.log_path)]
    with open(out, "w") as fh:
        json.dump({"predicted_rss": plan.predicted_rss, "transient": plan.transient_bytes,
                   "activations": plan.activations.saved_bytes, "peak_rss": peak,
                   "records": records, "pools": pools}, fh)


def churn(out: str, allocator: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    offload.wrap(model, offload.OffloadConfig(device="cpu", param_tier="device", optimizer_tier="host",
                                              device_budget="1MiB", host_budget="1MiB", host_allocator=allocator))
    keep = []
    before = heap_use()
    for _ in range(2):  # (glibc's own threshold rises to 1 MiB once such a block is freed: the second round)
        blocks = [torch.ones(1 << 18) for _ in range(256)]  # 1 MiB each
        keep += blocks[1::2]  # every other one stays: the freed ones are holes between them
        del blocks
    after = heap_use()
    offload.close(model)
    with open(out, "w") as fh:
        json.dump({"kept_free": after.kept_free - before.kept_free, "kept": len(keep)}, fh)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        churn(sys.argv[2], sys.argv[3])
