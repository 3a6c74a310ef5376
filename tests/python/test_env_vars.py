"""The environment variables Strata reads are declared in one table (runtime/base/env_vars.h,
strata._strata.env_vars()): every variable the source tree reads is in it, C++ reads none by a
raw std::getenv of its own, and the README's "Environment variables" section lists each row."""

import os
import re
import subprocess

from strata import _strata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The system's and other programs' own variables: paths and the temp folder, ccache's and the
# sanitizers' settings the scripts give defaults to, the device machine's $OUT.
SYSTEM = {"PATH", "PYTHONPATH", "TMPDIR", "HOME", "CCACHE_DIR", "CCACHE_MAXSIZE", "ASAN_OPTIONS",
          "UBSAN_OPTIONS", "TSAN_OPTIONS", "OUT"}


def _shell_reads(text):
    """Variables a shell script reads from its environment: ${NAME:-default} where the script
    does not set NAME itself (other than NAME=${NAME:-...}, which is a read)."""
    names = set(re.findall(r"\$\{([A-Z][A-Z_0-9]+):?-", text))
    own = {n for n in names
           if re.search(rf"(^|[\s;(])(local\s+)?{n}=(?!\$\{{{n}\b)", text, re.M)}
    return sorted(names - own)


def _tracked(*roots):
    out = subprocess.run(["git", "ls-files", *roots], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [os.path.join(ROOT, f) for f in out]


def _table():
    return {name: (reader, meaning) for name, reader, meaning in _strata.env_vars()}


def test_the_table_is_well_formed():
    rows = _strata.env_vars()
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)), "a variable declared twice"
    readers = {"runtime", "strata-train", "launch", "python", "pip build", "tests", "scripts"}
    for name, reader, meaning in rows:
        assert re.fullmatch(r"[A-Z][A-Z_0-9]*", name), name
        assert reader in readers, (name, reader)
        assert len(meaning) > 10, name


def test_cpp_reads_only_through_the_table():
    raw = []
    for path in _tracked("runtime", "tiers", "optim", "kernels", "tools", "python/bindings"):
        if not path.endswith((".cc", ".h", ".cu")) or \
                os.path.basename(path) in ("env_vars.cc", "env_vars.h"):
            continue
        for n, line in enumerate(open(path, errors="replace"), 1):
            code = line.split("//")[0]
            if re.search(r"\bgetenv\s*\(", code) and "GetEnv(" not in code:
                raw.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not raw, "read through GetEnv(kEnv...) (runtime/base/env_vars.h):\n" + "\n".join(raw)


def test_every_variable_read_is_declared():
    table = _table()
    py = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(\s*|environ\[\s*|getenv\(\s*)"""
                    r"""["']([A-Z][A-Z_0-9]+)["']\s*(\]\s*=(?!=))?""")
    found = {}
    for path in _tracked("python", "tests/python", "tools/scripts", ".ci"):
        text = open(path, errors="replace").read()
        if path.endswith(".py"):
            names = [m.group(1) for m in py.finditer(text) if not m.group(2)]
        elif path.endswith(".sh") or path.endswith("/run"):
            names = _shell_reads(text)
        else:
            continue
        for name in names:
            found.setdefault(name, os.path.relpath(path, ROOT))
    cpp = re.compile(r"GetEnv\((?:strata::)?(kEnv\w+)\)")
    header = open(os.path.join(ROOT, "runtime", "base", "env_vars.h")).read()
    constants = dict(re.findall(r"inline constexpr EnvVar (kEnv\w+)\{\s*\"([A-Z_0-9]+)\"", header))
    for path in _tracked("runtime", "tiers", "optim", "kernels", "tools", "python/bindings"):
        if path.endswith((".cc", ".h")):
            for const in cpp.findall(open(path, errors="replace").read()):
                found.setdefault(constants[const], os.path.relpath(path, ROOT))
    missing = {n: f for n, f in found.items() if n not in table and n not in SYSTEM
               and not n.startswith("_")}
    assert not missing, f"read but not in runtime/base/env_vars.h: {missing}"
    assert len(found) >= 30, sorted(found)  # the scan sees the tree


def test_the_readme_lists_every_variable():
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"^## Environment variables\n(.*?)(?=^## )", readme, re.S | re.M)
    assert m, "README.md has no '## Environment variables' section"
    section = m.group(1)
    listed = set(re.findall(r"^\| `([A-Z][A-Z_0-9]*)` \|", section, re.M))
    table = _table()
    assert listed == set(table), (f"missing from the README: {sorted(set(table) - listed)}; "
                                  f"not in the table: {sorted(listed - set(table))}")
