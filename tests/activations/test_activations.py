"""Activation offload (OffloadConfig.activation_tier): the same losses, gradients and weights
as the run that keeps its activations, bit for bit (only bytes move), within the budget, and
nothing left behind."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import offload
from offload.activations import ModifiedSavedTensorError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# every saved tensor moves: nothing kept in place, a window of one chunk
ALL_OUT = dict(activation_budget=0, activation_min_bytes=0, activation_prefetch="64KiB",
               activation_host_budget="256KiB")


def _t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=211, decoder_start_token_id=0,
        dropout_rate=0.0))


def _mamba():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=197,
                                                                  state_size=8, expand=2, conv_kernel=4))


def _build(arch, tiny_gpt2, tiny_llama, ckpt):
    model = {"gpt2": tiny_gpt2, "llama": tiny_llama, "t5": _t5, "mamba": _mamba}[arch]()
    if ckpt:
        model.gradient_checkpointing_enable()
    return model


def _run(model, cfg, batches, *, overlapped=False):
    """Three steps of two micro-batches; the losses, the last gradients and the weights."""
    offload.wrap(model, cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses, records = [], []
    for micro in batches:
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            if overlapped:
                with opt.update_during_backward():
                    loss.backward()
            else:
                loss.backward()
            losses.append(float(loss.detach()))
        grads = {} if overlapped else {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        records.append(offload.log_step(model))
        opt.zero_grad()
    stats = offload.stats(model)
    weights = {n: p.detach().clone() for n, p in offload.unwrap(model).named_parameters()}
    return losses, grads, weights, stats, records


@pytest.mark.parametrize("ckpt", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5", "mamba"])
def test_nvme_equals_the_run_that_keeps_activations(tmp_path, arch, ckpt, tiny_gpt2, tiny_llama, offload_config,
                                                    lm_batches):
    batches = lm_batches(197, steps=3)  # (the tiny Llama's vocabulary, the smallest)
    ref = _run(_build(arch, tiny_gpt2, tiny_llama, ckpt), offload_config(tmp_path / "a"), batches)
    got = _run(_build(arch, tiny_gpt2, tiny_llama, ckpt),
               offload_config(tmp_path / "b", activation_tier="nvme", **ALL_OUT), batches)
    assert got[0] == ref[0]
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=0)
    stats = got[3]
    assert stats["act_written_bytes"] > 0 and stats["act_read_bytes"] == stats["act_written_bytes"]
    assert stats["act_records"] == 0 and stats["act_held_bytes"] == 0 and stats["act_offloaded_bytes"] == 0


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "update_during_backward"])
def test_host_tier_and_update_during_backward(tmp_path, overlapped, tiny_gpt2, offload_config, lm_batches):
    batches = lm_batches(211, steps=3, micro=1 if overlapped else 2)  # (one backward per overlapped step)
    ref = _run(tiny_gpt2(), offload_config(tmp_path / "a"), batches, overlapped=overlapped)
    host = {**ALL_OUT, "activation_host_budget": "8MiB"}  # (where they rest: a forward's worth)
    got = _run(tiny_gpt2(), offload_config(tmp_path / "b", activation_tier="host", **host), batches,
               overlapped=overlapped)
    assert got[0] == ref[0]
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=0)
    assert got[3]["act_written_bytes"] > 0


def _saved_per_layer(model, ids) -> int:
    """The most bytes one transformer block (or everything outside the blocks: embeddings, head,
    loss) saves for backward, counted on the model without offload (distinct storages)."""
    where, seen, per = ["outside"], set(), {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            per[where[-1]] = per.get(where[-1], 0) + t.untyped_storage().nbytes()
        return t

    handles = []
    for name, block in model.transformer.h.named_children():
        handles.append(block.register_forward_pre_hook(lambda m, a, n=name: where.append(n)))
        handles.append(block.register_forward_hook(lambda m, a, o: (where.pop(), None)[1]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    for h in handles:
        h.remove()
    return max(per.values())


def test_held_bytes_stay_within_the_budget_plus_one_layer(tmp_path, tiny_gpt2, offload_config):
    """The most held in compute memory (in place, read back, read ahead) is at most the budget,
    the read-ahead window and what one layer saves (the largest block, or the head and loss)."""
    batch, seq, vocab, width = 4, 48, 211, 64
    budget, prefetch = 4 * batch * seq * width * 4, 64 << 10
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    layer = _saved_per_layer(tiny_gpt2(), ids)
    model = tiny_gpt2()
    cfg = offload_config(tmp_path, activation_tier="nvme", activation_budget=budget, activation_min_bytes=0,
                         activation_prefetch=prefetch, activation_host_budget="256KiB")
    offload.wrap(model, cfg)
    model(input_ids=ids, labels=ids).loss.backward()
    record = offload.log_step(model)
    assert record["act_written_bytes"] > 4 * budget  # (most of it moved)
    assert 0 < record["act_peak_bytes"] <= budget + prefetch + layer
    assert record["act_buffer_peak_bytes"] <= 256 << 10
    offload.close(model)


def test_no_grad_saves_nothing_and_an_interrupted_forward_leaves_nothing(tmp_path, tiny_gpt2, offload_config,
                                                                         lm_batches):
    model = tiny_gpt2()
    offload.wrap(model, offload_config(tmp_path, activation_tier="nvme", **ALL_OUT))
    ids = lm_batches(211, steps=1)[0][0]
    with torch.no_grad():
        model(input_ids=ids)
    assert offload.stats(model)["act_written_bytes"] == 0

    def fail(module, args, out):
        raise ValueError("stop here")

    handle = model.transformer.h[1].register_forward_hook(fail)
    with pytest.raises(ValueError, match="stop here"):
        model(input_ids=ids, labels=ids)
    handle.remove()
    gc.collect()
    stats = offload.stats(model)
    assert stats["act_written_bytes"] > 0  # some were saved before the failure...
    assert stats["act_records"] == 0 and stats["act_offloaded_bytes"] == 0  # ...and all released
    assert offload.params.manager_of(model).activations.store.keys() == []
    model(input_ids=ids, labels=ids).loss.backward()  # the next step runs as usual
    assert offload.stats(model)["act_records"] == 0
    offload.close(model)


class _Twice(torch.nn.Module):
    """A layer called twice in one graph, and an in-place change of a saved tensor when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x, modify=False):
        y = torch.tanh(self.inner(x))
        z = torch.tanh(self.inner(y))  # inner's weight and y saved a second time
        if modify:
            y.mul_(2)  # tanh saved y: backward must refuse
        return self.head(z + y)


def test_module_called_twice_and_a_modified_saved_tensor(tmp_path, offload_config):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    ref = _Twice()
    ref(x).square().sum().backward()
    model = offload.wrap(_Twice(), offload_config(tmp_path, activation_tier="nvme", **ALL_OUT))
    model(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(RuntimeError, match="modified by an inplace"):  # as torch without offload
        _Twice()(x, modify=True).sum().backward()
    with pytest.raises(ModifiedSavedTensorError, match="modified by an inplace"):  # changed after it moved
        model(x, modify=True).sum().backward()
    assert offload.stats(model)["act_written_bytes"] > 0
    offload.close(model)
    kept = offload.wrap(_Twice(), offload_config(tmp_path / "kept", activation_tier="nvme", activation_min_bytes=0))
    with pytest.raises(ModifiedSavedTensorError, match="modified by an inplace"):  # changed while kept in place
        kept(x, modify=True).sum().backward()
    offload.close(kept)


def test_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="activation_tier='disk' is not an activation tier"):
        offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host", activation_tier="disk")
    with pytest.raises(ValueError, match="nvme_path is required"):
        offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host", activation_tier="nvme")
    with pytest.raises(ValueError, match="activation_prefetch"):
        offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host", activation_tier="host",
                              activation_prefetch=0)
    host = dict(device="cpu", param_tier="host", optimizer_tier="host")
    assert offload.OffloadConfig(**host, activation_tier="host").activation_host_bytes() == 1 << 30
    assert offload.OffloadConfig(**host, activation_tier="nvme", nvme_path=str(tmp_path)).activation_host_bytes() == \
        64 << 20  # (write buffers only)
    assert offload.OffloadConfig(**host, activation_tier="host", activation_host_budget="3MiB").activation_host_bytes() \
        == 3 << 20


def test_plan_counts_offloaded_activations_and_refuses_a_small_host_tier(tmp_path, tiny_gpt2, offload_config):
    """With a batch, the plan leaves activation_budget (and the largest saved tensor with its
    gradient) in compute memory, puts the rest on NVMe, and refuses a host tier that cannot
    hold it, naming the settings."""
    with torch.device("meta"):
        model = tiny_gpt2()
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    kept = offload.plan(model, offload_config(tmp_path), batch=batch)
    assert not any(r.item.startswith("activations") for r in kept.rows)
    saved = kept.activations.saved_bytes
    budget = saved // 4
    nvme = offload.plan(model, offload_config(tmp_path, activation_tier="nvme", activation_budget=budget),
                        batch=batch)
    rows = {r.item: r for r in nvme.rows}
    assert rows["activations offloaded"].tier == "nvme" and rows["activations offloaded"].nbytes == saved - budget
    assert nvme.activation_bytes == kept.activations.batch_bytes + budget + 2 * kept.activations.largest_bytes \
        < kept.activation_bytes
    assert nvme.disk_need - kept.disk_need == saved - budget and nvme.fits
    host = offload.plan(model, offload_config(tmp_path, activation_tier="host", activation_budget=budget,
                                              activation_host_budget=(saved - budget) // 2), batch=batch)
    assert not host.fits
    assert any("activation_host_budget" in p and "activation_tier='nvme'" in p for p in host.problems)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "run", activation_tier="host", activation_budget=0,
                                                     activation_min_bytes=0, activation_host_budget="64KiB"))
    ids = torch.zeros(8, 64, dtype=torch.long)
    try:  # run anyway: the store's refusal names the activations' budget, not the model's host_budget
        refused = offload.activations.ActivationOffloadError
        with pytest.raises(refused, match=r"raise activation_host_budget \(") as info:
            model(input_ids=ids, labels=ids).loss.backward()
        assert "raise host_budget" not in str(info.value)
    finally:
        offload.close(model)


def _nodes(out, name):
    """The autograd nodes named ``name`` behind ``out``, in the order a walk meets them."""
    found, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            found.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return found


def test_retain_graph_saved_reads_and_close_with_a_live_graph(tmp_path, offload_config):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    ref = _Twice()
    ref_out = ref(x).square().sum()
    model = offload.wrap(_Twice(), offload_config(tmp_path, activation_tier="nvme", **ALL_OUT))
    out = model(x).square().sum()
    # a read outside backward gets a copy of what was saved; the record stays on NVMe
    want = [n._saved_result for n in _nodes(ref_out, "TanhBackward0")]
    got = [n._saved_result for n in _nodes(out, "TanhBackward0")]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert offload.stats(model)["act_offloaded_bytes"] > 0
    for o in (ref_out, out):  # twice through one graph: the gradients add up
        o.backward(retain_graph=True)
        o.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    live = model(x).square().sum()
    offload.close(model)
    with pytest.raises(offload.activations.ActivationOffloadError, match="closed"):
        live.backward()


def test_reentrant_checkpointing(tmp_path, tiny_gpt2, offload_config, lm_batches):
    def build():
        model = tiny_gpt2()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model

    batches = lm_batches(211, steps=2)
    ref = _run(build(), offload_config(tmp_path / "a"), batches)
    got = _run(build(), offload_config(tmp_path / "b", activation_tier="nvme", **ALL_OUT), batches)
    assert got[0] == ref[0] and got[3]["act_written_bytes"] > 0
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=0)


def test_devices_match_as_torch_names_them(monkeypatch):
    from types import SimpleNamespace

    from offload.activations import on_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    at = lambda name: SimpleNamespace(device=torch.device(name))  # noqa: E731
    assert on_device(at("cuda:1"), torch.device("cuda"))  # "cuda" is the current device
    assert not on_device(at("cuda:0"), torch.device("cuda"))
    assert on_device(at("cuda:0"), torch.device("cuda:0")) and not on_device(at("cpu"), torch.device("cuda:0"))
    assert on_device(at("cpu"), torch.device("cpu"))


def test_some_kept_some_moved_and_nothing_held_after_backward(tmp_path, tiny_gpt2, offload_config, lm_batches):
    """A budget that keeps part of a step in place: the same run as without offload; and
    right after each backward (before anything asks for stats) every record is released."""
    batches = lm_batches(211, steps=2)
    ref = _run(tiny_gpt2(), offload_config(tmp_path / "a"), batches)
    model = tiny_gpt2()
    cfg = offload_config(tmp_path / "b", activation_tier="nvme", activation_budget="96KiB", activation_min_bytes=0,
                         activation_prefetch="64KiB", activation_host_budget="256KiB")
    offload.wrap(model, cfg)
    offloader = offload.params.manager_of(model).activations
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for micro in batches:
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            assert offloader.counts.held_bytes > 0 and offloader.counts.offloaded_bytes > 0  # both kinds
            loss.backward()
            del loss
            assert offloader.counts.records == 0 and offloader.counts.held_bytes == 0  # (the end of backward)
            losses.append(None)
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in offload.unwrap(model).named_parameters()}
    torch.testing.assert_close(weights, ref[2], rtol=0, atol=0)


class _SavedTwice(torch.nn.Module):
    """tanh saves its output y, and the next matmul saves y again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
        self.storage = None

    def forward(self, x):
        y = torch.tanh(self.a(x))
        self.storage = weakref.ref(y.untyped_storage())  # (the test's window on y's memory)
        return self.b(y).sum()


def test_a_storage_saved_again_after_it_moved_is_not_held(tmp_path, offload_config):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    ref = _SavedTwice()
    ref(x).backward()
    model = offload.wrap(_SavedTwice(), offload_config(tmp_path, activation_tier="nvme", **ALL_OUT))
    loss = model(x)
    gc.collect()
    assert model.storage() is None  # moved once, saved twice, and its memory given back
    stats = offload.stats(model)
    assert stats["act_written_bytes"] == stats["act_offloaded_bytes"] > 0
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    offload.close(model)
