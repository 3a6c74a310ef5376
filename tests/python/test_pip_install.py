"""The pip-installed packages, run by the pip pass of tools/scripts/test.sh (and `gpu-check.sh
pip`) with the venv's interpreter from outside the source tree: `strata` and `deepspeed` come
from the venv's site-packages, the commands are on its PATH, a small engine trains, the launcher
runs, the uninstall of `deepspeed` removes exactly its files, and a real DeepSpeed is never
replaced. Skipped unless STRATA_PIP_VENV names that venv (the pass sets it)."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

VENV = os.environ.get("STRATA_PIP_VENV")
pytestmark = pytest.mark.skipif(not VENV, reason="STRATA_PIP_VENV is not set: run by the pip pass")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = ("strata-train", "strata-launch", "strata-swapbench", "strata-estimate", "strata-tune")


def _site():
    return sysconfig.get_path("purelib")


def _scripts():
    return sysconfig.get_path("scripts")


def test_runs_in_the_venv_from_outside_the_tree():
    assert os.path.realpath(sys.prefix) == os.path.realpath(VENV), (sys.prefix, VENV)
    assert not os.path.realpath(os.getcwd()).startswith(os.path.realpath(ROOT) + os.sep)
    import strata
    import deepspeed
    for mod in (strata, deepspeed):
        assert os.path.realpath(mod.__file__).startswith(os.path.realpath(_site())), mod.__file__
    assert deepspeed.__version__ == importlib.metadata.version("deepspeed")


def test_the_tools_are_commands_of_the_venv():
    for tool in TOOLS + ("deepspeed",):
        path = shutil.which(tool, path=_scripts())
        assert path, f"{tool} is not in {_scripts()}"
    out = subprocess.run([os.path.join(_scripts(), "strata-estimate"), "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "strata-estimate" in out.stdout + out.stderr, out.stderr
    # Tests are not part of the wheel.
    files = [str(f) for f in importlib.metadata.files("strata")]
    assert not [f for f in files if "test" in os.path.basename(f).lower()], files
    assert any(f.startswith("strata/_strata") for f in files), files


def test_an_engine_trains_from_the_installed_package(tmp_path):
    import torch
    import strata
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "strata": {"device": "cpu"}}
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    assert losses[-1] < losses[0], losses


def test_the_deepspeed_launcher_runs_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse, os, deepspeed, torch\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', type=int, default=-1)\n"
        "deepspeed.add_config_arguments(p)\n"
        "a = p.parse_args()\n"
        "m = torch.nn.Linear(4, 2)\n"
        "e, _, _, _ = deepspeed.initialize(args=a, model=m, model_parameters=m.parameters(), config="
        "{'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}},"
        " 'strata': {'device': 'cpu'}})\n"
        "loss = e(torch.ones(2, 4)).sum(); e.backward(loss); e.step()\n"
        "print('RANK', os.environ.get('RANK'), 'STEPS', e.global_steps)\n")
    out = subprocess.run([os.path.join(_scripts(), "deepspeed"), "--num_gpus", "1", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "RANK 0 STEPS 1" in out.stdout, out.stdout


def test_a_real_deepspeed_is_not_replaced(tmp_path):
    # A venv holding a DeepSpeed that is not Strata's (its metadata, as pip installs it).
    venv = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = os.path.join(site, "deepspeed-0.19.6.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.6\n"
                "Summary: DeepSpeed library\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("deepspeed-0.19.6.dist-info/METADATA,,\ndeepspeed-0.19.6.dist-info/RECORD,,\n")
    pip = [py, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
           os.path.join(ROOT, "python")]
    out = subprocess.run(pip, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert "DeepSpeed 0.19.6 is installed" in out.stderr and "pip uninstall deepspeed" in out.stderr, \
        out.stderr[-3000:]
    assert os.path.isdir(info)  # untouched
    # Asked for explicitly, it takes the place.
    out = subprocess.run(pip, capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, STRATA_REPLACE_DEEPSPEED="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert not os.path.isdir(info)


def test_uninstalling_deepspeed_removes_its_files_and_keeps_strata(tmp_path):
    ds_files = [f.locate() for f in importlib.metadata.files("deepspeed")]
    strata_files = [f.locate() for f in importlib.metadata.files("strata")]
    launcher = os.path.join(_scripts(), "deepspeed")
    assert os.path.exists(launcher)
    pip = [sys.executable, "-m", "pip"]
    out = subprocess.run(pip + ["uninstall", "-y", "deepspeed"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    try:
        left = [str(f) for f in ds_files if os.path.exists(f) and not str(f).endswith(".pyc")]
        assert not left, left
        assert not os.path.exists(launcher)
        assert all(os.path.exists(f) for f in strata_files if not str(f).endswith(".pyc"))
        check = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                               text=True, cwd=tmp_path)
        assert check.returncode != 0
    finally:  # the venv keeps its deepspeed for whatever runs next
        subprocess.run(pip + ["install", "--no-build-isolation", "--no-deps", "--no-index",
                              os.path.join(ROOT, "python")], capture_output=True, check=True,
                       cwd=tmp_path)
    # What pip uninstall strata removes: every file it installed, the commands included.
    record = [str(f) for f in importlib.metadata.files("strata")]
    for tool in TOOLS:
        assert any(r.endswith("/" + tool) for r in record), (tool, record)
    print(json.dumps({"strata_files": len(record)}))
