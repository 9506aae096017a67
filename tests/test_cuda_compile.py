"""Compile-only check of every CUDA source under csrc/ with nvcc for Hopper (sm_90a).

CPU machines build Tessel without its .cu files (torch has no CUDA there), so without this check a
CUDA syntax or type error would only surface on a GPU machine. The .cu files include no torch
headers (kernels + launchers on raw pointers), so nvcc alone compiles them. CPU torch hard-codes
CUDA_HOME=None, hence nvcc is called directly rather than through torch.utils.cpp_extension.

The C++ bindings' CUDA branches (``#ifdef TESSEL_WITH_CUDA``: device guard, stream, launch check), which
include torch, are checked with g++ -fsyntax-only against CPU torch's headers (below).
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
NVCC = shutil.which("nvcc")


def _cuda_sources():
    found = []
    for dirpath, _, files in os.walk(CSRC):
        found += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith(".cu")]
    return sorted(found)


def test_csrc_has_cuda_sources():
    # Guards the check below against passing vacuously (e.g. after a move of csrc/).
    assert _cuda_sources(), f"no .cu file under {CSRC}: the nvcc compile check would test nothing"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH; the CUDA compile-only check needs it")
@pytest.mark.parametrize("source", _cuda_sources())
def test_nvcc_compiles_for_sm90a(source, tmp_path):
    obj = tmp_path / (os.path.basename(source) + ".o")
    cmd = [NVCC, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-c", source, "-o", str(obj),
           "-I", "csrc", "-Werror=all-warnings"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert obj.stat().st_size > 0


def _cuda_branch_bindings():
    """The C++ binding files whose CUDA branch (``#ifdef TESSEL_WITH_CUDA``) a CPU build never compiles."""
    found = []
    for dirpath, _, files in os.walk(CSRC):
        for f in files:
            path = os.path.join(dirpath, f)
            if f.endswith(".cpp") and "TESSEL_WITH_CUDA" in open(path).read():
                found.append(os.path.relpath(path, ROOT))
    return sorted(found)


def _cuda_include():
    """CUDA's include directory (cuda_runtime_api.h, which c10/cuda's headers need), or None."""
    import glob

    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    for root in roots:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


CXX = shutil.which("g++")
CUDA_INCLUDE = _cuda_include()


def test_csrc_has_cuda_branch_bindings():
    assert _cuda_branch_bindings(), "no binding under csrc/ has a TESSEL_WITH_CUDA branch: the check below tests nothing"


@pytest.fixture(scope="module")
def cuda_branch_compiles(tmp_path_factory):
    """{source: (return code, command, stderr)} of every binding's CUDA-branch syntax check, run concurrently
    (each parses torch's headers: ~10-16 s apiece)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    stub_root = tmp_path_factory.mktemp("cuda_stub")
    stub = stub_root / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    flags = [CXX, "-std=c++17", "-fsyntax-only", "-DTESSEL_WITH_CUDA", "-DTORCH_EXTENSION_NAME=check", "-Icsrc",
             *(f"-I{p}" for p in include_paths()), f"-I{stub_root}", f"-I{sysconfig.get_paths()['include']}",
             f"-I{CUDA_INCLUDE}", "-Wall", "-Wno-c++20-extensions", "-Werror"]
    procs = {src: subprocess.Popen([*flags, src], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for src in _cuda_branch_bindings()}
    out = {}
    for src, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        out[src] = (proc.returncode, " ".join([*flags, src]), err)
    return out


@pytest.mark.skipif(CXX is None or CUDA_INCLUDE is None, reason="needs g++ and CUDA's headers")
@pytest.mark.parametrize("source", _cuda_branch_bindings())
def test_bindings_cuda_branch_compiles(source, cuda_branch_compiles):
    """Each binding's CUDA branch (the torch-side launch: device guard, stream, error check) through g++
    -fsyntax-only with TESSEL_WITH_CUDA defined, against CPU torch's headers (they ship c10/cuda's; the one
    header its CMake generates, c10/cuda/impl/cuda_cmake_macros.h, is stubbed here), so a mistake there shows
    on CPU and not first on a lent GPU."""
    rc, cmd, err = cuda_branch_compiles[source]
    assert rc == 0, f"{cmd} failed:\n{err[-4000:]}"
