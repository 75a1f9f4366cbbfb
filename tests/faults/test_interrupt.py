"""Ctrl-C (KeyboardInterrupt) in the middle of a training step: in forward, in backward, in
the optimizer's pipelined update, and from a real SIGINT at arbitrary moments.

Afterwards the user either goes on (a notebook: the interrupted step is dropped and the
next ones match the reference run that never saw it) or closes: every file, descriptor
and thread is released, the checkpoint saved before is intact, and a second ``wrap`` in
the same process on the same ``nvme_path`` works.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch

import offload

pytestmark = pytest.mark.timeout(180)


def _ctrl_c(*_):
    raise KeyboardInterrupt


def interrupt_forward(model, opt):
    """In the second block's forward, after its parameters were fetched."""
    return model.transformer.h[1].register_forward_pre_hook(_ctrl_c)


def interrupt_backward(model, opt):
    """When backward reaches the first block (the later ones are done)."""
    return model.transformer.h[0].register_full_backward_pre_hook(_ctrl_c)


class _Handle:
    def __init__(self, undo):
        self.remove = undo


def interrupt_update(model, opt):
    """The second shard's update is interrupted: the first is already written back."""
    class Events(list):
        def append(self, event):
            super().append(event)
            if event == ("update_start", 1):
                raise KeyboardInterrupt
    opt.events = Events()

    def undo():
        opt.events = None
    return _Handle(undo)


WHERE = {"forward": interrupt_forward, "backward": interrupt_backward, "update": interrupt_update}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_interrupted_step_is_dropped_and_training_goes_on(tmp_path, where, reference, offload_run, batches, step,
                                                          assert_weights, close_all, assert_released, no_leaks):
    losses, weights = reference(4, skipped=1)
    model, opt = offload_run(tmp_path)
    try:
        ids = batches(4)
        got = [step(model, opt, ids[0])]
        handle = WHERE[where](model, opt)
        with pytest.raises(KeyboardInterrupt):
            step(model, opt, ids[1])
        handle.remove()
        opt.zero_grad()  # what a user does before the next step: drop the partial gradients
        got += [step(model, opt, x) for x in ids[2:]]
        torch.testing.assert_close(got, losses)
        assert_weights(model, weights)
    finally:
        close_all(model, opt)
    assert_released(tmp_path / "nvme")


@pytest.mark.parametrize("where", ["forward", "backward", "update"])
def test_interrupt_then_close_releases_everything_and_wrap_works_again(tmp_path, where, save_after, step, batches,
                                                                       close_all, assert_released, offload_run,
                                                                       resume_matches, no_leaks):
    model, opt, path = save_after(tmp_path)
    WHERE[where](model, opt)
    with pytest.raises(KeyboardInterrupt):
        step(model, opt, batches(3)[2])
        opt.synchronize()  # (the step's update runs in the next forward, or here)
    close_all(model, opt)
    assert_released(tmp_path / "nvme")
    assert not [t for t in threading.enumerate() if t.name.startswith("offload")]
    # the same directory, the same process: a new run from the checkpoint saved before
    model, opt = offload_run(tmp_path)
    try:
        offload.load_checkpoint(path, model, opt)
    finally:
        close_all(model, opt)
    assert_released(tmp_path / "nvme")
    resume_matches(tmp_path, path, done=2, total=4)


@pytest.mark.parametrize("io_backend", ["direct", "mmap"])
def test_real_sigint_at_arbitrary_moments(tmp_path, io_backend, step, offload_run, batches, close_all, assert_released,
                                          no_leaks):
    """SIGINT delivered by the kernel while the main thread computes, waits for a read or
    runs the optimizer: each time the step raises KeyboardInterrupt, the next step works or
    raises a clear error, and close() releases everything. The delays sweep a step in 16
    places (each run of the suite lands on other instructions: the test is a net)."""
    model, opt = offload_run(tmp_path, io_backend=io_backend)
    ids = batches(1)[0]
    started = time.perf_counter()
    step(model, opt, ids)
    duration = time.perf_counter() - started
    close_all(model, opt)
    interrupted = 0
    for i in range(16):
        model, opt = offload_run(tmp_path, io_backend=io_backend)
        step(model, opt, ids)  # the recorded order exists: prefetch is active
        delay = duration * (i + 0.5) / 16
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:
            # (inside the try: on two busy cores the timer can fire before start() returns)
            timer.start()
            for _ in range(200):  # far longer than the delay: the signal lands in a step
                step(model, opt, ids)
        except KeyboardInterrupt:
            interrupted += 1
            timer.join()
            # going on either works or says why it cannot: an update stopped half way, or
            # a parameter group whose write was cut short
            opt.zero_grad()
            try:
                step(model, opt, ids)
            except RuntimeError as err:
                assert re.search(r"previous step\(\) stopped after updating \d+ of \d+ shards.*load_checkpoint"
                                 r"|is lost.*interrupted", str(err)), err
        finally:
            timer.join()
            close_all(model, opt)
        assert_released(tmp_path / "nvme")
    assert interrupted == 16


def test_ctrl_c_inside_bookkeeping_is_held_back_until_it_is_consistent():
    """offload._signals: a SIGINT during a DEFER section is raised when the section ends;
    one during an ALLOW'd wait inside it is raised at once."""
    from offload._signals import DEFER, wait

    done = []
    with pytest.raises(KeyboardInterrupt):
        with DEFER:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler has run by now: it only recorded the signal
            done.append("section finished")
    assert done == ["section finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    cond = threading.Condition()
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with DEFER, cond:
            timer.start()
            wait(cond, 30)
    timer.join()
    assert time.monotonic() - started < 10  # the wait was interrupted, not served to its end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with DEFER:  # and nothing is left pending
        pass


def stop_an_update(model, opt, path, step, batches, **settings):
    """A new AdamW over the model (``settings`` added), the checkpoint at ``path`` loaded,
    then the third batch's update stopped between shards. Returns the optimizer, the
    (weights, optimizer state dict) loaded, and the batches."""
    opt = offload.AdamW(model.parameters(), lr=opt.defaults["lr"], weight_decay=opt.defaults["weight_decay"],
                        shard_size=16384, **settings)  # (takes over from the first one)
    offload.load_checkpoint(path, model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()
    ids = batches(4)
    handle = interrupt_update(model, opt)
    with pytest.raises(KeyboardInterrupt):
        step(model, opt, ids[2])
        opt.synchronize()
    handle.remove()
    return opt, saved, ids


@pytest.mark.parametrize("later", [True, False])
def test_weights_a_stopped_update_left_mixed_are_refused_until_a_load(tmp_path, later, save_after, step, batches,
                                                                      reference, assert_weights, close_all,
                                                                      no_leaks):
    """An update interrupted between shards (in the next forward, or inside step()) leaves
    weights partly from that step. The optimizer refused to go on, but the model's weights
    were read silently: a forward, model.state_dict(), offload.state_dict, export and unwrap
    gave the mix (a Ctrl-C handler that exports wrote a model of no step). Now every read
    is refused, naming the way out; a load mends them (a checkpoint, or the model's and
    the optimizer's state dicts), and the run then goes on as the reference."""
    model, opt, path = save_after(tmp_path)
    opt, saved, ids = stop_an_update(model, opt, path, step, batches, update_in_next_forward=later)
    try:
        for read in (lambda: model(input_ids=ids[0]), model.state_dict, lambda: offload.state_dict(model),
                     lambda: offload.export(model, str(tmp_path / "export")), lambda: offload.unwrap(model)):
            with pytest.raises(RuntimeError, match=r"weights may be a mix: the optimizer's previous step\(\) "
                                                   r"stopped after updating \d+ of \d+ shards.*load_checkpoint"):
                read()
        if later:
            offload.load_checkpoint(path, model, opt)
        else:  # (the model's state dict first, as Trainer and Accelerate load them: its writes go through)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            opt.zero_grad()  # (the interrupted step's gradients: torch's load_state_dict keeps p.grad too)
        losses, weights = reference(4)
        torch.testing.assert_close([step(model, opt, x) for x in ids[2:]], losses[2:])
        assert_weights(model, weights)
    finally:
        close_all(model, opt)


def test_only_a_load_of_the_weights_mends_them(tmp_path, save_after, step, batches, reference, assert_weights,
                                               close_all, no_leaks):
    """A load of the optimizer's states alone cleared the mark, and the mixed weights were
    read as if whole. Now the optimizer's load makes it step again, and the weights stay
    refused until a load writes every parameter the stopped step updates (strict=False with
    one missing is not enough; a load_checkpoint of the model alone is)."""
    model, opt, path = save_after(tmp_path)
    opt, (weights, state), ids = stop_an_update(model, opt, path, step, batches)
    mixed = r"weights may be a mix: the optimizer's previous step\(\) stopped"
    try:
        opt.load_state_dict(state)
        opt.zero_grad()
        with pytest.raises(RuntimeError, match=mixed):
            model.state_dict()
        some = dict(weights)
        del some[next(k for k in some if k.endswith("mlp.c_fc.weight"))]
        model.load_state_dict(some, strict=False)
        with pytest.raises(RuntimeError, match=mixed):
            model(input_ids=ids[0])
        offload.load_checkpoint(path, model)  # (the model alone: the optimizer was loaded above)
        losses, expected = reference(4)
        torch.testing.assert_close([step(model, opt, x) for x in ids[2:]], losses[2:])
        assert_weights(model, expected)
    finally:
        close_all(model, opt)


@pytest.mark.parametrize("where", ["save", "load"])
def test_ctrl_c_as_a_checkpoint_borrows_a_view_leaves_nothing_lent(tmp_path, monkeypatch, where, save_after, step,
                                                                   batches, reference, assert_weights, close_all,
                                                                   no_leaks):
    """A real SIGINT right after the checkpoint stream was handed a view of states resting
    in host memory (a save's borrow, a load's read in place), before it recorded the view:
    the view stayed lent, and a later load, unwrap or exit waited for ever (2 of 100 Ctrl-Cs
    in a trial). Now the two go together; everything after works, and the run goes on as
    the reference."""
    from offload.checkpoint import _stream

    model, opt, path = save_after(tmp_path, optimizer_tier="host")
    handed = []

    def sigint_after(lend):
        def lent(*args):
            out = lend(*args)
            if out is not None and not handed:
                handed.append(out)
                os.kill(os.getpid(), signal.SIGINT)  # (delivered at the next bytecode)
            return out
        return lent

    if where == "save":
        writer_init = _stream.BlobWriter.__init__

        def init(self, blobs, **kwargs):
            writer_init(self, blobs, **kwargs)
            for blob in blobs:
                blob.borrow = sigint_after(blob.borrow) if blob.borrow is not None else None
        monkeypatch.setattr(_stream.BlobWriter, "__init__", init)
    else:
        reader_run = _stream.BlobReader.run

        def run(self, items, total=0):
            items = list(items)
            for item in items:
                item.in_place = sigint_after(item.in_place) if item.in_place is not None else None
            return reader_run(self, items, total)
        monkeypatch.setattr(_stream.BlobReader, "run", run)
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "save":
                offload.save_checkpoint(str(tmp_path / "second"), model, opt)
            else:
                offload.load_checkpoint(path, model, opt)
        assert handed, "no view was handed out: the test did not reach its point"
        monkeypatch.undo()
        offload.load_checkpoint(path, model, opt)  # (waited for ever on the view still lent)
        offload.save_checkpoint(str(tmp_path / "third"), model, opt)
        ids = batches(4)
        losses, weights = reference(4)
        torch.testing.assert_close([step(model, opt, x) for x in ids[2:]], losses[2:])
        assert_weights(model, weights)
    finally:
        close_all(model, opt)


def test_a_stopped_load_of_the_optimizers_states_alone_leaves_the_weights_readable(tmp_path, monkeypatch,
                                                                                    save_after, step, batches,
                                                                                    reference, assert_weights,
                                                                                    close_all, no_leaks):
    """reset_state() and a load_state_dict() that takes no master weights write no weight:
    stopped half way, the optimizer refuses to step until a load, but the model's weights
    stay readable (they were marked, and since only a load of the weights mends a mark,
    a successful retry left every read refused)."""
    from offload.optim import _persist

    model, opt, path = save_after(tmp_path)
    state = opt.state_dict()
    real = _persist.scatter_state
    monkeypatch.setattr(_persist, "scatter_state", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.load_state_dict(state)
        model.state_dict()  # (readable)
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) stopped half way"):
            step(model, opt, batches(3)[2])
        monkeypatch.setattr(_persist, "scatter_state", real)
        opt.load_state_dict(state)
        opt.zero_grad()
        losses, weights = reference(4)
        torch.testing.assert_close([step(model, opt, x) for x in batches(4)[2:]], losses[2:])
        assert_weights(model, weights)
    finally:
        close_all(model, opt)
