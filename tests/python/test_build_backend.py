"""The project's PEP 517 backend (python/build_backend/strata_backend.py): the refusals a pip user
meets before anything is compiled, each naming the cause and the fix, and the wheel's layout.
The backend runs here in-process with fake compilers and a fake nvcc; the real pip install is
tests/python/test_pip_install.py's."""

import os
import stat
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python", "build_backend"))
import strata_backend  # noqa: E402


def _script(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _refusal(fn, *args):
    with pytest.raises(SystemExit) as e:
        fn(*args)
    return e.value


def test_a_compiler_that_links_libstdcxx_statically_is_refused(tmp_path, capsys):
    # Its "shared object" needs no libstdc++.so, as a static-by-default g++ makes them.
    fake = _script(tmp_path / "g++", 'for a; do case "$prev" in -o) : >"$a";; esac; prev=$a; done\n')
    _refusal(strata_backend._pick_cxx, str(tmp_path / "work"), [fake])
    err = capsys.readouterr().err
    assert "link libstdc++ statically" in err and "CXX" in err, err


def test_no_compiler_is_refused_with_the_package_to_install(tmp_path, capsys):
    _refusal(strata_backend._pick_cxx, str(tmp_path / "work"), [None, str(tmp_path / "no-g++")])
    assert "no C++ compiler found" in capsys.readouterr().err


def test_the_real_compiler_is_taken(tmp_path):
    cxx = strata_backend._pick_cxx(str(tmp_path / "work"))
    assert os.path.basename(cxx) in ("g++", "c++") or "g++" in cxx


def test_a_torch_for_another_cuda_major_is_refused(tmp_path, monkeypatch, capsys):
    nvcc = _script(tmp_path / "nvcc", 'echo "Cuda compilation tools, release 13.0, V13.0.48"\n')
    monkeypatch.setattr(strata_backend, "_find_nvcc", lambda: nvcc)
    monkeypatch.setattr(strata_backend, "_pick_cxx", lambda work: "/usr/bin/g++")
    info = {"version": "2.5.1+cu124", "cuda": "12.4", "prefix": "/nowhere", "cxx11_abi": 1,
            "nccl": "", "gloo": ""}
    _refusal(strata_backend._cmake_args, ROOT, info, str(tmp_path))
    err = capsys.readouterr().err
    assert "CUDA 12.4" in err and "CUDA 13.0" in err and "two CUDA runtimes" in err, err


def test_a_cuda_torch_without_nvcc_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(strata_backend, "_find_nvcc", lambda: None)
    monkeypatch.setattr(strata_backend, "_pick_cxx", lambda work: "/usr/bin/g++")
    info = {"version": "2.5.1+cu124", "cuda": "12.4", "prefix": "/nowhere", "cxx11_abi": 1,
            "nccl": "", "gloo": ""}
    _refusal(strata_backend._cmake_args, ROOT, info, str(tmp_path))
    assert "no nvcc" in capsys.readouterr().err


def test_a_matching_cuda_torch_gets_the_gpu_flags(tmp_path, monkeypatch):
    nvcc = _script(tmp_path / "nvcc", 'echo "Cuda compilation tools, release 13.0, V13.0.48"\n')
    nccl = tmp_path / "nccl"
    (nccl / "lib").mkdir(parents=True)
    (nccl / "lib" / "libnccl.so.2").write_bytes(b"")
    monkeypatch.setattr(strata_backend, "_find_nvcc", lambda: nvcc)
    monkeypatch.setattr(strata_backend, "_pick_cxx", lambda work: "/usr/bin/g++")
    monkeypatch.setattr(strata_backend, "_gpu_arch", lambda: "90")
    monkeypatch.setenv("STRATA_CMAKE_ARGS", "-DFOO=1")
    info = {"version": "2.11.0+cu130", "cuda": "13.0", "prefix": "/nowhere", "cxx11_abi": 0,
            "nccl": str(nccl), "gloo": "/g"}
    args = strata_backend._cmake_args(ROOT, info, str(tmp_path))
    for want in ("-DSTRATA_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                 f"-DSTRATA_NCCL_LIB={nccl}/lib/libnccl.so.2", "-DSTRATA_GLOO_INCLUDE=/g",
                 "-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0", "-DSTRATA_BUILD_TESTS=OFF"):
        assert want in args, (want, args)
    assert args[-1] == "-DFOO=1"  # the user's flags come last, so they win


def test_an_interpreter_without_torch_is_refused_before_cmake(tmp_path, monkeypatch, capsys):
    # A venv that does not see the system's packages has no torch.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    monkeypatch.setattr(strata_backend.sys, "executable", str(venv / "bin" / "python"))
    _refusal(strata_backend._probe_torch, dict(os.environ, PYTHONPATH=""))
    err = capsys.readouterr().err
    assert "cannot import torch" in err and "--no-build-isolation" in err, err


def test_the_deepspeed_wheel_holds_the_package_the_command_and_no_tests(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.join(ROOT, "python"))
    monkeypatch.setenv("STRATA_REPLACE_DEEPSPEED", "1")  # whatever this interpreter has
    name = strata_backend.build_wheel(str(tmp_path))
    assert name.startswith("deepspeed-") and name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(tmp_path / name) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith("/RECORD"))).decode()
        entry = z.read(next(n for n in names if n.endswith("/entry_points.txt"))).decode()
        meta = z.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "deepspeed/__init__.py" in names and "deepspeed/runtime/engine.py" in names
    assert not any(n.startswith(("strata/", "tests/")) for n in names), names
    assert "deepspeed = strata.launcher:main" in entry
    assert "Requires-Dist: strata" in meta and "Strata" in meta
    # Every file is in RECORD with its hash (what pip uninstall removes).
    for n in names:
        assert n in record, n


def test_pyproject_versions_are_the_ones_the_packages_report():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        strata_version = tomllib.load(f)["project"]["version"]
    with open(os.path.join(ROOT, "python", "pyproject.toml"), "rb") as f:
        ds_version = tomllib.load(f)["project"]["version"]
    import strata
    assert strata.__version__ == strata_version
    assert ds_version.endswith("+strata." + strata.__version__), ds_version
