"""Weights read where a safetensors checkpoint holds them (``read_in_place``): setup writes
nothing, outputs and training equal the copying path's and the in-memory model's, frozen
weights are never copied, the checkpoint is never written, and a checkpoint changed under
the model is refused by name."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib

import pytest
import torch

import offload
from offload.store import CheckpointChangedError, Tier

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                   eos_token_id=0)


def _saved(tmp_path, *, dtype=torch.float32, shards=False, build=None):
    """A model with random weights (seed 0) saved with save_pretrained; (model, its directory)."""
    torch.manual_seed(0)
    model = (build or (lambda: transformers.GPT2LMHeadModel(_gpt2_config())))().to(dtype)
    path = str(tmp_path / "ckpt")
    model.save_pretrained(path, max_shard_size="60KB" if shards else "2GB")
    return model.eval(), path


def _wrapped(model_cls, config, path, tmp_path, name, **settings):
    with offload.init_empty_weights():
        model = model_cls(config)
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=str(tmp_path / name),
                device_budget="256KiB", host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB")
    args.update(settings)
    return offload.wrap(model, offload.OffloadConfig(**args), checkpoint=path).eval()


def _swap_files(path):
    return glob.glob(os.path.join(path, "offload-swap-*"))


def _digests(path):
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(f, "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.mark.parametrize("dtype,shards,backend", [(torch.float32, False, "direct"), (torch.float32, True, "direct"),
                                                  (torch.bfloat16, False, "direct"), (torch.bfloat16, True, "mmap")],
                         ids=["fp32-one_file", "fp32-sharded", "bf16-one_file", "bf16-sharded-mmap"])
def test_outputs_equal_the_copying_path_and_the_model_in_memory(tmp_path, dtype, shards, backend, no_leaks):
    ref, path = _saved(tmp_path, dtype=dtype, shards=shards)
    files = len(glob.glob(os.path.join(path, "*.safetensors")))
    assert files > 1 if shards else files == 1
    compute = {"compute_dtype": "bf16"} if dtype is torch.bfloat16 else {}
    ids = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(1))
    outs = {}
    for name, in_place in (("inplace", True), ("copy", False)):
        model = _wrapped(transformers.GPT2LMHeadModel, _gpt2_config(), path, tmp_path, name, read_in_place=in_place,
                         io_backend=backend, **compute)
        store = offload.params.manager_of(model).store
        if in_place:
            stats = store.checkpoint_stats()
            assert stats["in_place_bytes"] > 0 and len(stats["files"]) == len(_digests(path))
            assert store.tiers[Tier.NVME].write_bytes == 0 and not _swap_files(tmp_path / name)  # setup wrote nothing
        with torch.no_grad():
            outs[name] = (model(input_ids=ids).logits,
                          model.generate(ids[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0))
        if in_place:
            assert store.tiers[Tier.NVME].write_bytes == 0 and store.checkpoint_stats()["read_bytes"] > 0
        offload.close(model)
    with torch.no_grad():
        want = ref(input_ids=ids).logits, ref.generate(ids[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(outs["inplace"][0], outs["copy"][0], rtol=0, atol=0)
    torch.testing.assert_close(outs["inplace"][0], want[0])
    assert torch.equal(outs["inplace"][1], outs["copy"][1]) and torch.equal(outs["inplace"][1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_moves_groups_on_first_write_and_never_writes_the_checkpoint(tmp_path, dtype, no_leaks):
    """fp32 (the master is the group: written home) and bf16 (fp32 master rows, the group
    put anew): the same trajectory as the copying path, every group moved once."""
    _, path = _saved(tmp_path, shards=True, dtype=dtype)
    before = _digests(path)
    compute = {"compute_dtype": "bf16"} if dtype is torch.bfloat16 else {}
    batches = [torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    runs = {}
    for name, in_place in (("inplace", True), ("copy", False)):
        model = _wrapped(transformers.GPT2LMHeadModel, _gpt2_config(), path, tmp_path, name,
                         read_in_place=in_place, **compute).train()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        store = offload.params.manager_of(model).store
        if in_place:
            stats = store.checkpoint_stats()
            streamed = sum(g.nbytes for g in offload.params.manager_of(model).groups if not g.resident)
            assert stats["moved_bytes"] == streamed and stats["in_place_bytes"] == 0
        opt.close()
        runs[name] = losses, {n: p.detach().clone() for n, p in offload.unwrap(model).named_parameters()}
    assert runs["inplace"][0] == runs["copy"][0]
    torch.testing.assert_close(runs["inplace"][1], runs["copy"][1], rtol=0, atol=0)
    assert _digests(path) == before


def _saved_llama(tmp_path, **config):
    """A tiny Llama saved as safetensors: (its config, the model in memory, the directory)."""
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **config)
    base, path = _saved(tmp_path, build=lambda: transformers.LlamaForCausalLM(config))
    return config, base, path


def _lora(peft, model, **settings):
    """LoRA on q_proj and v_proj, rank 4, its adapters drawn after seed 1."""
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **settings))


def test_lora_on_a_base_read_in_place_never_copies_the_base(tmp_path, no_leaks):
    peft = pytest.importorskip("peft")
    config, base, path = _saved_llama(tmp_path)

    def lora(model):
        return _lora(peft, model, lora_alpha=8, lora_dropout=0.0)

    ref = lora(base.train())
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True)
    model = lora(_wrapped(transformers.LlamaForCausalLM, config, path, tmp_path, "swap").train())
    store = offload.params.manager_of(model.get_base_model()).store
    held = store.checkpoint_stats()["in_place_bytes"]
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for i in range(3):
        ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(i))
        got, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(got, want)
        for m, o in ((model, opt), (ref, ref_opt)):
            (got if m is model else want).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert held > 0 and store.checkpoint_stats()["in_place_bytes"] == held  # the base never left the files
    assert store.checkpoint_stats()["moved_bytes"] == 0 and not _swap_files(tmp_path / "swap")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if "lora" in n:
            torch.testing.assert_close(p.detach(), q.detach(), msg=n)
    opt.close()
    offload.close(model.get_base_model())


def test_merge_and_unload_of_lora_on_a_tied_base(tmp_path, no_leaks):
    """PEFT's merge tells tied embeddings from untied ones by data_ptr(), asked outside any
    forward: each parameter answers with an address of its own (tied ones share it), so the
    merge runs and keeps the tie, and its weights equal the merge in memory."""
    peft = pytest.importorskip("peft")
    config, base, path = _saved_llama(tmp_path, tie_word_embeddings=True)

    def merged(model):
        return _lora(peft, model, init_lora_weights=False).merge_and_unload()

    ref = merged(base)
    model = merged(_wrapped(transformers.LlamaForCausalLM, config, path, tmp_path, "swap"))
    try:
        assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
        got, want = offload.state_dict(model), ref.state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    finally:
        offload.close(model)


def test_lora_with_modules_to_save_on_a_base_read_in_place(tmp_path, no_leaks):
    """PEFT's modules_to_save deep-copies lm_head of the wrapped base: the copy is an ordinary
    module in memory and trains beside the adapters; losses, weights and the saved adapter
    file equal the same run in memory."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    config, base, path = _saved_llama(tmp_path)

    def lora(model):
        return _lora(peft, model, modules_to_save=["lm_head"], lora_dropout=0.0)

    ref, model = lora(base), lora(_wrapped(transformers.LlamaForCausalLM, config, path, tmp_path, "swap"))
    opts = [offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
            torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True)]
    losses = ([], [])
    for i in range(3):
        ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(i))
        for m, o, seen in zip((model, ref), opts, losses):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            seen.append(loss.item())
    opts[0].synchronize()
    assert losses[0] == losses[1]
    for name, m in (("got", model), ("want", ref)):
        m.save_pretrained(tmp_path / name)
    got, want = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("got", "want"))
    assert any("lm_head" in k for k in want) and got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    opts[0].close()
    offload.close(model.get_base_model())


def test_a_checkpoint_changed_under_the_model_is_refused_by_name(tmp_path, no_leaks):
    _, path = _saved(tmp_path)
    model = _wrapped(transformers.GPT2LMHeadModel, _gpt2_config(), path, tmp_path, "swap")
    ids = torch.randint(0, 211, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
        file = glob.glob(os.path.join(path, "*.safetensors"))[0]
        with open(file, "r+b") as fh:  # rewritten in place, as a save to the same file would
            fh.seek(0, os.SEEK_END)
            fh.write(b"\0" * 8)
        with pytest.raises(CheckpointChangedError, match=r"model\.safetensors.*changed"):
            model(input_ids=ids)
    offload.close(model)


def test_plan_and_setup_log_say_what_is_read_in_place(tmp_path, caplog):
    _, path = _saved(tmp_path)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(_gpt2_config())
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=str(tmp_path / "s"),
                                device_budget="256KiB", host_budget="64MiB", resident_bytes="4KiB")
    rows = {r.item: r for r in offload.plan(model, cfg, optimizer=None, checkpoint=path).rows}
    groups = [g for g in offload.params.device_layout(model, cfg).groups if not g.resident]
    streamed = sum(g.nbytes for g in groups)
    assert rows["parameters, read in place"].nbytes == sum(s.nbytes for g in groups for s in g.slots)  # (the tensors)
    assert rows["parameters, read in place"].tier == "checkpoint"
    assert "parameters, streamed" not in rows  # (nothing copied)
    assert offload.plan(model, cfg, optimizer=None, checkpoint=path).disk_need == 0
    training = offload.plan(model, cfg, checkpoint=path)
    moved = {r.item: r.nbytes for r in training.rows}["parameters copied on first write"]
    assert streamed <= moved <= streamed + 8192 * sum(len(g.slots) for g in groups)  # (buffers: the covering blocks)
    copying = {r.item: r for r in offload.plan(model, cfg.replace(read_in_place=False), checkpoint=path).rows}
    assert "parameters, read in place" not in copying and copying["parameters, streamed"].nbytes == sum(g.nbytes for g in groups)
    assert "copied from the checkpoint at wrap" in copying["parameters, streamed"].note
    assert "read_in_place=False" in copying["parameters, streamed"].note  # (which groups are copied, and why)
    with caplog.at_level("INFO", logger="offload"):
        offload.close(offload.wrap(model, cfg, checkpoint=path))
    assert "read in place from the checkpoint" in caplog.text


def test_load_state_dict_moves_the_groups_it_writes(tmp_path, no_leaks):
    _, path = _saved(tmp_path)
    before = _digests(path)
    torch.manual_seed(5)
    other = transformers.GPT2LMHeadModel(_gpt2_config()).eval()
    model = _wrapped(transformers.GPT2LMHeadModel, _gpt2_config(), path, tmp_path, "swap")
    model.load_state_dict(other.state_dict())
    store = offload.params.manager_of(model).store
    assert store.checkpoint_stats()["in_place_bytes"] == 0 and store.checkpoint_stats()["moved_bytes"] > 0
    ids = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, other(input_ids=ids).logits)
    offload.close(model)
    assert _digests(path) == before


def test_an_optimizer_counts_the_first_steps_copies_against_free_disk(tmp_path, monkeypatch, no_leaks):
    import offload._plan as plan

    _, path = _saved(tmp_path)
    model = _wrapped(transformers.GPT2LMHeadModel, _gpt2_config(), path, tmp_path, "swap", optimizer_tier="host")
    monkeypatch.setattr(plan, "free_disk_bytes", lambda _: 4096)  # (a full disk under nvme_path)
    try:
        with pytest.raises(offload.MemoryPlanError, match=r"the parameters its first step copies out of the "
                                                          r"checkpoint need .*train fewer parameters"):
            offload.AdamW(model.parameters(), lr=1e-3)
    finally:
        offload.close(model)


def test_groups_of_the_same_tensors_get_one_buffer_size(tmp_path, no_leaks):
    """Each layer's tensors sit at other offsets in the file (n_embd=120: sizes are not
    whole pages), so each layer's group needs other padding; they still get one size, or
    the pool would map new buffers every pass."""
    config = transformers.GPT2Config(n_layer=4, n_embd=120, n_head=4, vocab_size=211, n_positions=64)
    ref, path = _saved(tmp_path, build=lambda: transformers.GPT2LMHeadModel(config))
    model = _wrapped(transformers.GPT2LMHeadModel, config, path, tmp_path, "eq", device_budget="4MiB")
    try:
        sizes: dict[tuple, set] = {}
        for group in offload.params.manager_of(model).coordinator.groups:
            shapes = tuple((s.dtype, tuple(s.shape)) for s in group.slots)
            natural = max(s.offset + s.nbytes for s in group.slots)
            sizes.setdefault(shapes, {"given": set(), "natural": set()})
            sizes[shapes]["given"].add(group.nbytes)
            sizes[shapes]["natural"].add(natural)
            assert group.nbytes >= natural
        assert any(len(s["natural"]) > 1 for s in sizes.values())  # paddings do differ by layer
        assert all(len(s["given"]) == 1 for s in sizes.values())
        ids = torch.randint(0, 211, (1, 9), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    finally:
        offload.close(model)


def test_a_file_with_tensors_8_bytes_off_16_is_read_direct_into_aligned_places(disk_dir, no_leaks):
    """safetensors pads its header to 8 bytes, so about half of all files hold every tensor
    at an offset 8 bytes off a multiple of 16. Such tensors are read with O_DIRECT, as the
    blocks that cover them, 8 bytes past their place and moved down: every tensor 16-byte
    aligned, its read position agreeing with the file modulo 4 KiB, outputs bit for bit,
    and nothing read through the page cache but the file's last partial block."""
    from safetensors.torch import load_file, save_file

    tmp_path = pathlib.Path(disk_dir)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=211, n_positions=64)
    ref, path = _saved(tmp_path, build=lambda: transformers.GPT2LMHeadModel(config))
    (file,) = glob.glob(os.path.join(path, "*.safetensors"))
    tensors = load_file(file)
    for pad in range(16):  # (the header's length is what moves the data's start)
        save_file(tensors, file, metadata={"format": "pt", "pad": "x" * pad})
        with open(file, "rb") as fh:
            if (8 + int.from_bytes(fh.read(8), "little")) % 16 == 8:
                break
    else:
        pytest.fail("no header length put the tensors 8 bytes off 16")
    model = _wrapped(transformers.GPT2LMHeadModel, config, path, tmp_path, "off", device_budget="1MiB")
    try:
        manager = offload.params.manager_of(model)
        reader = offload.params.CheckpointReader(path, model)
        placed = [(slot, reader.entries[reader.name_of(slot)].start) for group in manager.coordinator.groups
                  if not group.resident for slot in group.slots]
        assert placed and all(start % 16 == 8 for _, start in placed)
        assert all(slot.offset % 16 == 0 and (slot.offset + 8 - start) % 4096 == 0 for slot, start in placed)
        ids = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
        stats = manager.store.checkpoint_stats()
        passes = stats["read_bytes"] / stats["in_place_bytes"]  # (each group read about once per forward)
        assert stats["buffered_read_bytes"] < (passes + 1) * 4096
    finally:
        offload.close(model)


def test_neighbouring_tensors_are_read_as_one_range(disk_dir, no_leaks):
    """A module's tensors lie next to each other in its file (safetensors sorts them by name):
    each group is read as one range, its small tensors (biases) with O_DIRECT beside the
    large ones, and nothing through the page cache but the file's last partial block. Bytes between
    two tensors that the model does not use (an ignored key the file holds) are read along
    when few, and split the group into two ranges when many; outputs bit for bit either way."""
    from safetensors.torch import load_file, save_file

    tmp_path = pathlib.Path(disk_dir)
    config = transformers.GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=211, n_positions=64)
    ref, path = _saved(tmp_path, build=lambda: transformers.GPT2LMHeadModel(config))
    (file,) = glob.glob(os.path.join(path, "*.safetensors"))
    tensors = load_file(file)
    # (keys GPT-2 ignores on load, "...attn.bias", sorting between c_attn's bias and weight)
    tensors["transformer.h.1.attn.c_attn.bias.old_attn.bias"] = torch.ones(1000)  # 4 KB: read along
    tensors["transformer.h.2.attn.c_attn.bias.old_attn.bias"] = torch.ones(100_000)  # 400 KB: two ranges
    save_file(tensors, file, metadata={"format": "pt"})
    model = _wrapped(transformers.GPT2LMHeadModel, config, path, tmp_path, "runs", device_budget="1MiB")
    try:
        manager = offload.params.manager_of(model)
        streamed = [g for g in manager.coordinator.groups if not g.resident]
        assert any(len(g.slots) > 1 for g in streamed)
        stats = manager.store.checkpoint_stats()
        assert stats["ranges"] == len(streamed) + 1  # (one range per group; h.2's c_attn split in two)
        ids = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
        stats = manager.store.checkpoint_stats()
        passes = stats["read_bytes"] / stats["in_place_bytes"]
        assert stats["buffered_read_bytes"] < (passes + 1) * 4096
    finally:
        offload.close(model)


class _Leaf(torch.nn.Module):
    """Parameters of the given dtypes and shapes; its forward notes each one's bytes and
    address as the forward sees them."""

    def __init__(self, prefix, specs):
        super().__init__()
        self.prefix = prefix
        for name, (dtype, shape) in specs.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))

    def forward(self, seen):
        for name, p in self.named_parameters():
            seen[f"{self.prefix}.{name}"] = (p.detach().clone(), p.data_ptr() % 16 if p.numel() else 0)
        return seen


class _Leaves(torch.nn.Module):
    def __init__(self, modules):
        super().__init__()
        self.mods = torch.nn.ModuleDict({k: _Leaf(f"mods.{k}", v) for k, v in modules.items()})

    def forward(self, seen):
        for leaf in self.mods.values():
            leaf(seen)
        return seen


def test_runs_keep_every_tensor_s_bytes_and_16_byte_alignment(disk_dir, no_leaks):
    """Layouts that split runs: data 8 bytes off 16 (every run shifted), fp16 tensors of odd
    length (the next tensor at another offset modulo 16), a tensor of no elements, a module
    whose tensors are far apart in its file and one split over two files. Each parameter
    holds the file's bytes at a 16-byte aligned address as its module's forward sees it."""
    from safetensors.torch import save_file

    f32, f16 = torch.float32, torch.float16
    modules = {"a": {"w": (f32, (64, 300)), "b": (f16, (7,)), "c": (f16, (9, 5)), "e": (f32, (0,))},
               "b": {"w": (f32, (40, 500)), "b": (f16, (3,)), "c": (f32, (17,))},
               "c": {"w": (f32, (128, 130)), "v": (f16, (33, 21))}}
    gen = torch.Generator().manual_seed(0)
    tensors = {f"mods.{m}.{n}": torch.randn(shape, generator=gen).to(dtype)
               for m, specs in modules.items() for n, (dtype, shape) in specs.items()}
    path = pathlib.Path(disk_dir) / "ckpt"
    path.mkdir()
    files = {"one.safetensors": [k for k in tensors if k != "mods.c.v"], "two.safetensors": ["mods.c.v"]}
    for name, keys in files.items():
        for pad in range(16):  # (the header's length puts the data 8 bytes off 16)
            save_file({k: tensors[k] for k in keys}, str(path / name), metadata={"pad": "x" * pad})
            with open(path / name, "rb") as fh:
                if (8 + int.from_bytes(fh.read(8), "little")) % 16 == 8:
                    break
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in files.items() for k in keys}}))
    with offload.init_empty_weights():
        model = _Leaves(modules)
    model = offload.wrap(model, offload.OffloadConfig(
        device="cpu", param_tier="nvme", nvme_path=str(pathlib.Path(disk_dir) / "swap"), device_budget="512KiB",
        host_budget="16MiB", resident_bytes=0), checkpoint=str(path))
    try:
        stats = offload.params.manager_of(model).store.checkpoint_stats()
        assert stats["in_place_bytes"] > 0 and stats["ranges"] > len(modules)  # (runs were split)
        for _ in range(2):  # (the second pass in buffers the pool reuses)
            with torch.no_grad():
                seen = model({})
            for key, want in tensors.items():
                got, misaligned = seen[key]
                assert misaligned == 0, key
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    finally:
        offload.close(model)
