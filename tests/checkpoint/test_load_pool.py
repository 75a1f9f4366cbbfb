"""A load into a wrapped model gives its pool back whole: no buffer is left viewed when the
reader trims the pool (the reader's own views of the last buffer were, and the pool warned
of "a view of a weight kept past its module's forward")."""

from __future__ import annotations

import logging

import offload


def test_a_load_leaves_no_buffer_viewed(tmp_path, tiny_gpt2, lm_batches, offload_config, train, caplog):
    m = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "a"))
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    m2 = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "b"))
    opt2 = offload.AdamW(m2.parameters(), lr=1e-2)
    try:
        train(m, opt, lm_batches(211, steps=1))
        offload.save_checkpoint(str(tmp_path / "ckpt"), m, opt)
        with caplog.at_level(logging.DEBUG, logger="offload"):
            offload.load_checkpoint(str(tmp_path / "ckpt"), m2, opt2)
        assert not [r for r in caplog.records if "still viewed" in r.getMessage()]
    finally:
        for o, model in ((opt, m), (opt2, m2)):
            o.close()
            offload.unwrap(model)
