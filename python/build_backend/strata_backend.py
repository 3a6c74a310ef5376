"""The PEP 517 build backend of Strata's two Python distributions, standard library only.

    pip install --no-build-isolation .            # `strata`: the extension and the C++ tools
    pip install --no-build-isolation ./python     # `deepspeed`: the opt-in compatibility package

Why a backend of our own: the project has no setup.py at its top, pip must download nothing
(setuptools' extension hooks live in setup.py, and scikit-build-core is not packaged by every
Debian release we build on), and the wheel holds files CMake made, not files setuptools compiles.
The backend reads its table from the project's pyproject.toml ([project] and [tool.strata-build])
and writes the wheel itself: a zip with the package, its dist-info and its RECORD.

`strata` (kind = "native"): CMake builds the extension module and the tools against the torch
of the interpreter running pip (its TorchConfig.cmake, its CUDA and the NCCL of its nvidia
wheel, the GPU's architecture from nvidia-smi), in build/pip-<python>-<torch>, with the tests
off. Build isolation hides the interpreter's own packages from the backend; the torch probe then
runs the interpreter again without pip's isolation variables, so `pip install .` finds the torch
that `python -c "import torch"` finds. Environment: STRATA_CMAKE_ARGS (more -D flags, shell
words), STRATA_BUILD_DIR, STRATA_JOBS, STRATA_WHEEL_KEEP_DEBUG=1 (ship debug info; stripped by
default, as a wheel's users expect).

`deepspeed` (kind = "pure"): the python/deepspeed package and the `deepspeed` command. It
refuses to replace a DeepSpeed that is not Strata's (STRATA_REPLACE_DEEPSPEED=1 overrides).
"""

import base64
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile

try:
    import tomllib
except ImportError:  # Python < 3.11
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None


def _fail(message):
    # pip shows the backend's stderr; one clear paragraph there beats a traceback.
    sys.stderr.write("\nstrata build: " + message + "\n\n")
    raise SystemExit(1)


# --- the project's table -------------------------------------------------------------------------
def _project():
    if tomllib is None:
        _fail("building needs Python 3.11 or newer (tomllib), or the tomli package installed")
    with open("pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    project = data.get("project", {})
    tool = data.get("tool", {}).get("strata-build", {})
    for key in ("name", "version"):
        if key not in project:
            _fail(f"pyproject.toml has no project.{key}")
    return project, tool


def _dist_name(project):
    return re.sub(r"[-_.]+", "_", project["name"])


def _metadata_text(project, tool):
    lines = ["Metadata-Version: 2.1", "Name: " + project["name"], "Version: " + project["version"]]
    if project.get("description"):
        lines.append("Summary: " + project["description"])
    if project.get("requires-python"):
        lines.append("Requires-Python: " + project["requires-python"])
    for dep in project.get("dependencies", []):
        lines.append("Requires-Dist: " + dep)
    lic = project.get("license", {})
    if isinstance(lic, dict) and lic.get("text"):
        lines.append("License: " + lic["text"])
    readme = tool.get("long-description")
    body = ""
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + readme.strip() + "\n"
    return "\n".join(lines) + "\n" + body


def _entry_points_text(project):
    scripts = project.get("scripts", {})
    if not scripts:
        return None
    return "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(scripts.items()))


def _write_dist_info(directory, project, tool, tag):
    """The dist-info files other than RECORD, as {relative name: bytes}."""
    info = f"{_dist_name(project)}-{project['version']}.dist-info"
    files = {
        f"{info}/METADATA": _metadata_text(project, tool).encode(),
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: strata_backend\n"
                          f"Root-Is-Purelib: {'true' if tag == 'py3-none-any' else 'false'}\n"
                          f"Tag: {tag}\n").encode(),
        f"{info}/top_level.txt": "".join(p + "\n" for p in tool.get("top-level", [])).encode(),
    }
    entry = _entry_points_text(project)
    if entry:
        files[f"{info}/entry_points.txt"] = entry.encode()
    if directory is not None:
        for name, data in files.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    return info, files


# --- the interpreter pip builds for ---------------------------------------------------------------
def _outside_isolation_env():
    """The environment without pip's build isolation: its PYTHONPATH (a folder that hides the
    interpreter's site-packages) and PYTHONNOUSERSITE go, so the interpreter sees what it sees
    when the user runs it."""
    env = dict(os.environ)
    if "PYTHONNOUSERSITE" in env and "pip-build-env" in env.get("PYTHONPATH", ""):
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONNOUSERSITE", None)
    return env


_TORCH_PROBE = r"""
import json, os, torch, torch.utils, torch.utils.cpp_extension as ext
# c10d's Gloo headers: a pip torch carries them among its own include folders.
gloo = next((d for d in ext.include_paths() if os.path.exists(os.path.join(d, "gloo", "config.h"))), "")
nccl = ""
try:
    import nvidia
    for d in nvidia.__path__:
        for root, _, files in os.walk(d):
            if "nccl.h" in files and not nccl:
                nccl = os.path.dirname(root)
except ImportError:
    pass
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda or "",
                  "prefix": torch.utils.cmake_prefix_path,
                  "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI), "nccl": nccl,
                  "gloo": gloo}))
"""


def _probe_torch(env):
    import json
    r = subprocess.run([sys.executable, "-c", _TORCH_PROBE], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        _fail(f"{sys.executable} cannot import torch ({last}). Strata's extension is built against "
              "the torch of the interpreter running pip: install torch there first (on Debian: "
              "apt-get install python3-torch, and a venv made with --system-site-packages sees "
              "it), then run pip install --no-build-isolation . again")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _cuda_major_of_nvcc(nvcc):
    r = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    m = re.search(r"release (\d+)\.(\d+)", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _find_nvcc():
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _gpu_arch():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    r = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                       capture_output=True, text=True)
    caps = sorted({line.strip().replace(".", "") for line in r.stdout.splitlines() if line.strip()})
    return ";".join(caps) if r.returncode == 0 and caps else None


def _pick_cxx(work, candidates=None):
    """The first g++ whose shared objects need libstdc++.so: the extension runs in a process
    whose torch already loaded that library (Note [one libstdc++] in python/CMakeLists.txt)."""
    if candidates is None:
        # CMake's own default (c++) first: a build folder configured by hand then compiles with
        # the same command lines, and ccache serves one from the other.
        candidates = [os.environ.get("CXX"), shutil.which("c++"), shutil.which("g++"), "/usr/bin/g++"]
    seen, static_ones = set(), []
    probe = os.path.join(work, "libstdcxx-probe")
    os.makedirs(work, exist_ok=True)
    with open(probe + ".cc", "w") as f:
        f.write("#include <sstream>\nstd::string f(long v) { std::ostringstream s; s << v; "
                "return s.str(); }\n")
    for c in candidates:
        if not c or c in seen or not shutil.which(c):
            continue
        seen.add(c)
        r = subprocess.run([c, "-shared", "-fPIC", "-o", probe + ".so", probe + ".cc"],
                           capture_output=True)
        if r.returncode == 0:
            with open(probe + ".so", "rb") as f:
                if b"libstdc++.so" in f.read():
                    return shutil.which(c)
            static_ones.append(c)
    if static_ones:
        _fail(f"the C++ compiler(s) {', '.join(static_ones)} link libstdc++ statically: the "
              "extension would carry a second C++ runtime beside torch's and crash. Point CXX at "
              "a g++ that links the shared libstdc++ (Debian's /usr/bin/g++ does)")
    _fail("no C++ compiler found (g++ or c++ on PATH, or CXX): install one, e.g. "
          "apt-get install build-essential")


def _cmake_args(root, torch_info, work):
    args = ["-DCMAKE_BUILD_TYPE=" + os.environ.get("STRATA_BUILD_TYPE", "RelWithDebInfo"),
            "-DSTRATA_BUILD_TESTS=OFF", "-DSTRATA_PYTHON=ON",
            "-DSTRATA_PYTHON_EXECUTABLE=" + sys.executable]
    # A pip torch's TorchConfig.cmake is found by cmake/StrataPython.cmake through the same
    # interpreter. Wheels before torch 2.7 use the pre-C++11 string ABI: every target must then
    # use it too, not only those that include LibTorch.
    if not torch_info["cxx11_abi"]:
        args.append("-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0")
    if torch_info["gloo"]:
        args.append("-DSTRATA_GLOO_INCLUDE=" + torch_info["gloo"])
    cxx = _pick_cxx(work)
    args += ["-DCMAKE_CXX_COMPILER=" + cxx]
    cc = re.sub(r"(g\+\+|c\+\+)(-[0-9.]+)?$",
                lambda m: ("gcc" if m.group(1) == "g++" else "cc") + (m.group(2) or ""), cxx)
    if cc != cxx and os.access(cc, os.X_OK):
        args.append("-DCMAKE_C_COMPILER=" + cc)
    nvcc = _find_nvcc()
    if torch_info["cuda"]:
        if not nvcc:
            _fail(f"torch {torch_info['version']} is built for CUDA {torch_info['cuda']} but no nvcc "
                  "was found (PATH, /usr/local/cuda/bin): install the CUDA toolkit of that major "
                  "version, or set STRATA_CMAKE_ARGS=-DSTRATA_CUDA=OFF for a CPU-only build")
        have = _cuda_major_of_nvcc(nvcc)
        want = int(torch_info["cuda"].split(".")[0])
        if have and have[0] != want:
            _fail(f"torch {torch_info['version']} is built for CUDA {torch_info['cuda']} but {nvcc} is "
                  f"CUDA {have[0]}.{have[1]}: the extension and torch would load two CUDA runtimes. "
                  f"Put a CUDA {want}.x toolkit first on PATH, or install the torch built for "
                  f"CUDA {have[0]}")
        args += ["-DSTRATA_CUDA=ON", "-DCMAKE_CUDA_COMPILER=" + nvcc, "-DCMAKE_CUDA_HOST_COMPILER=" + cxx]
        arch = _gpu_arch()
        if arch:
            args.append("-DCMAKE_CUDA_ARCHITECTURES=" + arch)
        nccl = torch_info["nccl"]
        if nccl:
            libs = sorted(f for f in os.listdir(os.path.join(nccl, "lib"))
                          if f.startswith("libnccl.so")) if os.path.isdir(os.path.join(nccl, "lib")) else []
            if libs:
                args += ["-DSTRATA_NCCL_INCLUDE=" + os.path.join(nccl, "include"),
                         "-DSTRATA_NCCL_LIB=" + os.path.join(nccl, "lib", libs[0])]
    else:
        # A CPU torch: the CUDA device still builds where nvcc is (it runs only on a GPU).
        args.append("-DSTRATA_CUDA=" + ("AUTO" if nvcc else "OFF"))
    return args + shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))


def _run(cmd, env, what):
    print("strata build: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        _fail(f"{what} failed (exit {r.returncode}); its output is above")


def _native_build(root, tool):
    """Configures and builds the extension and the tools; returns (build dir, torch info)."""
    if not shutil.which("cmake"):
        _fail("cmake was not found: install it (apt-get install cmake ninja-build, or pip's cmake)")
    env = _outside_isolation_env()
    torch_info = _probe_torch(env)
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    torch_tag = re.sub(r"[^0-9A-Za-z.]+", "_", torch_info["version"])
    build = os.environ.get("STRATA_BUILD_DIR") or os.path.join(root, "build", f"pip-{py}-torch{torch_tag}")
    build = os.path.abspath(build)
    args = _cmake_args(root, torch_info, os.path.join(build, "probe"))
    generator = ["-G", "Ninja"] if shutil.which("ninja") and not os.path.exists(
        os.path.join(build, "Makefile")) else []
    env.setdefault("CCACHE_BASEDIR", root)
    env.setdefault("CCACHE_NOHASHDIR", "1")
    print(f"strata build: torch {torch_info['version']}"
          f"{' (CUDA ' + torch_info['cuda'] + ')' if torch_info['cuda'] else ' (CPU)'}, "
          f"{sys.executable}, build folder {build}", flush=True)
    _run(["cmake", "-S", root, "-B", build] + generator + args, env, "configuring (cmake)")
    jobs = os.environ.get("STRATA_JOBS") or str(os.cpu_count() or 2)
    _run(["cmake", "--build", build, "-j", jobs, "--target"] + tool["targets"], env,
         "building (cmake --build)")
    return build, torch_info


# --- wheel writing ------------------------------------------------------------------------------
def _record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class _Wheel:
    def __init__(self, path):
        self.path = path
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records = []

    def add(self, arcname, data, executable=False):
        info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
        # pip keeps the executable bit of a regular file (the file-type bits must say so).
        info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        self.records.append(f"{arcname},{_record_hash(data)},{len(data)}")

    def add_file(self, arcname, path, executable=False):
        with open(path, "rb") as f:
            self.add(arcname, f.read(), executable)

    def close(self, record_name):
        self.records.append(f"{record_name},,")
        data = ("\n".join(self.records) + "\n").encode()
        info = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = (stat.S_IFREG | 0o644) << 16
        self.zip.writestr(info, data)
        self.zip.close()


def _package_files(src_root, package_dir, package):
    """(archive name, path) of every .py file of `package` (its folder `package_dir`) and below."""
    out = []
    base = os.path.join(src_root, package_dir)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py") or name == "py.typed":
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, base)
                out.append((f"{package}/{rel}".replace(os.sep, "/"), path))
    return out


def _stripped(path, work):
    """A copy of `path` without debug sections (the wheel's users do not debug the build)."""
    if os.environ.get("STRATA_WHEEL_KEEP_DEBUG") == "1" or not shutil.which("objcopy"):
        return path
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, os.path.basename(path))
    r = subprocess.run(["objcopy", "--strip-debug", path, out], capture_output=True)
    return out if r.returncode == 0 else path


def _platform_tag():
    ext = sysconfig.get_config_var("EXT_SUFFIX") or ""
    m = re.match(r"\.cpython-(\d+)(t?)-", ext)
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    abi = f"cp{m.group(1)}{m.group(2)}" if m else py
    plat = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return f"{py}-{abi}-{plat}"


def _check_deepspeed_slot(project):
    """Refuses to replace a DeepSpeed that is not Strata's (the build may run isolated: the
    interpreter is asked again, outside pip's isolation)."""
    if os.environ.get("STRATA_REPLACE_DEEPSPEED") == "1":
        return
    probe = ("import importlib.metadata as m\n"
             "try:\n d = m.distribution('deepspeed')\nexcept m.PackageNotFoundError:\n print('')\n"
             "else:\n print(d.version + '|' + (d.metadata.get('Summary') or ''))\n")
    r = subprocess.run([sys.executable, "-c", probe], env=_outside_isolation_env(),
                       capture_output=True, text=True)
    found = r.stdout.strip()
    if not found or "Strata" in found.split("|", 1)[-1]:
        return
    version = found.split("|", 1)[0]
    _fail(f"DeepSpeed {version} is installed for {sys.executable}; Strata's `deepspeed` "
          "distribution would replace it. To run DeepSpeed scripts on Strata here, "
          "`pip uninstall deepspeed` first (or use a separate venv); to replace it anyway, set "
          "STRATA_REPLACE_DEEPSPEED=1. The `strata` package itself needs neither.")


def _build(wheel_directory, metadata_directory=None):
    project, tool = _project()
    root = os.path.abspath(".")
    kind = tool.get("kind", "pure")
    name, version = _dist_name(project), project["version"]
    if kind == "pure":
        if project["name"] == "deepspeed":
            _check_deepspeed_slot(project)
        tag, build = "py3-none-any", None
    elif kind == "native":
        build, _ = _native_build(root, tool)
        tag = _platform_tag()
    else:
        _fail(f"[tool.strata-build] kind = {kind!r}: 'pure' or 'native'")
    filename = f"{name}-{version}-{tag}.whl"
    path = os.path.join(wheel_directory, filename)
    wheel = _Wheel(path)
    for package, package_dir in tool.get("packages", {}).items():
        for arcname, src in _package_files(root, package_dir, package):
            wheel.add_file(arcname, src)
    if build is not None:
        work = os.path.join(build, "wheel-strip")
        for pattern_dir, package in tool.get("native-modules", {}).items():
            folder = os.path.join(build, pattern_dir)
            mods = [f for f in os.listdir(folder) if f.endswith(".so")] if os.path.isdir(folder) else []
            if not mods:
                _fail(f"the build made no extension module in {folder}")
            for m in mods:
                wheel.add_file(f"{package}/{m}", _stripped(os.path.join(folder, m), work))
        for tool_name in tool.get("native-scripts", []):
            src = os.path.join(build, "bin", tool_name)
            if not os.path.exists(src):
                _fail(f"the build made no {tool_name} in {os.path.dirname(src)}")
            wheel.add_file(f"{name}-{version}.data/scripts/{tool_name}", _stripped(src, work),
                           executable=True)
    info, files = _write_dist_info(None, project, tool, tag)
    for arcname, data in files.items():
        wheel.add(arcname, data)
    wheel.close(f"{info}/RECORD")
    print(f"strata build: wrote {filename} ({os.path.getsize(path) / 2**20:.1f} MiB)", flush=True)
    return filename


# --- PEP 517 hooks ------------------------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    project, tool = _project()
    tag = "py3-none-any" if tool.get("kind", "pure") == "pure" else _platform_tag()
    info, _ = _write_dist_info(metadata_directory, project, tool, tag)
    return info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    """The tracked source files (git ls-files) under <name>-<version>/, with PKG-INFO."""
    import io
    import tarfile
    project, tool = _project()
    name, version = _dist_name(project), project["version"]
    r = subprocess.run(["git", "ls-files", "-z"], capture_output=True)
    if r.returncode != 0:
        _fail("a source distribution is made from a git checkout (git ls-files failed)")
    files = [f for f in r.stdout.decode().split("\0") if f and os.path.isfile(f)]
    filename = f"{name}-{version}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, filename), "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f"{name}-{version}/{f}")
        data = _metadata_text(project, tool).encode()
        ti = tarfile.TarInfo(f"{name}-{version}/PKG-INFO")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    return filename
