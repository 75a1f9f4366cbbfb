"""The features users run, on an asynchronous device against the same model run without
offload on that device: the simulated one here (every run of the suite) and a real CUDA
device where there is one (``-m cuda``). One body per feature, so the CUDA run checks what
the simulated run checks.

Tolerances: on the simulated device the model computes with the CPU's kernels on both
sides, so losses agree to fp32 rounding. On CUDA the reference updates with torch's fused
CUDA AdamW and offload with the fused CPU kernel, so the trajectories part by a few units
in the last place each step (the existing CUDA tests' tolerances)."""

from __future__ import annotations

import math

import pytest
import torch

import offload

from .sim import simulated

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

LOSS_TOL = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=1e-5)}
WEIGHT_TOL = {"cpu": dict(rtol=1e-4, atol=1e-4), "cuda": dict(rtol=1e-3, atol=1e-4)}


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.cuda)])
def dev(request, no_leaks):
    """The device the test computes on: "cpu" run as the simulated asynchronous device, or
    "cuda" (skipped without one); after it, no thread or file is left behind."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        yield "cuda"
        return
    with simulated(seed=0):
        yield "cpu"


def _config(tmp_path, dev, **settings):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = dict(device=dev, param_tier="nvme", optimizer_tier="nvme", nvme_path=str(tmp_path / "swap"),
                device_budget="256KiB", host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB")
    args.update(settings)
    return offload.OffloadConfig(**args)


def _llama(**config):
    args = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=197, max_position_embeddings=64, tie_word_embeddings=False)
    args.update(config)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**args))


def _batches(dev, vocab, steps=4, micro=2):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, vocab, (2, 12), generator=g).to(dev) for _ in range(micro)] for _ in range(steps)]


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _adamw(params, offloaded, **kw):
    cls = offload.AdamW if offloaded else torch.optim.AdamW
    if not offloaded:
        kw["fused"] = True
    return cls(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)


def _clipped_run(model, opt, batches):
    """Two micro-batches a step, clipped at 0.5 on even steps (the norms are above it) and
    not on odd ones, a scheduler after each step, ``model.zero_grad()`` as Trainer does."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    losses, norms = [], []
    for step, micro in enumerate(batches):
        total = 0.0
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5 if step % 2 == 0 else 1e9)))
        opt.step()
        sched.step()
        model.zero_grad()
        losses.append(total)
    return losses, norms


def _assert_weights(model, ref, dev):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), msg=name, **WEIGHT_TOL[dev])


def test_clipped_training_with_split_parameters_and_decay_groups(tmp_path, dev):
    """The default path (the update in the next forward): shards small enough that most
    parameters straddle two, two parameter groups, accumulation, a clip that acts on some
    steps and not others; then the weights read outside the passes and a write there."""
    ref, model = _llama().to(dev), _llama()
    batches = _batches(dev, 197)
    want = _clipped_run(ref, _adamw(_groups(ref), False), batches)
    offload.wrap(model, _config(tmp_path, dev))
    opt = _adamw(_groups(model), True, shard_size=3000)
    try:
        assert sum(len(e.segments) > 1 for e in opt._book.entries.values()) >= 5
        got = _clipped_run(model, opt, batches)
        assert want[1][0] > 0.5 and want[1][2] > 0.5  # the clip acted
        torch.testing.assert_close(got[1], want[1], **LOSS_TOL[dev])
        torch.testing.assert_close(got[0], want[0], **LOSS_TOL[dev])
        head = model.lm_head.weight  # read outside forward: fetched on demand, the step applied
        assert head.device.type == dev
        torch.testing.assert_close(head.detach().cpu(), ref.lm_head.weight.detach().cpu(), **WEIGHT_TOL[dev])
        with torch.no_grad():
            for m in (model, ref):
                m.model.norm.weight.mul_(2.0)
            ids = batches[0][0]
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, **WEIGHT_TOL[dev])
        opt.synchronize()
        _assert_weights(model, ref, dev)
        state = offload.state_dict(model)
        for name, q in ref.state_dict().items():
            torch.testing.assert_close(state[name].cpu(), q.cpu(), msg=name, **WEIGHT_TOL[dev])
    finally:
        opt.close()
        offload.unwrap(model)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_fp16_overflow_and_scale_follow_grad_scaler(tmp_path, dev):
    """fp16 compute with dynamic loss scaling: the step whose loss is infinite is skipped and
    halves the scale, the others keep it, as torch.amp.GradScaler does on the same run."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(dev)
    ref = _Net().to(dev)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 16)
    want_scales, want_skipped = [], []
    for step in range(4):
        before = [p.detach().clone() for p in ref.parameters()]
        scaler.scale(ref(x).pow(2).mean() * (math.inf if step == 1 else 1.0)).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        want_skipped.append(all(torch.equal(a, b) for a, b in zip(before, ref.parameters())))
        want_scales.append(scaler.get_scale())
    model = offload.wrap(_Net(), _config(tmp_path, dev, compute_dtype="fp16", resident_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    try:
        scales, skipped = [], []
        for step in range(4):
            with torch.no_grad():
                before = model(x.half())
            loss = model(x.half()).float().pow(2).mean() * (math.inf if step == 1 else 1.0)
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                skipped.append(torch.equal(model(x.half()), before))
            scales.append(opt.loss_scale)
        assert scales == want_scales and skipped == want_skipped == [False, True, False, False]
        with torch.no_grad():  # fp16 compute against the fp32 reference: fp16's precision
            torch.testing.assert_close(model(x.half()).float(), ref(x), rtol=2e-2, atol=2e-2)
    finally:
        opt.close()
        offload.unwrap(model)


def test_bf16_compute_keeps_fp32_masters(tmp_path, dev):
    """bf16 forward and backward, fp32 masters updated from the model's fp32 values: the
    reference keeps fp32 masters by hand beside a bf16 copy of the model."""
    model = _llama()
    batches = _batches(dev, 197, steps=3)
    masters = [p.detach().clone().to(dev).requires_grad_(True) for p in model.parameters()]
    work = _llama().to(dev)
    for p in work.parameters():
        p.data = p.data.to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.05, fused=True)
    ref_losses = []
    for micro in batches:
        total = 0.0
        for ids in micro:
            loss = work(input_ids=ids, labels=ids).loss.float() / len(micro)
            loss.backward()
            total += float(loss.detach())
            for m, p in zip(masters, work.parameters()):
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, work.parameters()):
                p.copy_(m)
        ref_losses.append(total)
    offload.wrap(model, _config(tmp_path, dev, compute_dtype="bf16"))
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    try:
        losses = []
        for micro in batches:
            total = 0.0
            for ids in micro:
                loss = model(input_ids=ids, labels=ids).loss.float() / len(micro)
                loss.backward()
                total += float(loss.detach())
            opt.step()
            opt.zero_grad()
            losses.append(total)
        torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=2e-2)
        state = opt.state_dict()["state"]
        for i, m in enumerate(masters):
            got = state[i]["master_param"]
            assert got.dtype == torch.float32
            # bf16 kernels differ in the last bits, and Adam's first steps move an element by
            # lr whatever its gradient's size: where a near-zero gradient's sign differs (CUDA's
            # backward adds with atomics, in no fixed order), by 2 lr a step. So each element
            # within that, and 99.9% within a fifth of one step.
            torch.testing.assert_close(got.cpu(), m.detach().cpu(), rtol=0, atol=2e-2 * len(batches))
            assert (got.cpu() - m.detach().cpu()).abs().le(2e-3).float().mean().item() >= 0.999
    finally:
        opt.close()
        offload.unwrap(model)


def _saved(tmp_path, build, dtype, shards):
    model = build().to(dtype)
    path = str(tmp_path / "ckpt")
    model.save_pretrained(path, max_shard_size="60KB" if shards else "2GB")
    return model.eval(), path


def _from_checkpoint(model_cls, config, path, tmp_path, dev, name, **settings):
    with offload.init_empty_weights():
        model = model_cls(config)
    return offload.wrap(model, _config(tmp_path / name, dev, **settings), checkpoint=path).eval()


@pytest.mark.parametrize("dtype,shards", [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32-sharded", "bf16"])
def test_generation_from_a_checkpoint_read_in_place(tmp_path, dev, dtype, shards):
    """Weights served from the safetensors files (tied GPT-2 embedding; sharded fp32 and a
    single bf16 file): logits and greedy tokens equal the model loaded into memory."""
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref, path = _saved(tmp_path, lambda: transformers.GPT2LMHeadModel(config), dtype, shards)
    ref = ref.to(dev)
    settings = {"compute_dtype": "bf16"} if dtype is torch.bfloat16 else {}
    model = _from_checkpoint(transformers.GPT2LMHeadModel, config, path, tmp_path, dev, "gen", **settings)
    try:
        assert offload.params.manager_of(model).store.checkpoint_stats()["in_place_bytes"] > 0
        ids = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(1)).to(dev)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
            got = model.generate(ids[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0)
            want = ref.generate(ids[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert got.device.type == dev and got.tolist() == want.tolist()
    finally:
        offload.close(model)


def test_lora_on_a_base_read_in_place(tmp_path, dev):
    """PEFT's LoRA over a base served from its checkpoint: the adapters train as on the
    model in memory, the base is never copied."""
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    base, path = _saved(tmp_path, lambda: transformers.LlamaForCausalLM(config), torch.float32, False)

    def lora(m):
        torch.manual_seed(1)
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))

    ref = lora(base.to(dev).train())
    ref_opt = _adamw([p for p in ref.parameters() if p.requires_grad], False)
    model = lora(_from_checkpoint(transformers.LlamaForCausalLM, config, path, tmp_path, dev, "lora").train())
    opt = _adamw([p for p in model.parameters() if p.requires_grad], True)
    store = offload.params.manager_of(model.get_base_model()).store
    try:
        held = store.checkpoint_stats()["in_place_bytes"]
        for i in range(3):
            ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(i)).to(dev)
            got, want = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
            torch.testing.assert_close(got, want, **LOSS_TOL[dev])
            for loss, o in ((got, opt), (want, ref_opt)):
                loss.backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert held > 0 and store.checkpoint_stats()["in_place_bytes"] == held
        assert store.checkpoint_stats()["moved_bytes"] == 0
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if "lora" in n:
                torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), msg=n, **WEIGHT_TOL[dev])
    finally:
        opt.close()
        offload.close(model.get_base_model())


def test_trainer_with_its_defaults(tmp_path, dev):
    """HF Trainer on the device with its defaults (clipping at 1.0, its linear schedule over
    the optimizer given) and offload.AdamW, against Trainer with torch's AdamW over the model
    in memory: losses, gradient norms and weights."""
    g = torch.Generator().manual_seed(1)
    dataset = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 128, (12, 16), generator=g)]

    def run(offloaded):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        if offloaded:
            offload.wrap(model, _config(tmp_path / "run", dev))
        opt = _adamw(model.parameters(), offloaded)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / f"out{offloaded}"), max_steps=4,
                                              per_device_train_batch_size=2, logging_steps=1, report_to=[],
                                              use_cpu=dev == "cpu", seed=0, disable_tqdm=True,
                                              save_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, optimizers=(opt, None))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result = [h["loss"] for h in logs], [h["grad_norm"] for h in logs], offload.state_dict(model)
        if offloaded:
            opt.close()
            offload.unwrap(model)
        return result

    want, got = run(False), run(True)
    assert min(want[1]) > 1.0  # Trainer's clip acted at every step
    torch.testing.assert_close(got[0], want[0], **LOSS_TOL[dev])
    torch.testing.assert_close(got[1], want[1], **LOSS_TOL[dev])
    for name, q in want[2].items():
        torch.testing.assert_close(got[2][name].cpu(), q.cpu(), msg=name, **WEIGHT_TOL[dev])
