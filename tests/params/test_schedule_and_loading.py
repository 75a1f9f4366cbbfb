"""The prefetch schedule as an event log, trace changes, loading from safetensors, errors."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch import nn

import offload
from offload.io import BudgetError

transformers = pytest.importorskip("transformers")


def cfg(tmp_path, **kw):
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="host", nvme_path=str(tmp_path / "nvme"),
                device_budget="256KiB", host_budget="16MiB", resident_bytes=0, file_size="4MiB", group_bytes=0,
                cache_bytes=0)
    args.update(kw)
    return offload.OffloadConfig(**args)


def deep_mlp(n=8, width=64):
    torch.manual_seed(0)
    layers = []
    for _ in range(n):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)  # each Linear: 64*64*4 + 64*4 bytes = 16.6 KiB


def test_after_the_first_step_group_k_plus_1_is_fetched_before_group_k_runs(tmp_path, no_leaks, record_schedule):
    model = deep_mlp()
    offload.wrap(model, cfg(tmp_path, device_budget="128KiB", prefetch_bytes="40KiB"))
    events = record_schedule(model)
    try:
        x = torch.randn(4, 64)
        for _ in range(3):  # step 1 records the order; 2 and 3 replay it
            model(x).sum().backward()
        last_step = max(i for i, ev in enumerate(events) if ev == ("acquire", "0", "forward"))
        ready = [(i, k) for i, (e, k, ph) in enumerate(events) if e == "ready" and i >= last_step]
        # layer 0's input needs no gradient: its backward (the weight's gradient, from its
        # input and output gradient) needs no weight, so it is not fetched again
        assert [k for _, k in ready] == [str(i) for i in range(0, 16, 2)] + [str(i) for i in range(14, 0, -2)]
        for (i, k), (j, nxt) in zip(ready, ready[1:]):
            if nxt == k:
                continue  # the last layer's backward follows its forward: kept, not fetched
            fetch = max(n for n, ev in enumerate(events[:j]) if ev[0] == "fetch" and ev[1] == nxt)
            assert events[fetch][2] == "prefetch" and fetch < i, (k, nxt, events[fetch], fetch, i)
        first_step = events.index(("acquire", "0", "forward"))
        second_step = events.index(("acquire", "0", "forward"), first_step + 1)
        assert not any(e == "fetch" and ph == "demand" for e, _, ph in events[second_step:])
        s = offload.stats(model)
        assert s["device_peak_bytes"] <= 128 << 10
    finally:
        offload.unwrap(model)


def test_the_first_passes_prefetch_in_the_modules_order(tmp_path, caplog, no_leaks, record_schedule):
    """No order is recorded before the first pass; the modules' registration order stands
    in for it, so only the first group is read on demand, in the first inference forward and
    in the first training step (whose backward departs from the guess at its end, layer 0's
    weight not being needed: silently, then recorded)."""
    for grad in (False, True):
        model = deep_mlp()
        (tmp_path / str(grad)).mkdir()
        offload.wrap(model, cfg(tmp_path / str(grad), device_budget="128KiB", prefetch_bytes="40KiB"))
        events = record_schedule(model)
        try:
            with caplog.at_level(logging.INFO, logger="offload"), torch.set_grad_enabled(grad):
                out = model(torch.randn(4, 64)).sum()
                if grad:
                    out.backward()
            demand = [k for e, k, ph in events if e == "fetch" and ph == "demand"]
            assert demand == ["0"], demand
            assert "changed" not in caplog.text and "re-recorded" not in caplog.text
        finally:
            offload.unwrap(model)


class _NormsRegisteredLast(nn.Module):
    """A Llama-like layer: its norm is registered after the projections but runs first."""

    def __init__(self):
        super().__init__()
        self.proj, self.mlp, self.norm = nn.Linear(64, 64), nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.proj(self.norm(x))))


def test_a_first_pass_that_runs_modules_before_their_place_keeps_prefetching(tmp_path, no_leaks, record_schedule):
    """The guessed order resyncs where a module runs before its registered place (the
    modules passed are read next and taken when they come): only the first group is read
    on demand, in inference and in the first training step. Before, the first departure
    gave the guess up and the rest of the pass was read on demand."""
    for grad in (False, True):
        model = nn.Sequential(*[_NormsRegisteredLast() for _ in range(6)])
        (tmp_path / str(grad)).mkdir()
        offload.wrap(model, cfg(tmp_path / str(grad), device_budget="128KiB", prefetch_bytes="40KiB"))
        events = record_schedule(model)
        try:
            with torch.set_grad_enabled(grad):
                out = model(torch.randn(4, 64)).sum()
                if grad:
                    out.backward()
            demand = [k for e, k, ph in events if e == "fetch" and ph == "demand"]
            assert demand == ["0.norm"], demand
        finally:
            offload.unwrap(model)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.out = (nn.Linear(32, 32) for _ in range(4))
        self.step = 0

    def forward(self, x):
        self.step += 1
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.c(x) if self.step >= 3 else self.b(x))  # another branch from step 3
        return self.out(x)


def test_changed_execution_order_falls_back_and_rerecords(tmp_path, caplog, no_leaks, record_schedule):
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    offload.wrap(model, cfg(tmp_path, device_budget="64KiB", prefetch_bytes="8KiB"))
    events = record_schedule(model)
    try:
        x = torch.randn(3, 32)
        with caplog.at_level(logging.INFO, logger="offload.params._schedule"):
            for step in range(5):
                mark = len(events)
                with torch.no_grad():
                    torch.testing.assert_close(model(x), ref(x))
                demand = [k for e, k, ph in events[mark:] if e == "fetch" and ph == "demand"]
                if step == 3:  # second pass of the new order: prefetched again
                    assert demand == []
        changes = [r for r in caplog.records if "changed" in r.message]
        assert len(changes) == 1 and "'nograd'" not in changes[0].message
    finally:
        offload.unwrap(model)


def _saved_gpt2(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=150, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path / "ckpt"
    model.save_pretrained(path, max_shard_size="60KB")
    return model, config, path


def test_meta_model_streams_a_sharded_checkpoint(tmp_path, no_leaks):
    ref, config, path = _saved_gpt2(tmp_path)
    assert (path / "model.safetensors.index.json").exists()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).eval()
    offload.wrap(model, cfg(tmp_path, device_budget="1MiB"), checkpoint=str(path))
    try:
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert model.lm_head.weight is model.transformer.wte.weight
    finally:
        offload.unwrap(model)


def test_llama_with_init_empty_weights_keeps_computed_buffers(tmp_path, no_leaks):
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=120)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path / "llama")
    with torch.device("meta"):
        broken = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"buffer .*inv_freq.* meta device .*init_empty_weights"):
        offload.wrap(broken, cfg(tmp_path, device_budget="1MiB"), checkpoint=str(tmp_path / "llama"))
    with offload.init_empty_weights():
        model = transformers.LlamaForCausalLM(config).eval()
    assert all(p.device.type == "meta" for p in model.parameters())
    offload.wrap(model, cfg(tmp_path, device_budget="1MiB"), checkpoint=str(tmp_path / "llama"))
    try:
        ids = torch.tensor([[7, 8, 9, 10]])
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    finally:
        offload.unwrap(model)


def test_checkpoint_that_does_not_match_lists_the_differences(tmp_path, no_leaks):
    _, config, path = _saved_gpt2(tmp_path)
    other = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=151, n_positions=32)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(other)
    with pytest.raises(ValueError) as info:
        offload.wrap(model, cfg(tmp_path), checkpoint=str(path))
    message = str(info.value)
    assert "missing keys" in message and "transformer.h.2" in message
    assert "shape mismatches" in message and "transformer.wte.weight" in message
    assert not list((tmp_path / "nvme").glob("offload-swap*")) if (tmp_path / "nvme").exists() else True


@pytest.mark.parametrize("fault", ["shifted", "dtype"])
def test_a_header_whose_offsets_do_not_tile_the_data_is_refused_by_name(tmp_path, fault, no_leaks):
    """A header safetensors itself refuses (a tensor's offsets moved onto its neighbour's
    bytes, or a dtype whose size does not match the byte range) is refused at wrap, naming
    the file and the tensor: read as given, the weights would be wrong with no error."""
    import struct

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    file = tmp_path / "gpt2" / "model.safetensors"
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    name = "transformer.h.0.mlp.c_fc.weight"
    if fault == "shifted":
        header[name]["data_offsets"] = [o + 8 for o in header[name]["data_offsets"]]
    else:
        header[name]["dtype"] = "F16"
    text = json.dumps(header, separators=(",", ":")).encode()
    file.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length:])
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    for in_place in (True, False):
        with pytest.raises(ValueError, match=r"model\.safetensors.* corrupt safetensors header: tensor"):
            offload.wrap(model, cfg(tmp_path, read_in_place=in_place), checkpoint=str(tmp_path / "gpt2"))


def test_a_base_model_reads_its_task_models_checkpoint(tmp_path, no_leaks):
    """LlamaModel given LlamaForCausalLM's checkpoint: its weights under the base prefix are
    read, the head left unread, as from_pretrained does; outputs equal from_pretrained's."""
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "causal")
    ref = transformers.LlamaModel.from_pretrained(tmp_path / "causal")
    with offload.init_empty_weights():
        model = transformers.LlamaModel(config)
    offload.wrap(model, cfg(tmp_path, device_budget="1MiB"), checkpoint=str(tmp_path / "causal"))
    try:
        ids = torch.tensor([[3, 1, 4, 1, 5]])
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)
    finally:
        offload.unwrap(model)
    with offload.init_empty_weights():  # (keys under the prefix that the model lacks are still refused)
        shallow = transformers.LlamaModel(transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected keys .*layers\.0"):
        offload.wrap(shallow, cfg(tmp_path, device_budget="1MiB"), checkpoint=str(tmp_path / "causal"))


def test_groups_kept_resident_across_passes_are_read_once(tmp_path, no_leaks):
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=32)).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    reads = {}
    for cache in (0, "auto"):
        m = copy.deepcopy(ref)
        (tmp_path / str(cache)).mkdir()
        offload.wrap(m, cfg(tmp_path / str(cache), device_budget="300KiB", prefetch_bytes="64KiB",
                            cache_bytes=cache))
        try:
            with torch.no_grad():
                m(input_ids=ids)  # records the order, picks what to keep
                before = offload.stats(m)["read_bytes"]
                for _ in range(3):
                    torch.testing.assert_close(m(input_ids=ids).logits, ref(input_ids=ids).logits)
            stats = offload.stats(m)
            reads[cache] = stats["read_bytes"] - before
            assert stats["device_peak_bytes"] <= 300 << 10
            coordinator = offload.params.manager_of(m).coordinator
            if cache == "auto":
                wte = next(g for g in coordinator.groups if g.key == "transformer.wte")
                assert wte in coordinator.cached  # used twice per pass (tied): kept first
        finally:
            offload.unwrap(m)
    assert reads["auto"] < reads[0] * 0.8, reads


def test_meta_model_without_checkpoint_is_refused(no_leaks, tmp_path):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device: pass checkpoint"):
        offload.wrap(model, cfg(tmp_path))


def test_device_budget_below_the_largest_group_names_it(tmp_path, no_leaks):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(256, 256))
    # the recommended budget counts the device tier's 4 KiB slots (it must run)
    with pytest.raises(BudgetError, match=r"group '1' \(257.00 KiB; 260.00 KiB in the device tier's slots\)"
                                          r".*device_budget >= 260.00 KiB"):
        offload.wrap(model, cfg(tmp_path, device_budget="100KiB"))
    # a byte short: both in bytes, where rounding would print the same figure twice
    with pytest.raises(BudgetError, match=r"device_budget 266239 bytes cannot .*device_budget >= 266240 bytes"):
        offload.wrap(model, cfg(tmp_path, device_budget=260 * 1024 - 1))
    assert not (tmp_path / "nvme").exists() or list((tmp_path / "nvme").iterdir()) == []


def test_host_tier_larger_than_host_budget_is_refused(tmp_path, no_leaks):
    model = nn.Linear(512, 512)  # 1 MiB
    with pytest.raises(BudgetError, match="param_tier='host' needs 1.00 MiB.*host_budget"):
        offload.wrap(model, cfg(tmp_path, param_tier="host", host_budget="512KiB", device_budget="2MiB"))
    two = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))  # 8.25 KiB, in two 8 KiB of whole pages
    with pytest.raises(BudgetError, match="param_tier='host' needs 16.00 KiB.*host_budget is 12.00 KiB"):
        offload.wrap(two, cfg(tmp_path, param_tier="host", host_budget="12KiB", device_budget="2MiB", resident_bytes=0))


def test_wrapping_twice_and_stats_of_unwrapped_are_clear(tmp_path, no_leaks):
    model = deep_mlp(2)
    offload.wrap(model, cfg(tmp_path))
    with pytest.raises(ValueError, match="already wrapped"):
        offload.wrap(model, cfg(tmp_path))
    offload.unwrap(model)
    with pytest.raises(ValueError, match="not wrapped"):
        offload.stats(model)
    offload.wrap(model, cfg(tmp_path))
    offload.close(model)  # (its parameters released: a forward says so, not some layer's shape error)
    with pytest.raises(RuntimeError, match=r"closed by offload.close\(\).*offload.unwrap"):
        model(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match=r"Linear was closed by offload.close\(\)"):
        model[0](torch.randn(2, 64))  # (a layer of it called alone)


def test_unwrap_closes_the_optimizers_over_the_model_and_torch_trains_on(tmp_path, caplog, no_leaks):
    """The optimizer's states and gradients live in the store unwrap releases: left open, its
    hooks took the next backward's gradients into a store that was gone (a KeyError). unwrap
    closes it, saying so; training goes on with a torch optimizer loaded from its state
    dict, as a model never wrapped would after the same step."""
    torch.manual_seed(0)
    ref = deep_mlp(2)
    model = copy.deepcopy(ref)
    offload.wrap(model, cfg(tmp_path))
    x = torch.randn(4, 64)
    opts = offload.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for m, opt in zip((model, ref), opts):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = opts[0].state_dict()
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.unwrap(model)
    assert opts[0].closed and "offload.unwrap closed the AdamW" in caplog.text
    with pytest.raises(RuntimeError, match="this AdamW is closed"):
        opts[0].step()
    after = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    after.load_state_dict(saved)
    for m, opt in zip((model, ref), (after, opts[1])):
        m(x).square().mean().backward()
        opt.step()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- config ----------------------------------------------------------------------------------
def test_config_from_json_and_validation(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"device": "cpu", "param_tier": "host", "optimizer_tier": "host",
                                "device_budget": "1GiB", "host_budget": 2 << 30}))
    c = offload.OffloadConfig.from_file(str(path))
    assert c.device_budget == 1 << 30 and c.host_budget == 2 << 30
    assert offload.OffloadConfig.from_file(path) == c  # a pathlib.Path as well
    assert offload.OffloadConfig(device="cpu", nvme_path=tmp_path, log_path=tmp_path / "l").nvme_path == str(tmp_path)
    assert c.prefetch_limit(1 << 30) == 64 << 20  # at least 64 MiB
    assert c.prefetch_limit(1 << 30, 32 << 20) == 128 << 20  # four typical groups
    assert c.prefetch_limit(1 << 30, 200 << 20) == 256 << 20  # at most 256 MiB
    assert c.prefetch_limit(48 << 20, 1 << 20) == 48 << 20  # the room the budget leaves
    assert c.replace(prefetch_bytes="1MiB").prefetch_limit(48 << 20) == 1 << 20  # as given
    path.write_text(json.dumps({"device": "cpu", "param_tiers": "host"}))
    with pytest.raises(ValueError, match=r"unknown keys \['param_tiers'\]"):
        offload.OffloadConfig.from_file(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        offload.OffloadConfig.from_file(str(path))
    with pytest.raises(ValueError, match="param_tier='ssd' is not a tier"):
        offload.OffloadConfig(device="cpu", param_tier="ssd")
    with pytest.raises(ValueError, match="device_budget='lots' is not a size"):
        offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host", device_budget="lots")
    with pytest.raises(ValueError, match="device_budget=-5 must be > 0"):
        offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host", device_budget=-5)
    with pytest.raises(ValueError, match="nvme_path is required"):
        offload.OffloadConfig(device="cpu", param_tier="nvme")
    with pytest.raises(ValueError, match="device='tpu' is not"):
        offload.OffloadConfig(device="tpu")


@pytest.mark.cuda
def test_cuda_forward_backward_match(tmp_path, no_leaks):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = deep_mlp(6, 256).cuda()
    ref = copy.deepcopy(model)
    offload.wrap(model, cfg(tmp_path, device="cuda", device_budget="1MiB"))
    try:
        x = torch.randn(8, 256, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the reference model and x
        model_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
        for _ in range(2):
            out, expected = model(x), ref(x)
            torch.testing.assert_close(out, expected)
            out.sum().backward()
            expected.sum().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
                p.grad = q.grad = None
        assert offload.stats(model)["device_peak_bytes"] <= 1 << 20
        # beyond the reference: the managed budget, both models' gradients (not budgeted
        # yet), and 1 MiB for activations of an 8x256 batch
        bound = (1 << 20) + 2 * model_bytes + (1 << 20)
        assert torch.cuda.max_memory_allocated() - base <= bound
    finally:
        offload.unwrap(model)


def test_init_empty_weights_skips_only_what_sets_a_meta_parameters_values():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            torch.nn.init.trunc_normal_(self.lin.weight, std=0.02)
            self.lin.bias.data.zero_()
            self.register_buffer("scale", torch.ones(3).mul_(2.0))
            self.register_buffer("table", torch.empty(5).uniform_(-1, 1))

    class Seen(torch.overrides.TorchFunctionMode):  # below init_empty_weights' own mode: sees what it lets run
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[str, str]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor):
                self.calls.append((getattr(func, "__name__", ""), target.device.type))
            return func(*args, **kwargs)

    torch.manual_seed(0)
    table = torch.empty(5).uniform_(-1, 1)
    torch.manual_seed(0)
    with Seen() as seen, offload.init_empty_weights():
        net = Net()
    ran = set(seen.calls)
    assert ("uniform_", "cpu") in ran and ("mul_", "cpu") in ran
    assert not {("trunc_normal_", "meta"), ("zero_", "meta"), ("kaiming_uniform_", "meta")} & ran
    assert [(n, p.device.type, p.shape, p.dtype, p.requires_grad) for n, p in net.named_parameters()] == [
        ("lin.weight", "meta", (4, 8), torch.float32, True), ("lin.bias", "meta", (4,), torch.float32, True)]
    torch.testing.assert_close(net.scale, torch.full((3,), 2.0), rtol=0, atol=0)  # real tensors: ops run
    torch.testing.assert_close(net.table, table, rtol=0, atol=0)  # and the meta ones drew nothing
    assert torch.empty(2).normal_().device.type == "cpu"  # the context is gone
