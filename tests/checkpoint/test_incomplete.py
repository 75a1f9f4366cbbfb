"""An offload checkpoint's optimizer state is whole or refused: a manifest without a step
count, a row or part of one fails to load, naming the parameter; the legitimate gaps load
(rows that differ between param groups, a parameter of no elements)."""

from __future__ import annotations

import json

import pytest
import torch

import offload


def read(path):
    with open(path) as fh:
        return json.load(fh)


@pytest.mark.parametrize("edit", ["step", "row", "piece", "row everywhere"])
def test_a_manifest_without_part_of_the_optimizer_state_is_refused(saved, edit):
    """A step count, a whole row (of one parameter, or of every parameter of the group), or the
    last piece of a row gone from the manifest (edited by hand, or damaged): the load refuses, naming the parameter, rather than starting that
    parameter's Adam at step 0 or leaving its rows as the load's scratch held them."""
    path, m, opt = saved
    manifest = read(path / "manifest.json")
    name = "transformer.h.0.mlp.c_fc.weight"
    if edit == "step":
        del manifest["optimizer"]["state"][name]
    else:
        rows = [e for e in manifest["tensors"] if e.get("row") == "exp_avg_sq"
                and (e.get("name") == name or edit == "row everywhere")]
        if edit == "piece":  # a row cut in two pieces, the second dropped
            first = dict(rows[0], numel=rows[0]["numel"] // 2)
            manifest["tensors"][manifest["tensors"].index(rows[0])] = first
        else:
            manifest["tensors"] = [e for e in manifest["tensors"] if e not in rows]
    manifest.pop("manifest_crc32")  # (a manifest written so, not edited after: its own checksum would refuse that)
    with open(path / "manifest.json", "w") as fh:
        json.dump(manifest, fh)
    what = {"step": "has no step count", "row": "exp_avg_sq is missing", "piece": "exp_avg_sq covers 8192 of its 16384",
            "row everywhere": "exp_avg_sq is missing"}[edit]
    where = name if edit != "row everywhere" else ""  # (then every parameter lacks it: the first is named)
    with pytest.raises(offload.CheckpointError, match=f"corrupt manifest: .*{where}.*{what}"):
        offload.load_checkpoint(str(path), m, opt)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_param_groups_with_different_rows_and_an_empty_parameter_load(tmp_path, kind, tiny_gpt2, lm_batches,
                                                                      offload_config, train):
    """SGD with momentum in one group and none in the other, AdamW with amsgrad in one group:
    each group has its own rows; a parameter of no elements has nothing saved. All load, and
    the states are the saved ones."""
    def build(where):
        model = tiny_gpt2()
        model.transformer.h[0].empty = torch.nn.Parameter(torch.zeros(0))
        m = offload.wrap(model, offload_config(tmp_path / where, param_tier="nvme", optimizer_tier="nvme"))
        decay = [p for n, p in m.named_parameters() if n.startswith("transformer.h.")]
        rest = [p for n, p in m.named_parameters() if not n.startswith("transformer.h.")]
        if kind == "sgd":
            return m, offload.SGD([{"params": decay, "momentum": 0.9}, {"params": rest, "momentum": 0.0}], lr=1e-2)
        return m, offload.AdamW([{"params": decay, "amsgrad": True}, {"params": rest}], lr=1e-2)

    m, opt = build("a")
    m2, opt2 = build("b")
    try:
        train(m, opt, lm_batches(211, steps=1))
        offload.save_checkpoint(str(tmp_path / "ckpt"), m, opt)
        offload.load_checkpoint(str(tmp_path / "ckpt"), m2, opt2)
        want, got = opt.state_dict()["state"], opt2.state_dict()["state"]
        assert want.keys() == got.keys()
        for i in want:
            for key, value in want[i].items():
                torch.testing.assert_close(got[i][key], value, rtol=0, atol=0)
    finally:
        for o, model in ((opt, m), (opt2, m2)):
            o.close()
            offload.unwrap(model)
