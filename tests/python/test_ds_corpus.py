"""Public DeepSpeed training scripts (tests/data/ds-scripts, sources in its SOURCES.md), run
unmodified through the `deepspeed` compatibility package and the `deepspeed` launcher, on the
CPU device, for a few steps. Downloads are replaced on this side only: tests/python/ds_corpus
(a sitecustomize) swaps torchvision's datasets for small fakes of the same shapes.

Each entry states what must happen:
  loss     exit 0 and at least one loss line of the script's own format, every value finite;
  runs     exit 0 and the script's own closing line (scripts that print no loss);
  loss_then_gpu
           the script trains on any device (its loss lines, finite), then calls CUDA directly
           after training (an evaluation on device `local_rank`): the loss lines, then that
           failure, named;
  runs_then_fails
           the script trains to its closing line, then fails where DeepSpeed fails too (a path
           of the author's machine): the pattern is (closing line, that failure);
  gpu      the script calls CUDA directly (torch.cuda.set_device, .cuda(), .to(local_rank)
           with an integer, NVML) before or while it trains: it cannot run on any CPU box,
           under DeepSpeed either, so it is skipped here and run where a GPU is lent
           (tools/scripts/gpu-check.sh test);
  fails    Strata lacks what it needs; the test asserts the first failure is the one recorded
           (so a fix shows up as a failing test to update, and a regression too).
"""

import math
import os
import re
import shutil
import subprocess

import pytest

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "data", "ds-scripts")
FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_corpus")
COMPAT = os.environ.get("STRATA_DS_COMPAT")
LOSS_LINE = r"LOSS: (\S+)"
LOCAL_RANK_DEVICE = ".to(model_engine.local_rank)"
LOSS_CIFAR = r"\[\s*\d+,\s*\d+\] loss:\s*(\S+)"

# (folder, ranks, fake samples, expectation, pattern, script and arguments)
SCRIPTS = [
    ("dse-cifar10", 2, 64, "loss", LOSS_CIFAR,
     "cifar10_deepspeed.py --epochs 1 --log-interval 1 --dtype fp32"),
    ("dse-cifar10", 1, 64, "loss", LOSS_CIFAR,
     "cifar10_deepspeed.py --epochs 1 --log-interval 1 --dtype bf16 --stage 3"),
    ("ds-sdma-zero3", 2, 0, "loss", r"step\s+\d+ \| loss (\S+) \|",
     "train_zero3.py --deepspeed --deepspeed_config ds_config_zero3.json --vocab_size 256 "
     "--hidden_size 64 --num_layers 2 --num_heads 4 --max_seq_len 32 --num_samples 16 "
     "--train_steps 3"),
    ("ds-mics", 1, 0, "loss", r"LOSS: (\S+)", "test_mics_config.py --mics_shard_size 1"),
    ("ds-stage3-zero-init", 1, 0, "runs", r"BEGINNING FORWARD", "stage3_test.py"),
    # fp16 configs: they train on the CPU device (python/strata/cpu_half.py).
    ("ds-test-model", 1, 0, "loss", LOSS_LINE, "test_model.py --zero 2"),
    ("ds-test-model-2021", 1, 0, "loss", LOSS_LINE, "test_model.py --zero 3"),
    ("ds-partial-offload", 1, 0, "loss", LOSS_LINE, "partial_offload_test.py --zero 3"),
    ("ds-qlinear-quant-grad", 1, 0, "loss", LOSS_LINE, "qlinear_test_model.py --zero 0"),
    # DeepSpeed's test_model.py reworked (ZeRO-3, fp16, torch_adam, data on model.device).
    ("hgt312-mlp-zero3", 1, 0, "loss", LOSS_LINE, "mlp_origin.py"),
    ("yyin-linear-regression", 1, 0, "loss", r"Epoch\s+\d+/30 \| Step\s+\d+ \| Loss: (\S+)",
     "train_ds.py"),
    # fp16 configs whose loops move each batch to CUDA.
    ("metaflow-hello", 1, 0, "gpu", ".cuda()", "hi-deepspeed.py"),
    ("tartrl-mnist", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "train.py --deepspeed --deepspeed_config ds_config.json --epochs 1 --dry-run"),
    ("azureml-nebula-cifar", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "cifar10_deepspeed.py --deepspeed --deepspeed_config ds_config.json"),
    ("azureml-autotuning-cifar", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "train.py --deepspeed --deepspeed_config ds_config.json --epochs 1 --with_aml_log ''"),
    ("alcf-mnist", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "mnist_ds.py --deepspeed --deepspeed_config ds_config.json --epochs 1 --log-interval 1"),
    ("learnds-cifar10-hjson", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "cifar10_deepspeed.py --deepspeed --deepspeed_config ds_config.json --epochs 1 "
     "--log-interval 1"),
    ("yqhu-cifar10-profiler", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "cifar10_deepspeed.py --deepspeed --deepspeed_config ds_config.json --log-interval 1"),
    ("yzr-zero-mnist", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "4zero/main.py --deepspeed_config 4zero/deeps.json"),
    ("kanesoban-cifar10-resnet50", 1, 64, "gpu", "nvmlInit()",
     "--module zero.cifar10.train_ds --deepspeed --deepspeed_config "
     "ds_configurations/cifar10/ds_config1.json --epochs 1"),
    # fp32, no argparse: the config path is fixed; it ignores the launcher's --local_rank.
    ("yyin-cifar10-cnn", 1, 64, "loss", r"Step\s+\d+ \| Loss: (\S+) \|", "cifar10_deepspeed.py"),
    ("cscfi-mnist", 1, 64, "gpu", LOCAL_RANK_DEVICE,
     "mnist_deepspeed.py --deepspeed --deepspeed_config ds_config.json --epochs 1"),
    ("learnds-pipeline-alexnet", 2, 256, "gpu", "torch.cuda.set_device",
     "train.py --deepspeed_config ds_config.json -p 2 --steps 2 --backend gloo"),
    ("dse-gan", 1, 64, "gpu", "torch.cuda.set_device",
     "gan_deepspeed_train.py --dataset cifar10 --dataroot ./data --deepspeed_config "
     "gan_deepspeed_config.json --epochs 1 --workers 0 --tensorboard_path ./runs"),
    # minGPT trains (bf16, ZeRO-2) on any device, then evaluates on device `local_rank` (0: CUDA).
    ("gaudi-mingpt-sort", 1, 0, "loss_then_gpu", r"iter \d+: train loss (\S+)",
     "demo_ds.py --deepspeed --deepspeed_config ds_config_zero2.json --steps 5 --log-interval 1"),
    # A deepspeed.pipe PipelineModule of two stages on two ranks (strata/pipe.py): it trains its
    # ten train_batch steps and prints its closing line, then saves its plot to the author's
    # absolute path (/public/home/...), where DeepSpeed fails too.
    ("yzr-pipeline-mnist", 2, 640, "runs_then_fails",
     (r"here it is!", r"No such file or directory: '/public/home/"),
     "1pipline/pip_test.py --deepspeed_config 1pipline/deeps.json"),
    # Environment-bound: wandb is not on this box; past it, DeepSpeed fails too (a batch of
    # 10080 = 280 x 36 GPUs).
    ("matsuolab-imagenet-resnet50", 1, 8, "fails", r"No module named '(wandb|box|yaml)'",
     "train.py --config configs/default.yaml --deepspeed --deepspeed_config configs/ds_config.json"),
    # torch.compile: torch 1.x has no torch._dynamo, and the script fails at import as under
    # DeepSpeed; on torch 2.x it reaches engine.compile, which Strata refuses by name.
    ("ds-torch-compile", 1, 0, "fails",
     r"module 'torch' has no attribute '_dynamo'|dynamo_output|engine\.compile: compiling the engine",
     "test_compile.py --deepspeed_config ds_config_z3.json"),
    ("dse-pipeline", 1, 64, "gpu", "torch.cuda.set_device",
     "train.py -p 0 -s 2 --backend gloo --deepspeed --deepspeed_config ds_config.json"),
    ("dse-mnist-2020", 1, 64, "gpu", ".to(model.local_rank)",
     "mnist.py --deepspeed --deepspeed_config ds_config.json --epochs 1"),
    ("dse-bf16-master-weight", 1, 0, "gpu", "torch.cuda.set_device",
     "train.py --deepspeed_config configs/baseline.json --hidden_dim 64 --num_layers 2 "
     "--num_heads 4 --vocab_size 1000 --seq_length 32 --num_steps 3 --warmup_steps 1 "
     "--log_interval 1"),
    # Its SGD config loads since Strata has SGD; it then moves every batch to `local_rank` (CUDA).
    ("alcf-resnet50", 1, 8, "gpu", ".to(model_engine.local_rank)",
     "resnet_ds.py data --deepspeed --deepspeed_config resnet_ds_config.json --steps 1 "
     "--log-interval 1"),
    ("dse-offload-states", 1, 0, "runs", r"Summary: pin_memory=False non_blocking=False",
     "offload_states.py --dtype torch.float32 --hidden_dim 64 --iteration 6 --warmup 1"),
    # Its zero_optimization.zenflow section is accepted without effect (a warning says so): the
    # benchmark's steps run as plain ZeRO-2 with cpu offload.
    ("dse-zenflow-bench", 1, 0, "runs", r"\[Summary\] pin_memory=False topk_ratio=0\.1",
     "zf_benchmark.py --pin_memory_opts 0 --topk_ratios 0.1 --update_intervals 2 "
     "--overlap_steps 0 --iteration 2 --hidden_dim 64 --dtype torch.float32"),
    # It takes no --local_rank, so it is launched with --no_local_rank (as with DeepSpeed's own
    # launcher, which passes --local_rank otherwise).
    ("dse-variable-batch-lr", 1, 0, "loss", r"epoch \d+, batch \d+, loss (\S+)",
     "--no_local_rank variable_batch_size_and_lr_example.py"),
    # fp32 linear regression with early stopping; it sets the lr through the optimizer's groups.
    ("yyin-linreg-enhanced", 1, 0, "loss", r"Step\s+\d+ \| Loss: (\S+) \| Grad Norm",
     "train_ds_enhanced.py"),
    # ResNet-50 on ImageFolder with a client SGD, tqdm's postfix as the loss line; validation
    # through the engine, then a torch.save of model and optimizer.
    ("dse-resnet-imagenet-2020", 1, 8, "loss", r"Train Epoch\s+#\d+:[^\r\n]*?, loss=([^,\]]+),",
     "resnet_deepspeed.py --train-dir data/train --val-dir data/val --deepspeed_config "
     "ds_config.json --epochs 1"),
    # DeepSpeed's small test model of 2020 with the flops profiler's early top-level keys (fp16).
    ("ds-test-model-flops-2020", 1, 0, "loss", LOSS_LINE, "test_model.py --zero 0 --flops_profiler True"),
    ("ds-test-model-flops-2020", 2, 0, "loss", LOSS_LINE, "test_model.py --zero 2 --flops_profiler True"),
    # ResNet-20 (fp16): `--cuda` turns CUDA off for training (store_false); its test pass after
    # the epoch calls .cuda() unconditionally.
    ("dse-compression-cifar", 1, 64, "loss_then_gpu", r"loss=(\S+?)\]",
     "train.py --deepspeed --deepspeed_config config/ds_config.json --batch-norm --epochs 1 "
     "--cuda --batch-size 16"),
]


def _id(entry):
    return f"{entry[0]}-{entry[1]}rank" + ("-" + entry[5].split()[-1] if entry[0] == "dse-cifar10"
                                           else "")


def _run(folder, ranks, fake, script_args, tmp_path):
    work = tmp_path / folder
    shutil.copytree(os.path.join(CORPUS, folder), work)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([FAKE, COMPAT, env.get("PYTHONPATH", "")])
    env["STRATA_FAKE_DATA"] = str(fake) if fake else ""
    env["PYTHONUNBUFFERED"] = "1"
    launcher = harness.deepspeed_command()
    cmd = f"{launcher} --num_gpus {ranks} {script_args}"
    # Each script runs in its own copy: several write files next to themselves or in ./data.
    proc = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


# What torch says when a script asks for CUDA on a box without it.
NO_CUDA = r"Torch not compiled with CUDA enabled|Cannot access accelerator device when none is available"


@pytest.mark.skipif(not COMPAT, reason="STRATA_DS_COMPAT (the deepspeed-compat folder) not set")
@pytest.mark.parametrize("entry", SCRIPTS, ids=_id)
def test_public_deepspeed_script(entry, tmp_path):
    folder, ranks, fake, expect, pattern, script_args = entry
    if expect == "gpu":
        args = script_args.split()
        script = next((a for a in args if a.endswith(".py")), None) or \
            args[args.index("--module") + 1].replace(".", "/") + ".py"
        source = open(os.path.join(CORPUS, folder, script), encoding="utf-8").read()
        assert pattern in source  # the CUDA call that keeps it off CPU boxes is really there
        pytest.skip(f"{folder} calls {pattern}: GPU only")
    if ranks > 1:
        from strata import _strata
        if not getattr(_strata, "have_gloo", True):
            pytest.skip("this build has no c10d Gloo: several CPU ranks cannot talk")
    code, out = _run(folder, ranks, fake, script_args, tmp_path)
    tail = out[-4000:]
    if expect in ("loss", "loss_then_gpu"):
        if expect == "loss":
            assert code == 0, tail
        else:
            # torch 1.x and 2.x say it in their own words.
            assert code != 0 and re.search(NO_CUDA, out), tail
        values = [m.group(1) for m in re.finditer(pattern, out, re.MULTILINE)]
        assert values, f"no loss line matching {pattern!r}:\n{tail}"
        losses = [float(v.strip(",")) for v in values]
        assert all(math.isfinite(v) for v in losses), losses
        if ranks > 1:
            assert "[rank 1]" in out, tail  # the launcher really started both ranks
    elif expect == "runs":
        assert code == 0, tail
        assert re.search(pattern, out, re.MULTILINE), tail
    elif expect == "runs_then_fails":
        assert code != 0, tail
        assert re.search(pattern[0], out, re.MULTILINE), tail
        assert re.search(pattern[1], out), tail
    elif expect == "fails":
        assert code != 0, tail
        assert re.search(pattern, out), tail


def test_corpus_counts(capsys):
    """Every folder of the corpus has an entry, and the share that runs is reported: a script
    trains when all its entries train (loss, runs, loss_then_gpu, runs_then_fails); scripts that call CUDA
    directly before they train are left out of the CPU share."""
    folders = {d for d in os.listdir(CORPUS) if os.path.isdir(os.path.join(CORPUS, d))}
    assert folders == {e[0] for e in SCRIPTS}, folders ^ {e[0] for e in SCRIPTS}
    kinds = {}
    for e in SCRIPTS:
        kinds.setdefault(e[0], set()).add(e[3])
    gpu = [f for f, k in kinds.items() if k == {"gpu"}]
    cpu = [f for f in kinds if f not in gpu]
    trained = [f for f in cpu if kinds[f] <= {"loss", "runs", "loss_then_gpu", "runs_then_fails"}]
    # SOURCES.md's third column; microsoft/X is deepspeedai/X (one repository, renamed).
    repos, sourced = set(), set()
    for line in open(os.path.join(CORPUS, "SOURCES.md"), encoding="utf-8"):
        cols = [c.strip() for c in line.split("|")]
        if len(cols) > 4 and cols[1] in folders:
            sourced.add(cols[1])
            repos.add(cols[3].lower().replace("microsoft/deepspeed", "deepspeedai/deepspeed"))
    with capsys.disabled():  # on the terminal (and in ctest's log) even when the test passes
        print(f"\ncorpus: {len(folders)} scripts from {len(repos)} repositories; {len(gpu)} "
              f"GPU-only; of the {len(cpu)} a CPU box can run, {len(trained)} train "
              f"({100 * len(trained) / len(cpu):.0f}%); failing: {sorted(set(cpu) - set(trained))}")
    assert sourced == folders, folders - sourced  # every folder's files have their source
    assert len(cpu) + len(gpu) == len(folders)
    assert len(trained) >= 0.9 * len(cpu), "fewer than 90 % of the CPU-runnable scripts train"

