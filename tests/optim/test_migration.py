"""Optimizer state migration, both ways: a torch optimizer's state_dict loaded into the
offload optimizer of the same name continues torch's trajectory, and the reverse."""

from __future__ import annotations

import pytest
import torch

import offload

KINDS = {
    # several param groups with different settings each
    "adamw": (torch.optim.AdamW, offload.AdamW,
              [dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), dict(lr=5e-3, weight_decay=0.0, amsgrad=True)]),
    "adam": (torch.optim.Adam, offload.Adam, [dict(lr=1e-2, weight_decay=0.01), dict(lr=5e-3)]),
    "sgd": (torch.optim.SGD, offload.SGD,
            [dict(lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=0.01),
             dict(lr=2e-2, momentum=0.8, nesterov=True)]),
}


def groups(model, settings):
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.dim() >= 2]
    rest = [p for n, p in named if p.dim() < 2]
    return [dict(params=matrices, **settings[0]), dict(params=rest, **settings[1])]


def torch_opt(cls, model, settings):
    return cls(groups(model, settings), **({"fused": True} if cls is not torch.optim.SGD else {}))


@pytest.mark.parametrize("kind", list(KINDS))
def test_torch_state_into_offload(tmp_path, kind, lm_batches, tiny_gpt2, train, offload_config, assert_same_weights,
                                  no_leaks):
    torch_cls, offload_cls, settings = KINDS[kind]
    first, rest = lm_batches(211, steps=2), lm_batches(211, steps=3)[1:]
    ref = tiny_gpt2()
    ref_opt = torch_opt(torch_cls, ref, settings)
    train(ref, ref_opt, first)
    model = tiny_gpt2()
    model.load_state_dict(ref.state_dict())
    offload.wrap(model, offload_config(tmp_path))
    opt = offload_cls(groups(model, settings))
    opt.load_state_dict(ref_opt.state_dict())
    torch.testing.assert_close(train(model, opt, rest), train(ref, ref_opt, rest))
    assert_same_weights(model, ref)
    assert_same_states(opt.state_dict(), ref_opt.state_dict())
    opt.close()
    offload.unwrap(model)


@pytest.mark.parametrize("kind", list(KINDS))
def test_offload_state_into_torch(tmp_path, kind, lm_batches, tiny_gpt2, offload_config, train, assert_same_weights,
                                  no_leaks):
    torch_cls, offload_cls, settings = KINDS[kind]
    first, rest = lm_batches(211, steps=2), lm_batches(211, steps=3)[1:]
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    opt = offload_cls(groups(model, settings))
    train(model, opt, first)
    ref = tiny_gpt2()
    ref.load_state_dict(offload.state_dict(model))
    ref_opt = torch_opt(torch_cls, ref, settings)
    ref_opt.load_state_dict(opt.state_dict())
    torch.testing.assert_close(train(ref, ref_opt, rest), train(model, opt, rest))
    assert_same_weights(model, ref)
    opt.close()
    offload.unwrap(model)


def assert_same_states(got: dict, want: dict) -> None:
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                torch.testing.assert_close(got["state"][i][key], value, rtol=1e-4, atol=1e-6, msg=f"{i} {key}")
            else:
                assert float(got["state"][i][key]) == float(value), (i, key)
    for g, w in zip(got["param_groups"], want["param_groups"]):
        for key in ("lr", "weight_decay"):
            assert g[key] == w[key]


def test_settings_that_change_the_states_are_refused_and_decoupled_decay_followed(tmp_path, tiny_gpt2, train,
                                                                                  lm_batches, offload_config,
                                                                                  assert_same_weights, no_leaks):
    ref = tiny_gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, amsgrad=True)
    train(ref, ref_opt, lm_batches(211, steps=1))
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="amsgrad=True, this optimizer amsgrad=False"):
        opt.load_state_dict(ref_opt.state_dict())
    opt.close()
    # torch's Adam with decoupled_weight_decay=True is AdamW; so is offload's
    ref = tiny_gpt2()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, fused=True)
    opt = offload.Adam(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    batches = lm_batches(211, steps=2)
    torch.testing.assert_close(train(model, opt, batches), train(ref, ref_opt, batches))
    assert_same_weights(model, ref)
    opt.close()
    offload.unwrap(model)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_optimizer_built_before_wrap(tmp_path, kind, lm_batches, tiny_gpt2, train, offload_config,
                                        assert_same_weights, no_leaks):
    """The optimizer built over the plain model, then the model wrapped: SGD's first step
    was refused ('a copy ... taken before the parameter changed'), its updates written one
    parameter at a time into copies the previous write had made stale. Now every kind runs
    torch's trajectory."""
    torch_cls, offload_cls, settings = KINDS[kind]
    ref, model = tiny_gpt2(), tiny_gpt2()
    batches = lm_batches(211, steps=3, micro=1)
    train(ref, torch_opt(torch_cls, ref, settings), batches)
    opt = offload_cls(groups(model, settings))
    offload.wrap(model, offload_config(tmp_path, param_tier="host", optimizer_tier="host", resident_bytes=0))
    try:
        train(model, opt, batches)
    finally:
        opt.close()
        offload.unwrap(model)
    assert_same_weights(model, ref, rtol=0, atol=0)
