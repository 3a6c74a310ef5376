"""strata.zero.Init: a model built inside it keeps about one module in anonymous memory (what the
OS reports as RssAnon), has exactly the values a normal build has - initialization passes at the
end of a constructor included - and trains exactly like it. Built in bf16 (a bf16 master's
default, or DeepSpeed's dtype argument), its staging file is half the size and it trains as a
normal model holding the same values. On two ranks only rank 0 stages, and rank 1 holds its
parameters over a scratch region, yet both train exactly as a normal build."""

import copy
import json
import os
import re
import subprocess

import pytest
import torch
import torchvision

import harness
import strata
from strata import _strata


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


def _bf16_master_config(nvme_dir):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir)},
                                  "offload_optimizer": {"device": "cpu"}}}


def _staging_file_bytes(directory):
    """The bytes the file system has allocated to the open (unlinked) staging file in
    `directory`."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith("(deleted)"):
            return os.fstat(int(fd)).st_blocks * 512
    raise AssertionError(f"no open staging file in {directory}")


def _linears():
    # Each weight is initialized by its own Linear's constructor, nothing after it.
    return torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))


def test_a_bf16_master_config_stages_bf16_in_half_the_file(tmp_path):
    cfg = _bf16_master_config(tmp_path / "bf16")
    torch.manual_seed(0)
    want = _linears()
    numel = sum(p.numel() for p in want.parameters())
    allocated = {}
    for name, kwargs in (("fp32", {"nvme_path": str(tmp_path / "fp32")}),
                         ("bf16", {"config_dict_or_path": cfg})):
        os.makedirs(tmp_path / name, exist_ok=True)
        torch.manual_seed(0)
        with strata.zero.Init(**kwargs) as init:
            got = _linears()
            allocated[name] = _staging_file_bytes(tmp_path / name)
        assert init.staged_bytes == numel * (2 if name == "bf16" else 4), name
    assert init.dtype == torch.bfloat16
    # What the OS allocated: half, less one page of alignment per parameter.
    assert allocated["bf16"] <= allocated["fp32"] / 2 + 8 * 4096, allocated
    # A constructor's own initialization is fp32 rounded to nearest, as the engine would round it.
    for (name, a), b in zip(want.named_parameters(), got.parameters()):
        assert b.dtype == torch.bfloat16, name
        assert torch.equal(a.detach().bfloat16(), b.detach()), name


def test_a_bf16_staged_model_trains_as_a_normal_one_with_its_values(tmp_path):
    cfg = _bf16_master_config(tmp_path)
    torch.manual_seed(0)
    with strata.zero.Init(config_dict_or_path=cfg):
        staged = harness.gpt2()
    # _linear's normal_ ran on the bf16 weights after Linear's constructor, as under DeepSpeed:
    # different draws from an fp32 build, the same distribution.
    assert {p.dtype for p in staged.parameters()} == {torch.bfloat16}
    assert abs(float(staged.blocks[0].fc.weight.float().std()) - 0.02) < 2e-3
    plain = harness.gpt2()
    plain.load_state_dict({k: v.detach().clone() for k, v in staged.state_dict().items()})
    losses = []
    for model in (staged, plain):
        engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
        losses.append(harness.run_steps(engine, "gpt2", 0, 3))
        engine.close()
    assert losses[0] == losses[1]


def test_dtype_is_deepspeeds_argument(tmp_path):
    # An fp32 config with dtype=torch.bfloat16: the fp32 master starts from the bf16 values.
    case = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")
    cfg = harness.config_for(case, tmp_path / "nvme")
    torch.manual_seed(0)
    with strata.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16) as init:
        staged = harness.gpt2()
    assert init.dtype == torch.bfloat16
    assert {p.dtype for p in staged.parameters()} == {torch.bfloat16}
    plain = harness.gpt2()
    plain.load_state_dict({k: v.detach().clone() for k, v in staged.state_dict().items()})
    losses = []
    for model in (staged, plain):
        engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
        losses.append(harness.run_steps(engine, "gpt2", 0, 3, accum=2))
        engine.close()
    assert losses[0] == losses[1]
    with strata.zero.Init(nvme_path=str(tmp_path), dtype=torch.float16):
        half = _linears()
    assert {p.dtype for p in half.parameters()} == {torch.float16}


def test_the_default_dtype_follows_the_master_and_bad_ones_are_refused(tmp_path):
    def dtype_for(cfg):
        return strata.zero.Init(config_dict_or_path=cfg, nvme_path=str(tmp_path)).dtype

    assert dtype_for({}) == torch.float32
    # bf16 compute with an fp32 master: built in fp32, so the master starts exact.
    assert dtype_for({"bf16": {"enabled": True}}) == torch.float32
    assert dtype_for({"bf16": {"enabled": "auto", "bf16_master_weights_and_grads": True}}) == torch.float32
    assert dtype_for({"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": True}}) == torch.bfloat16
    for bad in (torch.float64, torch.int8, "bf16"):
        with pytest.raises(strata.InvalidArgumentError, match=r"dtype=.*torch\.bfloat16"):
            strata.zero.Init(nvme_path=str(tmp_path), dtype=bad)


def test_a_released_parameter_gives_its_staging_space_back(tmp_path):
    with strata.zero.Init(nvme_path=str(tmp_path)):
        model = Wide()  # 16 weights of 16 MiB
    full = _staging_file_bytes(tmp_path)  # the Init is closed; the mappings keep the file open
    assert full >= 256 << 20
    for layer in model.layers[:8]:
        layer.weight.data = torch.zeros(1)  # what the engine's re-pointing does to a mapping
    after = _staging_file_bytes(tmp_path)
    assert after <= full - (128 << 20), (full, after)
    assert all(abs(float(l.weight.std()) - 0.02) < 1e-3 for l in model.layers[8:])
    del model, layer  # the loop's variable holds the last released layer (and its bias)
    with pytest.raises(AssertionError, match="no open staging file"):
        _staging_file_bytes(tmp_path)


def test_the_staging_file_is_gone_once_the_engine_has_the_model(tmp_path):
    case = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")
    cfg = harness.config_for(case, tmp_path / "nvme")
    with strata.zero.Init(config_dict_or_path=cfg):
        model = harness.gpt2()
    assert _staging_file_bytes(tmp_path / "nvme") > 0
    engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    with pytest.raises(AssertionError, match="no open staging file"):
        _staging_file_bytes(tmp_path / "nvme")
    assert os.listdir(tmp_path / "nvme") == ["strata-rank0.swap"]
    engine.close()
    assert os.listdir(tmp_path / "nvme") == []  # the engine's swap file goes with it


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
def test_only_rank_0_stages_and_every_rank_starts_from_its_values(tmp_path):
    ranks = harness.launch_two_ranks("zero_init_rank_worker.py", [tmp_path], tmp_path)
    r0, r1 = ranks
    # Rank 0 holds the 256 MiB model in its staging file; rank 1 holds no file and, of its
    # memory, the 32 MiB scratch region, where a normal build holds the model.
    assert r0["staging_bytes"] >= 256 << 20 and r0["staged_bytes"] >= 256 << 20
    assert r1["staging_bytes"] == 0 and r1["staged_bytes"] == 0
    assert r1["pss_growth_mib"] < 48, r1
    assert r1["plain_pss_growth_mib"] > 200, r1
    for r in ranks:
        assert r["shapes"] == [[2048], [2048, 2048]]
    # A block without a modifier reads rank 0's values on every rank; modifier_rank=1 keeps
    # rank 1's writes on every rank.
    assert r1["gathered_sum"] == r0["gathered_sum"] and abs(r0["gathered_std"] - 0.02) < 1e-3
    assert r0["modifier1_mean"] == r1["modifier1_mean"] == 0.5
    # Trained from the zero.Init build, each rank's losses equal the normal build's bit for bit,
    # and both hold rank 0's write. Rank 1's scratch values are never read: were they, its
    # losses would differ.
    for r in ranks:
        assert r["init"] == r["plain"]
        assert r["init_row3"] == r["plain_row3"] == r0["plain_row3"]
        assert all(abs(v - 0.25) < 0.01 for v in r["init_row3"])  # 0.25, then 3 steps of 1e-3
    assert r0["init"] != r1["init"]  # each rank trained on its own micro-batches


def _fs_type(path):
    """The file system type coreutils' stat reports for `path` ("tmpfs", "ext2/ext3", ...)."""
    import subprocess

    run = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else None


def _tmpfs_dir():
    for path in ("/dev/shm", "/run", "/tmp"):
        if os.path.isdir(path) and os.access(path, os.W_OK) and _fs_type(path) == "tmpfs":
            return path
    return None


@pytest.mark.skipif(_tmpfs_dir() is None, reason="no writable tmpfs directory here")
def test_a_temporary_directory_in_memory_is_not_where_it_stages(tmp_path, monkeypatch):
    from strata import zero

    shm = _tmpfs_dir()
    # The mount table's answer agrees with statfs's (coreutils' stat) on a tmpfs, below it, and
    # on this test's directory and /proc.
    assert zero._memory_backed(shm) and zero._memory_backed(os.path.join(shm, "a", "b"))
    assert zero._memory_backed(str(tmp_path)) == (_fs_type(str(tmp_path)) == "tmpfs")
    assert not zero._memory_backed("/proc")
    # The system's temporary directory in memory (Debian 13's /tmp), none of TMPDIR, TEMP and
    # TMP set: /var/tmp.
    for var in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("tempfile.tempdir", shm)
    if not zero._memory_backed("/var/tmp"):
        with strata.zero.Init() as init:
            torch.nn.Linear(64, 64)
        assert init._dir == "/var/tmp"
    # Asked for by TMPDIR, or given, it is used, with a warning that names it.
    monkeypatch.setenv("TMPDIR", shm)
    with pytest.warns(UserWarning, match=f"staging directory {shm} is kept in memory"):
        with strata.zero.Init() as init:
            pass
    assert init._dir == shm
    os.makedirs(f"{shm}/x", exist_ok=True)
    with pytest.warns(UserWarning, match=f"{shm}/x is kept in memory"):
        with strata.zero.Init(nvme_path=f"{shm}/x"):
            pass


@pytest.mark.skipif("STRATA_BIN" not in os.environ, reason="needs the build's strata-estimate")
def test_the_estimate_of_a_python_build_is_the_file_zero_init_writes(tmp_path):
    """`strata-estimate --build python` counts the staging file this Init writes: every
    parameter, the large matrices included (strata-train draws those instead of staging them),
    at any stage and offload; in bf16 for a bf16 master."""
    from gpt2_model import GPT2

    shape = {"vocab_size": 256, "seq_len": 32, "d_model": 2048, "n_layers": 1, "n_heads": 16}
    tool = os.path.join(os.environ["STRATA_BIN"], "strata-estimate")
    for bf16_master in (False, True):
        cfg = _bf16_master_config(tmp_path) if bf16_master else {
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2}}
        cfg = dict(cfg, model=shape)
        path = tmp_path / f"cfg-{bf16_master}.json"
        path.write_text(json.dumps(cfg))
        est = {}
        for build in ("strata-train", "python"):
            out = subprocess.run([tool, "--config", str(path), "--build", build, "--json"],
                                 check=True, capture_output=True, text=True).stdout
            est[build] = json.loads(out)
        with strata.zero.Init(config_dict_or_path=cfg, nvme_path=str(tmp_path)) as init:
            model = GPT2(**shape)
        numel = sum(p.numel() for p in model.parameters())
        assert init.staged_bytes == numel * (2 if bf16_master else 4)
        assert est["python"]["staged_bytes"] == init.staged_bytes, (bf16_master, est["python"]["notes"])
        assert est["python"]["init_disk_peak_bytes"] >= init.staged_bytes
        # One nvme path: the start needs its peak (the file, and the blocks written as it goes).
        assert est["python"]["init_disk_need_bytes"] == est["python"]["init_disk_peak_bytes"]
        assert est["python"]["init_disk_peak_bytes"] <= init.staged_bytes + est["python"]["nvme_bytes"]
        # strata-train's build of the same config stages less: nothing below stage 3 without NVMe
        # parameter offload, and at d_model 2048 not the two 2^24-element MLP matrices.
        want_train = 0 if not bf16_master else init.staged_bytes - 2 * (1 << 24) * 2
        assert est["strata-train"]["staged_bytes"] == want_train, est["strata-train"]["notes"]
        # A 16-bit build of the fp32 master's config (zero.Init(dtype=...)) is --init-dtype's.
        if bf16_master:
            continue
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            out = subprocess.run([tool, "--config", str(path), "--build", "python", "--init-dtype", name,
                                  "--json"], check=True, capture_output=True, text=True).stdout
            half = json.loads(out)
            with strata.zero.Init(config_dict_or_path=cfg, nvme_path=str(tmp_path), dtype=dtype) as init:
                GPT2(**shape)
            assert init.staged_bytes == numel * 2
            assert half["staged_bytes"] == init.staged_bytes, (name, half["notes"])
            assert half["init_disk_need_bytes"] < est["python"]["init_disk_need_bytes"]
    # --init-dtype is zero.Init's: refused for strata-train's build, and for a dtype it cannot take.
    for args, said in ((["--init-dtype", "bf16"], "pass --build python"),
                       (["--build", "python", "--init-dtype", "int8"], "must be fp32, bf16 or fp16")):
        r = subprocess.run([tool, "--config", str(path)] + args, capture_output=True, text=True)
        assert r.returncode == 2 and said in r.stderr, r.stderr


def _mount_tmpfs(path, size):
    """Mounts a tmpfs of `size` over `path`; False where this process may not mount."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, f"size={size}".encode()) == 0


def _free_bytes(path):
    v = os.statvfs(path)
    return v.f_bavail * v.f_frsize


@pytest.fixture
def small_disk(tmp_path):
    """A 192 MiB tmpfs of its own and a stage-3 config with everything on NVMe there, with the
    GPT shape it trains and `strata-estimate --build python`'s JSON for them:
    (disk, cfg, shape, estimate). Skips where this process may not mount."""
    if "STRATA_BIN" not in os.environ:
        pytest.skip("needs the build's strata-estimate")
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _mount_tmpfs(disk, "192M"):
        pytest.skip(f"cannot mount tmpfs: errno {__import__('ctypes').get_errno()}")
    try:
        shape = {"vocab_size": 256, "seq_len": 32, "d_model": 256, "n_layers": 4, "n_heads": 4}
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "bf16": {"enabled": True},
               "aio": {"block_size": 65536},
               "strata": {"chunk_size": 1 << 20},
               "zero_optimization": {"stage": 3,
                                     "offload_param": {"device": "nvme", "nvme_path": str(disk)},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": str(disk)}}}
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps(dict(cfg, model=shape)))
        tool = os.path.join(os.environ["STRATA_BIN"], "strata-estimate")
        est = json.loads(subprocess.run([tool, "--config", str(path), "--build", "python", "--json"],
                                        check=True, capture_output=True, text=True).stdout)
        yield disk, cfg, shape, est
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_start_needs_free_only_what_it_grows_by_beside_the_staging_file(small_disk):
    """The engine's start gives the staging file's space back chunk by chunk as it writes the NVMe
    blocks, so the disk needs free only the growth `strata-estimate --build python` names
    (init_disk_need_bytes less the file), not the whole NVMe state beside the file. On a tmpfs of
    its own filled to leave just that, less than the state, the script's start goes through and
    trains; leaving less is refused before anything is read, and the same model starts once the
    space is there."""
    from gpt2_model import GPT2

    disk, cfg, shape, est = small_disk
    growth = est["init_disk_need_bytes"] - est["staged_bytes"]
    assert growth + (1 << 20) < est["nvme_bytes"], est  # the whole state would not fit beside it
    with pytest.warns(UserWarning, match="kept in memory"):
        with strata.zero.Init(config_dict_or_path=cfg) as init:
            torch.manual_seed(0)
            model = GPT2(**shape)
    assert init.staged_bytes == est["staged_bytes"]
    filler = disk / "filler"
    for leave, starts in ((growth - (2 << 20), False), (growth + (256 << 10), True)):
        filler.unlink(missing_ok=True)
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, _free_bytes(disk) - leave)
        assert abs(_free_bytes(disk) - leave) <= 4096
        if not starts:
            mapped = [p.data_ptr() for p in model.parameters()]
            with pytest.raises(strata.StrataError, match="staging file gives back"):
                strata.initialize(model=model, config=copy.deepcopy(cfg))
            # Nothing was read or copied: the parameters are still the file's mappings.
            assert [p.data_ptr() for p in model.parameters()] == mapped
            continue
        engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
        tokens = torch.randint(0, shape["vocab_size"], (2, shape["seq_len"] + 1))
        losses = []
        for _ in range(3):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
        engine.close()


def test_a_staged_parameter_held_elsewhere_is_named_at_the_start(tmp_path, capfd):
    """The start's disk check counts on each staged parameter's space coming back once the engine
    has its values. A tensor kept from before initialize that shares a parameter's memory (its
    .data) keeps that space on disk: the start says so, and without such a tensor it says
    nothing."""
    from gpt2_model import GPT2

    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    shape = {"vocab_size": 256, "seq_len": 32, "d_model": 128, "n_layers": 2, "n_heads": 4}
    for keep in (False, True):
        with strata.zero.Init(config_dict_or_path=cfg):
            model = GPT2(**shape)
        kept = model.blocks[0].fc.weight.data if keep else None
        capfd.readouterr()
        engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
        err = capfd.readouterr().err
        engine.close()
        assert ("another tensor still shares a staged parameter's memory" in err) == keep, err
        if keep:
            assert kept.numel() == 128 * 512  # the kept tensor still reads the file


def test_a_start_that_fails_part_way_says_the_model_must_be_built_again(small_disk, capfd):
    """A stage-3 start that fails after it has taken some chunks into its tiers (here: the disk
    fills because tensors kept from before initialize hold every staged parameter's space, which
    the start warned about) takes those parameters' values with it. It fails with the disk's
    error, and initialize on the same model then says the model must be built again, not that an
    engine was closed."""
    from gpt2_model import GPT2

    disk, cfg, shape, est = small_disk
    with pytest.warns(UserWarning, match="kept in memory"):
        with strata.zero.Init(config_dict_or_path=cfg):
            model = GPT2(**shape)
    kept = [p.data for p in model.parameters()]
    growth = est["init_disk_need_bytes"] - est["staged_bytes"]
    with open(disk / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, _free_bytes(disk) - growth - (64 << 10))
    capfd.readouterr()
    with pytest.raises(strata.StrataError, match="No space left on device.* went with the start"):
        strata.initialize(model=model, config=copy.deepcopy(cfg))
    assert "another tensor still shares a staged parameter's memory" in capfd.readouterr().err
    assert any(p.numel() == 0 for p in model.parameters())  # some went with the engine
    del kept
    (disk / "filler").unlink()
    with pytest.raises(strata.StrataError, match="failed part-way .* build the model again"):
        strata.initialize(model=model, config=copy.deepcopy(cfg))


def test_a_start_that_fails_part_way_gives_the_model_back(tmp_path):
    """A stage-3 start that fails after it has taken some chunks (a fault injected after the
    second, as a LibTorch error there would end it: every budget is checked before the first)
    gives every parameter back: a model in memory its own tensors and values, a zero.Init build
    its mappings of the staging file, which the disk could hold beside the state. The same model
    then starts and trains exactly as a fresh build. A device budget below the largest unit
    beside the device-placed state is refused before any chunk is taken, the model untouched."""
    from gpt2_model import GPT2

    shape = {"vocab_size": 256, "seq_len": 32, "d_model": 128, "n_layers": 2, "n_heads": 4}

    def config(device_budget):
        return {"train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "strata": {"device_memory_budget": device_budget, "chunk_size": 256 << 10},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}

    def build(staged):
        torch.manual_seed(0)
        if not staged:
            return GPT2(**shape)
        with strata.zero.Init(config_dict_or_path=config(4 << 20), nvme_path=str(tmp_path)):
            return GPT2(**shape)

    def train(model):
        engine, *_ = strata.initialize(model=model, config=config(4 << 20))
        tokens = torch.randint(0, shape["vocab_size"], (2, shape["seq_len"] + 1),
                               generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(2):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        return losses

    for staged in (False, True):
        model = build(staged)
        before = [(p.data_ptr(), p.dtype, p.shape, p.detach().clone()) for p in model.parameters()]
        with pytest.raises(strata.StrataError, match="stage 3 gathers each unit whole") as refused:
            strata.initialize(model=model, config=config(1 << 20))
        assert "chunk(s) of them written" not in str(refused.value), str(refused.value)
        _strata._fail_next_start_after_chunks(2)
        with pytest.raises(strata.StrataError, match="injected start fault after 2") as failed:
            strata.initialize(model=model, config=config(4 << 20))
        # Parameters were taken: the start had written chunks before it failed.
        given_back = re.search(r"the model is as the start found it \(\d+ parameters and buffers, "
                               r"(\d+) chunk\(s\) of them written", str(failed.value))
        assert given_back and int(given_back.group(1)) == 2, str(failed.value)
        for p, (ptr, dtype, size, values) in zip(model.parameters(), before):
            assert (p.data_ptr(), p.dtype, p.shape) == (ptr, dtype, size)
            assert torch.equal(p.detach(), values)
        assert train(model) == train(build(staged)), staged


def _open_deleted_files_under(directory):
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory) + "/") and target.endswith("(deleted)"):
            found.append(target)
    return found


def test_the_staging_file_lies_in_the_nvme_tiers_first_directory(tmp_path):
    """With parameters and optimizer states offloaded to nvme under two directories, the engine
    stripes over both, the optimizer's first; zero.Init stages in that first one, the disk whose
    space the engine's start counts on getting back (as strata-train and strata-estimate do)."""
    params_dir, optim_dir = tmp_path / "params", tmp_path / "optim"
    params_dir.mkdir()
    optim_dir.mkdir()
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "nvme", "nvme_path": str(params_dir)},
                                 "offload_optimizer": {"device": "nvme",
                                                       "nvme_path": str(optim_dir)}}}
    with strata.zero.Init(config_dict_or_path=cfg):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        assert _open_deleted_files_under(optim_dir), "no staging file in the optimizer's directory"
        assert not _open_deleted_files_under(params_dir)
    engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    for directory in (params_dir, optim_dir):  # the tier stripes over both
        assert (directory / "strata-rank0.swap").exists(), directory
    loss = engine(torch.randn(2, 64)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.close()
