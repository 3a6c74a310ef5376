"""strata.zero.Init: a model built inside it keeps about one module in anonymous memory (what the
OS reports as RssAnon), has exactly the values a normal build has - initialization passes at the
end of a constructor included - and trains exactly like it."""

import copy

import torch
import torchvision

import harness
import strata


def _rss_anon_mib():
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class Wide(torch.nn.Module):
    """16 Linear(2048, 2048): 256 MiB of fp32 weights, initialized again after construction."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048) for _ in range(16))
        for layer in self.layers:
            torch.nn.init.normal_(layer.weight, 0.0, 0.02)


def test_anonymous_memory_stays_near_one_module(tmp_path):
    before = _rss_anon_mib()
    with strata.zero.Init(nvme_path=str(tmp_path)) as init:
        staged = Wide()
    under_init = _rss_anon_mib() - before
    assert init.staged_params == 32 and init.staged_bytes >= 256 << 20
    # Every weight is really there: the post-construction init wrote through the mapping.
    stds = [float(l.weight.std()) for l in staged.layers]
    assert all(abs(s - 0.02) < 1e-3 for s in stds), stds
    del staged
    before = _rss_anon_mib()
    plain = Wide()
    normal = _rss_anon_mib() - before
    del plain
    # One layer is 16 MiB; the whole model 256 MiB.
    assert normal > 200, f"a normal build should show the model in RssAnon; got {normal:.1f} MiB"
    assert under_init < 40, f"zero.Init build added {under_init:.1f} MiB of anonymous memory"


def test_values_equal_a_normal_build_and_patches_are_removed(tmp_path):
    torch.manual_seed(0)
    want = torchvision.models.resnet18(zero_init_residual=True)  # kaiming init in ResNet.__init__
    original_init = torch.nn.Linear.__init__
    torch.manual_seed(0)
    with strata.zero.Init(nvme_path=str(tmp_path)):
        class Local(torch.nn.Module):  # defined inside the block: wrapped as it is created
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.full((4, 4), 3.0))
                self.w.data.mul_(2)  # a write after registration, before staging

        got = torchvision.models.resnet18(zero_init_residual=True)
        local = Local()
    for (name, a), b in zip(want.named_parameters(), got.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(local.w.detach(), torch.full((4, 4), 6.0))
    assert torch.nn.Linear.__init__ is original_init
    assert "__init_subclass__" not in torch.nn.Module.__dict__


def test_training_a_staged_model_equals_a_normal_one(tmp_path):
    case = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")
    cfg = harness.config_for(case, tmp_path / "nvme")
    want = harness.train_strata("gpt2", cfg, 3)
    torch.manual_seed(0)
    with strata.zero.Init(config_dict_or_path=cfg):
        model = harness.gpt2()
    engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    got = harness.run_steps(engine, "gpt2", 0, 3, accum=2)
    engine.close()
    assert got == want
