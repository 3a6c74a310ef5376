"""Shared pieces of the Python suite: the model zoo, the config grid, the batches, and the two
training loops compared everywhere - plain PyTorch with torch.optim.AdamW (the reference) and the
same model under strata.initialize."""

import copy
import os
import sys

import torch
import torchvision

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt2_model import GPT2  # noqa: E402

import strata  # noqa: E402

LR = 1e-3
WEIGHT_DECAY = 0.01

# Where the engines of these tests compute: what strata.device "auto" picks (CUDA where a GPU is,
# else the CPU device), or STRATA_TEST_DEVICE. Batches are made there and the plain-PyTorch
# reference runs there too, so that engine and reference run the same kernels.
DEVICE = torch.device(os.environ.get("STRATA_TEST_DEVICE") or
                      ("cuda" if torch.cuda.is_available() else "cpu"))
# The relative tolerance of the loss comparisons: the CPU's, and five times it on a GPU, whose
# Adam (Strata's kernel, torch's foreach AdamW) rounds in another order (as the C++ suite's
# kGpuToleranceFactor).
REL = 1e-5 if DEVICE.type == "cpu" else 5e-5


class KwargsNet(torch.nn.Module):
    """A model whose forward and whose units take keyword arguments and return dicts."""

    class Stage(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = torch.nn.Linear(d, d)
            self.norm = torch.nn.LayerNorm(d)

        def forward(self, x, *, scale=1.0, residual=None):
            y = self.norm(torch.tanh(self.lin(x)) * scale)
            return {"y": y if residual is None else y + residual, "aux": y.mean()}

    def __init__(self, d=24, classes=5):
        super().__init__()
        self.stages = torch.nn.ModuleDict({"a": self.Stage(d), "b": self.Stage(d)})
        self.out = torch.nn.Linear(d, classes)

    def forward(self, x, targets=None, *, scale=0.5):
        a = self.stages["a"](x, scale=scale)
        b = self.stages["b"](a["y"], scale=scale, residual=x)
        logits = self.out(b["y"])
        loss = torch.nn.functional.cross_entropy(logits, targets) + 0.1 * (a["aux"] + b["aux"])
        return {"loss": loss, "logits": logits}


class ParamsOnly(torch.nn.Module):
    """Every trainable tensor is the root's own Parameter, used through F.linear: no child module
    (matrix factorisation, logistic regression and many research models look like this)."""

    def __init__(self, d=8, h=16, classes=4):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(h, d) * 0.3)
        self.b1 = torch.nn.Parameter(torch.zeros(h))
        self.w2 = torch.nn.Parameter(torch.randn(classes, h) * 0.3)
        self.b2 = torch.nn.Parameter(torch.zeros(classes))

    def forward(self, x):
        h = torch.tanh(torch.nn.functional.linear(x, self.w1, self.b1))
        return torch.nn.functional.linear(h, self.w2, self.b2)


class RootAround(torch.nn.Module):
    """The root's own parameters used before its children (a learned input scale) and after them
    (an output bias)."""

    def __init__(self, d=8, h=16, classes=4):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(d))
        self.body = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Tanh(),
                                        torch.nn.Linear(h, classes))
        self.bias = torch.nn.Parameter(torch.zeros(classes))

    def forward(self, x):
        return self.body(x * self.scale) + self.bias


def launch_two_ranks(worker, args, tmp_path):
    """Runs tests/python/<worker> on two ranks under strata-launch with `args` after the output
    stem; returns each rank's JSON (<stem>.rank<R>.json)."""
    import json
    import subprocess
    launcher = os.path.join(os.environ.get("STRATA_BIN", ""), "strata-launch")
    if not os.path.exists(launcher):
        import pytest
        pytest.fail(f"strata-launch not found at {launcher}: run through ctest (it sets "
                    "STRATA_BIN) or export STRATA_BIN=<build>/bin")
    out = str(tmp_path / "losses")
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [launcher, "--nproc", "2", "--", sys.executable, os.path.join(here, worker),
           *[str(a) for a in args[:1]], out, *[str(a) for a in args[1:]]]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    ranks = []
    for r in range(2):
        with open(f"{out}.rank{r}.json", encoding="utf-8") as f:
            ranks.append(json.load(f))
    return ranks


def deepspeed_command():
    """The `deepspeed` command: the build's (STRATA_DS_COMPAT/bin) or, for the pip-installed
    distribution, the one in this interpreter's environment."""
    import sysconfig
    compat = os.environ.get("STRATA_DS_COMPAT", "")
    candidates = [os.path.join(compat, "bin", "deepspeed")] if compat else []
    for path in candidates + [os.path.join(sysconfig.get_path("scripts"), "deepspeed")]:
        if os.access(path, os.X_OK):
            return path
    import pytest
    pytest.fail(f"no deepspeed command in {compat}/bin or {sysconfig.get_path('scripts')}")


def have_gloo():
    """Whether this build can run CPU collectives across ranks (c10d Gloo)."""
    from strata import _strata
    return bool(getattr(_strata, "have_gloo", True))


def gpt2():
    return GPT2(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def resnet18():
    # zero_init_residual: each residual block starts as the identity. Without it a freshly
    # initialized resnet18 on micro-batches of 2 is chaotic enough that fp32 rounding differences
    # of one ulp in an update grow to 1e-4 of the loss within 5 steps, in any two Adam
    # implementations; with it both trajectories agree to 1e-7.
    return torchvision.models.resnet18(num_classes=10, zero_init_residual=True)


def vit():
    # vit_b_16's architecture, built small: 32x32 images in 8x8 patches, 2 layers of width 32.
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2,
                                                num_heads=2, hidden_dim=32, mlp_dim=64,
                                                num_classes=10)


def kwargs_net():
    return KwargsNet()


MODELS = {"gpt2": gpt2, "resnet18": resnet18, "vit": vit, "kwargs": kwargs_net,
          # Models whose parameters (all, or some) belong to the root module.
          "linear": lambda: torch.nn.Linear(8, 4), "params_only": ParamsOnly,
          "root_around": RootAround}
ROOT_PARAM_MODELS = ("linear", "params_only", "root_around")


def batch(model_name, step, rank=0, world=1, micro=2):
    """This rank's micro-batch of global batch `step` (world x micro samples)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = micro * world
    if model_name == "gpt2":
        t = torch.randint(0, 256, (n, 17), generator=g)
        x, y = t[:, :-1], t[:, 1:]
    elif model_name == "kwargs":
        x, y = torch.randn(n, 24, generator=g), torch.randint(0, 5, (n,), generator=g)
    elif model_name in ROOT_PARAM_MODELS:
        # A class the models can learn: which quarter of the range the first feature is in. One
        # batch for every step, so that three steps of these small models show them learning.
        g = torch.Generator().manual_seed(1000)
        x = torch.randn(n, 8, generator=g)
        y = torch.bucketize(x[:, 0], torch.tensor([-0.67, 0.0, 0.67]))
    else:
        side = 64 if model_name == "resnet18" else 32  # resnet: BatchNorm over more than 2 values in layer4
        x, y = torch.randn(n, 3, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)
    return (x[rank * micro:(rank + 1) * micro].to(DEVICE),
            y[rank * micro:(rank + 1) * micro].to(DEVICE))


def loss_of(model_name, model, x, y):
    if model_name == "gpt2":
        return model(x, targets=y)
    if model_name == "kwargs":
        return model(x, y, scale=0.5)["loss"]
    return torch.nn.functional.cross_entropy(model(x), y)


# Stages 0-3 x offload none/cpu/nvme, with clipping and accumulation in some (the C++ zoo's grid):
# (name, stage, offload_param, offload_optimizer, accumulation, clipping, keep_live)
GRID = [
    ("stage0", 0, "none", "none", 1, 0.0, True),
    ("stage1", 1, "none", "none", 1, 0.0, True),
    ("stage1_cpu", 1, "none", "cpu", 2, 0.0, True),
    ("stage1_nvme_clip", 1, "none", "nvme", 1, 1.0, True),
    ("stage2", 2, "none", "none", 2, 0.0, True),
    ("stage2_cpu_clip", 2, "none", "cpu", 1, 1.0, True),
    ("stage2_nvme", 2, "none", "nvme", 1, 0.0, True),
    ("stage3", 3, "none", "none", 1, 0.0, True),
    ("stage3_cpu_release", 3, "cpu", "cpu", 1, 0.0, False),
    ("stage3_nvme_clip_accum", 3, "nvme", "nvme", 2, 0.5, True),
]


def config_for(case, nvme_dir, micro=2, **extra):
    name, stage, param, optim, accum, clip, keep_live = case
    z = {"stage": stage,
         "offload_optimizer": {"device": optim},
         "offload_param": {"device": param}}
    if "nvme" in (param, optim):
        os.makedirs(nvme_dir, exist_ok=True)
        z["offload_optimizer"]["nvme_path"] = str(nvme_dir)
        z["offload_param"]["nvme_path"] = str(nvme_dir)
    if not keep_live:
        z["stage3_param_persistence_threshold"] = 0
        z["stage3_max_reuse_distance"] = 0
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
           "gradient_clipping": clip, "zero_optimization": z,
           # Small chunks: each unit's parameters lie in chunks of their own (and some chunks span
           # two units), so stage 3 really gathers and releases unit by unit.
           "strata": {"chunk_size": "16KiB"},
           "optimizer": {"type": "AdamW",
                         "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}}
    cfg.update(extra)
    return cfg


def reference_loop(model_name, model, opt, steps, accum=1, clip=0.0, world=1, micro=2,
                   sched=None, before_step=None):
    """Plain PyTorch's loop, the one every Python test compares with: per global step,
    before_step(step), `accum` micro-batches of the whole batch (every rank's), clipping,
    opt.step(), zero_grad(), then sched.step(). Returns the loss of each global batch."""
    model.to(DEVICE)  # in place: `opt` keeps stepping the same parameters
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        total = 0.0
        for m in range(accum):
            x, y = batch(model_name, step * accum + m, 0, 1, micro * world)
            loss = loss_of(model_name, model, x, y)
            (loss / accum).backward()
            total += loss.item() / accum
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
    return losses


def train_reference(model_name, steps, accum=1, clip=0.0, world=1, micro=2):
    """Plain PyTorch with AdamW: the loss of each global batch (mean over its micro-batches and
    ranks), and the trained model."""
    torch.manual_seed(0)
    model = MODELS[model_name]().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return reference_loop(model_name, model, opt, steps, accum, clip, world, micro), model


def train_with_optimizer(case, tmp_path, groups, steps, client=None, section=None, schedule=None):
    """The gpt2 model through strata.initialize for `steps` global steps under `case`, with its
    optimizer given either as a client object (client(groups(model)), the config's own optimizer
    section removed) or as the config's `section` with model_parameters=groups(model); an
    lr_scheduler when `schedule` is set. Returns the loss of each step."""
    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    cfg = config_for(case, tmp_path / "nvme")
    kwargs = {}
    if client is not None:
        del cfg["optimizer"]
        kwargs["optimizer"] = client(groups(model))
    else:
        cfg["optimizer"] = section
        kwargs["model_parameters"] = groups(model)
    if schedule:
        kwargs["lr_scheduler"] = schedule
    engine, _, _, _ = strata.initialize(model=model, config=copy.deepcopy(cfg), **kwargs)
    losses = run_steps(engine, "gpt2", 0, steps, case[4])
    engine.close()
    return losses


def run_steps(engine, model_name, first, count, accum=1, rank=0, world=1, micro=2):
    """Global steps first..first+count-1 through a Strata engine, `accum` micro-batches each;
    returns this rank's mean loss per step."""
    losses = []
    for step in range(first, first + count):
        total = 0.0
        for m in range(accum):
            x, y = batch(model_name, step * accum + m, rank, world, micro)
            loss = loss_of(model_name, engine, x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        losses.append(total)
    return losses


def train_strata(model_name, cfg, steps, rank=0, world=1, engine_out=None):
    """The same loop under strata.initialize; returns this rank's loss per global batch."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=copy.deepcopy(cfg))
    losses = run_steps(engine, model_name, 0, steps, cfg.get("gradient_accumulation_steps", 1),
                       rank, world, cfg["train_micro_batch_size_per_gpu"])
    if engine_out is not None:
        engine_out.append(engine)
    else:
        engine.close()
    return losses


def gpt2_on_this_rank(cfg, swap_folder, freeze=(), shift_frozen=0.0):
    """A rank worker's gpt2 (seed 0) under strata.initialize(config=cfg), with each nvme_path
    moved into a folder of this rank's own, <nvme_path>/<swap_folder>; returns (model, engine).
    The parameters named in `freeze` are frozen first, their values moved by `shift_frozen`."""
    import strata
    for section in ("offload_optimizer", "offload_param"):
        sub = cfg["zero_optimization"].get(section, {})
        if "nvme_path" in sub:
            sub["nvme_path"] = os.path.join(sub["nvme_path"], swap_folder)
            os.makedirs(sub["nvme_path"], exist_ok=True)
    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
            with torch.no_grad():
                p.add_(shift_frozen)
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=cfg)
    return model, engine


def full_states(model):
    """Each parameter's whole fp32 master and moments, by name, as lists: DeepSpeed's collective
    accessors (every rank calls it)."""
    from strata import param_state
    out = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}, "frozen": {}}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            out["frozen"][name] = p.detach().cpu().flatten().tolist()
            continue
        out["master"][name] = param_state.safe_get_full_fp32_param(p).cpu().flatten().tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = \
                param_state.safe_get_full_optimizer_state(p, key).cpu().flatten().tolist()
    return out


def without_key_bias(name, t):
    """`t`, the value of parameter `name` of the gpt2 model (flat or shaped), less the key third
    of an attention block's qkv bias. That bias adds the same q·b to every score of a query,
    which softmax cancels: its gradient is 0 in exact arithmetic and rounding noise in fp32, and
    Adam's m/sqrt(v) turns the noise into ±lr steps whose signs depend on summation order
    (machine- and BLAS-dependent). It cannot change the model's outputs, so an element-wise
    comparison with another implementation leaves it out; the query and value biases stay."""
    if not name.endswith("qkv.bias"):
        return t
    flat = t.reshape(-1)
    d = flat.numel() // 3
    return torch.cat([flat[:d], flat[2 * d:]])


def assert_close(got, want, rel=None, what="loss"):
    rel = REL if rel is None else rel
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"{what} {i}: strata {g!r} vs reference {w!r}"
