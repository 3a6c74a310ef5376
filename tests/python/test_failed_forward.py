"""A forward that raises inside a unit (here: an input of the wrong dtype reaching the first
convolution) leaves the engine and its device usable: the unit's gathered parameters are
released, the same engine then trains exactly as plain PyTorch does, and closing it, or dropping
it without close, frees everything with no copy or kernel left reading freed memory. On a GPU
such a copy shows as an illegal address at the next CUDA call, which the end of each test makes
(torch.cuda.synchronize). A backward that autograd refuses (a second one through a freed graph)
is the caller's error, named as such, and the window it was in goes on as if it had not been
called."""

import copy
import gc
import threading

import pytest
import torch

import harness
import strata

CASES = [c for c in harness.GRID
         if c[0] in ("stage0", "stage2_cpu_clip", "stage3", "stage3_cpu_release",
                     "stage3_nvme_clip_accum")]


def _sync():
    if harness.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _engine(case, tmp_path):
    torch.manual_seed(0)
    model = harness.MODELS["vit"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=copy.deepcopy(harness.config_for(case, tmp_path / "nvme")))
    return engine


def _fail_once(engine):
    x, y = harness.batch("vit", 0)
    with pytest.raises(RuntimeError):
        harness.loss_of("vit", engine, x.to(torch.float64), y)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_training_after_a_failed_forward_matches_pytorch(case, tmp_path):
    want, _ = harness.train_reference("vit", 3, accum=case[4], clip=case[5])
    engine = _engine(case, tmp_path)
    _fail_once(engine)
    got = harness.run_steps(engine, "vit", 0, 3, case[4])
    engine.close()
    _sync()
    harness.assert_close(got, want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_training_after_a_failed_forward_of_the_model_itself_matches_pytorch(case, tmp_path):
    """The same failure with the model called directly, as DeepSpeed allows (its hooks are on the
    modules): nothing ends the units it opened (module hooks have no 'finally'), and every later
    forward was refused ("unit 'conv_proj' runs inside itself"). The next forward ends them."""
    want, _ = harness.train_reference("vit", 3, accum=case[4], clip=case[5])
    engine = _engine(case, tmp_path)
    x, y = harness.batch("vit", 0)
    with pytest.raises(RuntimeError):
        harness.loss_of("vit", engine.module, x.to(torch.float64), y)
    got = harness.run_steps(engine, "vit", 0, 3, case[4])
    engine.close()
    _sync()
    harness.assert_close(got, want)


class _CallsItself(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, depth=1):
        y = self.lin(x)
        return self(y, depth - 1) if depth > 0 else y


def test_a_unit_whose_forward_calls_itself_is_still_refused(tmp_path):
    """The recovery above ends a unit left open by a forward that is over; a module whose forward
    calls itself is still running, and stays refused (its unit cannot be gathered twice)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _CallsItself())
    cfg = harness.config_for(next(c for c in harness.GRID if c[0] == "stage3"), tmp_path / "nvme")
    engine, _, _, _ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    with pytest.raises(strata.StrataError, match="runs inside itself"):
        engine(torch.randn(2, 4)).sum()
    engine.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_an_engine_dropped_after_a_failed_forward_frees_cleanly(case, tmp_path):
    engine = _engine(case, tmp_path)
    _fail_once(engine)
    del engine
    gc.collect()
    _sync()
    # The device is healthy: a new engine on it trains.
    engine = _engine(case, tmp_path)
    losses = harness.run_steps(engine, "vit", 0, 2, case[4])
    engine.close()
    _sync()
    assert all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.parametrize("case", [c for c in harness.GRID if c[4] == 2], ids=lambda c: c[0])
def test_a_backward_autograd_refuses_is_named_and_the_window_goes_on(case, tmp_path):
    want, _ = harness.train_reference("gpt2", 3, accum=2, clip=case[5])
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=copy.deepcopy(cfg))
    first = 0.0
    for m in range(2):
        x, y = harness.batch("gpt2", m)
        loss = engine(x, targets=y)
        engine.backward(loss)
        if m == 0:
            # Mid-window, so not the engine's own "backward after the last micro-step" refusal;
            # after step(), so not the second backward of one micro-batch (Note [one backward]).
            engine.step()
            refused = ("FAILED_PRECONDITION: backward failed in autograd: Trying to backward "
                       "through the graph")
            with pytest.raises(strata.StrataError, match=refused):
                engine.backward(loss)
        engine.step()
        first += loss.item() / 2
    got = [first] + harness.run_steps(engine, "gpt2", 1, 2, 2)
    engine.close()
    _sync()
    harness.assert_close(got, want)


def _close_on_another_thread(engine):
    errors = []

    def close():
        try:
            engine.close()
        except strata.StrataError as e:
            errors.append(e)

    t = threading.Thread(target=close)
    t.start()
    t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("how", ["destroy", "close_from_a_thread"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_ending_the_engine_inside_its_backward_is_refused_and_training_goes_on(case, how,
                                                                              tmp_path):
    """destroy() from an autograd hook inside engine.backward(), or close() from another thread
    while backward runs, freed the engine under backward's frames (a segfault). It is refused,
    the backward fails naming why, the engine is untouched, and it then trains exactly as plain
    PyTorch does."""
    want, _ = harness.train_reference("vit", 3, accum=case[4], clip=case[5])
    engine = _engine(case, tmp_path)
    x, y = harness.batch("vit", 0)
    loss = harness.loss_of("vit", engine, x, y)
    end = engine.destroy if how == "destroy" else (lambda: _close_on_another_thread(engine))
    loss.register_hook(lambda grad: end())
    with pytest.raises(strata.StrataError, match="while a call into the engine runs"):
        engine.backward(loss)
    got = harness.run_steps(engine, "vit", 0, 3, case[4])
    engine.close()
    _sync()
    harness.assert_close(got, want)


class _Stop(Exception):
    """A script's own exception type."""


@pytest.mark.parametrize("raised", [_Stop, KeyboardInterrupt], ids=lambda t: t.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_a_hooks_own_exception_leaves_backward_as_itself(case, raised, tmp_path):
    """A hook that raised inside engine.backward() reached the caller as a StrataError holding
    the exception's text, which is empty for a KeyboardInterrupt(): Ctrl-C in a hook stopped being
    one, and a script's own exception type was lost. It now leaves as itself, as it does from
    plain loss.backward(), and the engine then trains exactly as plain PyTorch does."""
    want, _ = harness.train_reference("vit", 3, accum=case[4], clip=case[5])
    engine = _engine(case, tmp_path)
    x, y = harness.batch("vit", 0)
    loss = harness.loss_of("vit", engine, x, y)

    def hook(grad):
        raise raised()

    loss.register_hook(hook)
    with pytest.raises(raised) as info:
        engine.backward(loss)
    assert type(info.value) is raised
    got = harness.run_steps(engine, "vit", 0, 3, case[4])
    engine.close()
    _sync()
    harness.assert_close(got, want)
