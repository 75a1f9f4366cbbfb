"""One rank of a distributed test run (launched by torchrun from test_distributed.py), or
the single-process reference (launched with plain python).

    python worker.py SPEC.json

SPEC: {"out": path, "nvme": dir template, "steps": n, "tier": "nvme"|"host", "model": "gpt2"|"llama",
       "param_tier": tier (default: "tier"), "save": dir|None, "save_after": k, "load": dir|None,
       "fault": None|"config"|"model"|"shared_path"|"plain"|"save"|"load",
       "world_size": None|n, "checkpointing": bool, "clip": float|None, "torch": bool,
       "early": bool (update_during_backward), "accum": bool (two backward passes per step),
       "simdevice": bool (run on the simulated device of tests/simdevice)}
Writes JSON to SPEC["out"] (rank 0; each rank adds its own file with .rankN) with losses,
per-rank NVMe bytes and the final weights' file.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import offload

torch.use_deterministic_algorithms(True)
# Adam divides by sqrt(v) + eps: where a gradient is rounding noise (GPT-2's key bias, whose
# true gradient is 0), the default 1e-8 turns that noise into steps of +-lr whose signs no
# two summation orders share; 1e-6 keeps such elements still in every run compared
EPS = 1e-6


def build(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if kind in ("llama", "llama_tied"):
        wide = 160 if kind == "llama" else 128
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=wide,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, tie_word_embeddings=kind == "llama_tied")
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=128, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def batches(steps: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (6, 16), generator=g) for _ in range(steps)]


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1
    other = spec.get("fault") in ("model", "seed") and rank == 1
    checkpoint = None
    if spec.get("from_checkpoint"):  # rank 0's seed-0 weights saved, then each rank builds with its own seed
        checkpoint = spec["out"] + ".hf"
        if rank == 0:
            build(spec.get("model", "gpt2"), seed=0).save_pretrained(checkpoint)
        if launched:
            dist.barrier()
        other = rank == 1
    model = build(spec.get("model", "gpt2"), seed=1 if other else 0)
    if spec.get("fault") == "model" and rank == 1:
        model.lm_head = torch.nn.Linear(model.config.hidden_size, 256, bias=True)  # a different model on rank 1
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    result = {"rank": rank, "world": world, "losses": []}
    if spec.get("torch"):  # plain torch, in memory, whole batch: the reference of references
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=EPS)
        for ids in batches(spec["steps"]):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if spec.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            opt.step()
            opt.zero_grad()
            result["losses"].append(loss.item())
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, spec["out"] + ".pt")
        json.dump(result, open(spec["out"], "w"))
        return
    nvme = spec["nvme"]
    if spec.get("fault") == "shared_path":
        nvme = nvme.replace("{rank}", "shared")
    tier = spec.get("tier", "nvme")
    cfg = offload.OffloadConfig(device="cpu", param_tier=spec.get("param_tier", tier), optimizer_tier=tier,
                                nvme_path=nvme,
                                device_budget=spec.get("device_budget", "64MiB"),
                                resident_bytes=spec.get("resident_bytes", "auto"),
                                host_budget=spec.get("host_budget", "256MiB"), io="manual",
                                io_backend="direct", world_size=spec.get("world_size"),
                                compute_dtype="bf16" if spec.get("fault") == "config" and rank == 1 else None)
    try:
        model = offload.wrap(model, cfg, checkpoint=checkpoint)
        if spec.get("fault") == "plain":  # a parameter outside the wrapped model
            offload.AdamW(list(model.parameters()) + [torch.nn.Parameter(torch.zeros(3))])
        if spec.get("fault") == "adapter":  # one added to it after wrap (a LoRA adapter), alone
            model.lm_head.register_parameter("adapter", torch.nn.Parameter(torch.zeros(3)))
            offload.AdamW([model.lm_head.adapter])
    except (ValueError, offload.io.BudgetError) as err:
        result["error"] = f"{type(err).__name__}: {err}"
        json.dump(result, open(f"{spec['out']}.rank{rank}", "w"))
        if rank == 0:
            json.dump(result, open(spec["out"], "w"))
        if launched:  # every rank refused alike: leave together (a gloo group torn down at exit
            dist.barrier()  # while the other rank is gone may abort the process)
            dist.destroy_process_group()
        return
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=EPS)
    data = batches(spec["steps"])
    start = 0
    if spec.get("load"):
        extra = offload.load_checkpoint(spec["load"], model, opt)
        start = extra["step"]
    per = 6 // world
    for step in range(start, spec["steps"]):
        ids = data[step][rank * per: (rank + 1) * per]
        if spec.get("accum"):  # the same batch as two micro-batches of half the loss each
            for _ in range(2):
                half = model(input_ids=ids, labels=ids).loss / 2
                half.backward()
            loss = half.detach() * 2
        elif spec.get("early"):
            loss = model(input_ids=ids, labels=ids).loss
            with opt.update_during_backward():
                loss.backward()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if spec.get("clip"):
            opt.clip_grad_norm_(spec["clip"])
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        result["losses"].append(mean.item())
        if spec.get("save") and step + 1 == spec.get("save_after"):
            offload.save_checkpoint(spec["save"], model, opt, extra={"step": step + 1})
    if spec.get("fault") == "save":  # a save that fails on rank 1 after one that worked
        offload.save_checkpoint(spec["save"], model, opt, extra={"step": 1})
        if rank == 1:
            from offload.checkpoint import _save

            def full_disk(self, directory):
                raise OSError(28, "No space left on device (injected)")

            _save.BlobWriter.run = full_disk
        try:
            offload.save_checkpoint(spec["save"], model, opt, extra={"step": 2})
        except offload.CheckpointError as err:
            result["error"] = str(err)
        result["step_saved"] = offload.load_checkpoint(spec["save"], model, opt)["step"]
    if spec.get("fault") == "load":  # a checkpoint whose rank-1 file was damaged after the save
        offload.save_checkpoint(spec["save"], model, opt, extra={"step": 1})
        if rank == 0:
            with open(os.path.join(spec["save"], "rank-1", "model.bin"), "r+b") as fh:
                fh.seek(100)
                byte = fh.read(1)
                fh.seek(100)
                fh.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        try:
            offload.load_checkpoint(spec["save"], model, opt)
        except offload.CheckpointError as err:
            result["error"] = str(err)
    opt.synchronize()
    if world > 1:  # (each rank's dict held its slice and zeros: refused, naming save_checkpoint)
        try:
            opt.state_dict()
        except RuntimeError as err:
            result["state_dict_refused"] = str(err)
    stats = offload.stats(model)
    result["nvme_bytes"] = stats["nvme_bytes"]
    result["read_bytes"] = stats["read_bytes"]
    result["gathered_ahead"] = stats["gathered_ahead"]
    result["slice_bytes"] = sum(g.nbytes for g in offload.params.manager_of(model).groups)
    weights = offload.state_dict(model)  # every rank takes part in the gathers
    if rank == 0:
        torch.save(weights, spec["out"] + ".pt")
    json.dump(result, open(f"{spec['out']}.rank{rank}", "w"))
    if rank == 0:
        json.dump(result, open(spec["out"], "w"))
    opt.close()
    offload.unwrap(model)  # every rank gathers every group back into ordinary tensors
    result["unwrapped_equal"] = all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    json.dump(result, open(f"{spec['out']}.rank{rank}", "w"))
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    if json.load(open(sys.argv[1])).get("simdevice"):  # the device code paths on tests/simdevice's simulator
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from simdevice.sim import simulated

        with simulated(seed=int(os.environ.get("RANK", 0)), max_delay=0.001):
            main()
    else:
        main()
