"""Fixtures of the interop tests: the tiny GPT-2 without dropout (a resumed run must see the
same randomness as an uninterrupted one), with 128 tokens and token 0 as bos and eos, token
batches, the weights of a model wrapped or not, and the runs compared: a Trainer run and an
Accelerate-prepared model, each with offload or without. Configs are tests/conftest.py's."""

from __future__ import annotations

import functools

import pytest
import torch

import offload


@pytest.fixture
def tiny_gpt2(tiny_gpt2):
    """tests/conftest.py's tiny GPT-2 with a vocabulary of 128 and token 0 as bos and eos."""
    return functools.partial(tiny_gpt2, vocab_size=128, bos_token_id=0, eos_token_id=0)


@pytest.fixture
def token_batches():
    """``token_batches(count, batch=2, seq=16, seed=1)``: ``count`` batches of token ids below 128."""
    def make(count: int, batch: int = 2, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(count)]
    return make


@pytest.fixture
def weights():
    """``weights(model)``: the model's weights as plain tensors, wrapped or not."""
    return offload.state_dict


@pytest.fixture
def trainer_run(tiny_gpt2, offload_config, token_batches, weights):
    """``trainer_run(path, offloaded, *, steps=4, resume=None, trainers_optimizer=False, **args)``:
    train with Trainer's defaults (clipping at 1.0 included), the model wrapped (swap in
    ``path/run``) with offload's AdamW or plain with torch's, output in ``path/offload`` or
    ``path/plain``; ``args`` go to TrainingArguments. The optimizer is given to Trainer, or
    with ``trainers_optimizer`` Trainer builds its own (its decay groups and schedule):
    offload's through ``optimizer_cls_and_kwargs``, or its default. Returns the logged losses
    and gradient norms, and the final weights."""
    transformers = pytest.importorskip("transformers")

    def run(tmp_path, offloaded: bool, *, steps=4, resume=None, trainers_optimizer=False, **args):
        model = tiny_gpt2()
        if offloaded:
            offload.wrap(model, offload_config(tmp_path / "run"))
        out = tmp_path / ("offload" if offloaded else "plain")
        training = transformers.TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
                                                  logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                                  disable_tqdm=True, **args)
        dataset = [{"input_ids": ids[0], "labels": ids[0].clone()} for ids in token_batches(16, batch=1)]
        if trainers_optimizer:
            settings = dict(lr=training.learning_rate, betas=(training.adam_beta1, training.adam_beta2),
                            eps=training.adam_epsilon)
            chosen = dict(optimizer_cls_and_kwargs=(offload.AdamW, settings)) if offloaded else {}
        else:
            opt = (offload.AdamW(model.parameters(), lr=1e-3, eps=1e-6) if offloaded else
                   torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, fused=True))
            chosen = dict(optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))))
        trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset, **chosen)
        trainer.train(resume_from_checkpoint=resume)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result = [h["loss"] for h in logs], [h["grad_norm"] for h in logs], weights(model)
        if offloaded:
            getattr(trainer.optimizer, "optimizer", trainer.optimizer).close()  # (Accelerate's wrapper around it)
            offload.unwrap(model)
        return result
    return run


@pytest.fixture
def accelerate_build(tiny_gpt2, offload_config):
    """``accelerate_build(path, offloaded)`` -> (accelerator, model, prepared optimizer,
    optimizer): the model wrapped (swap under ``path``) with offload's AdamW, or plain with
    torch's, through ``Accelerator(cpu=True).prepare``."""
    accelerate = pytest.importorskip("accelerate")

    def build(tmp_path, offloaded: bool):
        model = tiny_gpt2()
        if offloaded:
            offload.wrap(model, offload_config(tmp_path))
            opt = offload.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, fused=True)
        accelerator = accelerate.Accelerator(cpu=True)
        model, prepared = accelerator.prepare(model, opt)
        return accelerator, model, prepared, opt
    return build
