"""Models whose parameters belong to the root module: nn.Linear as the whole model, a module of
parameters alone used through F.linear, and a root whose own scale and bias wrap its children.
Each trains as plain PyTorch with AdamW does at stages 0-3 with and without offload, under
zero.Init too; the ways of reading the weights back (GatheredParameters, save_16bit_model,
zero_to_fp32) see the root's parameters."""

import copy

import pytest
import torch

import harness
import strata

STEPS = 3


def _ids(case):
    return case[0]


@pytest.mark.parametrize("case", harness.GRID, ids=_ids)
@pytest.mark.parametrize("model_name", harness.ROOT_PARAM_MODELS)
def test_matches_pytorch(model_name, case, tmp_path):
    cfg = harness.config_for(case, tmp_path / "nvme")
    want, _ = harness.train_reference(model_name, STEPS, accum=case[4], clip=case[5])
    assert want[-1] < want[0], f"the reference does not learn: {want}"
    got = harness.train_strata(model_name, cfg, STEPS)
    harness.assert_close(got, want)


@pytest.mark.parametrize("model_name", harness.ROOT_PARAM_MODELS)
def test_under_zero_init_with_nvme_matches_pytorch(model_name, tmp_path):
    case = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")
    cfg = harness.config_for(case, tmp_path / "nvme")
    want, _ = harness.train_reference(model_name, STEPS, accum=case[4], clip=case[5])
    torch.manual_seed(0)
    (tmp_path / "staged").mkdir()
    with strata.zero.Init(nvme_path=str(tmp_path / "staged")):
        model = harness.MODELS[model_name]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=copy.deepcopy(cfg))
    got = harness.run_steps(engine, model_name, 0, STEPS, case[4])
    engine.close()
    harness.assert_close(got, want)


def _trained(model_name, case, tmp_path, **zero_extra):
    cfg = harness.config_for(case, tmp_path / "nvme")
    cfg["zero_optimization"].update(zero_extra)
    torch.manual_seed(0)
    model = harness.MODELS[model_name]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=copy.deepcopy(cfg))
    harness.run_steps(engine, model_name, 0, STEPS, case[4])
    return engine


STAGE3_RELEASE = next(c for c in harness.GRID if c[0] == "stage3_cpu_release")


@pytest.mark.parametrize("model_name", harness.ROOT_PARAM_MODELS)
def test_gathered_parameters_show_and_write_the_masters(model_name, tmp_path):
    engine = _trained(model_name, STAGE3_RELEASE, tmp_path)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    masters = engine.master_parameters()
    with strata.zero.GatheredParameters(params):
        for p, m in zip(params, masters):
            assert torch.equal(p.detach().float(), m.view_as(p)), "gathered value != master"
    first = params[0]
    with strata.zero.GatheredParameters([first], modifier_rank=0):
        with torch.no_grad():
            first.fill_(0.25)
    assert torch.equal(engine.master_parameters()[0], torch.full_like(masters[0], 0.25))
    engine.close()


@pytest.mark.parametrize("model_name", harness.ROOT_PARAM_MODELS)
def test_save_16bit_model_holds_the_root_parameters(model_name, tmp_path):
    engine = _trained(model_name, STAGE3_RELEASE, tmp_path,
                      stage3_gather_16bit_weights_on_model_save=True)
    masters = engine.master_parameters()
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert engine.save_16bit_model(str(tmp_path / "out"), "model.bin")
    engine.close()
    state = torch.load(tmp_path / "out" / "model.bin")
    plain = harness.MODELS[model_name]()
    plain.load_state_dict(state, strict=True)
    for name, m in zip(names, masters):
        assert torch.equal(state[name].float(), m.view_as(state[name])), name


@pytest.mark.parametrize("model_name", harness.ROOT_PARAM_MODELS)
def test_zero_to_fp32_holds_the_root_parameters(model_name, tmp_path):
    from strata.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    case = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")
    engine = _trained(model_name, case, tmp_path)
    engine.save_checkpoint(tmp_path / "ck")
    masters = engine.master_parameters()
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    engine.close()
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ck")
    assert set(state) == set(harness.MODELS[model_name]().state_dict())
    for name, m in zip(names, masters):
        assert torch.equal(state[name], m.view_as(state[name])), name
