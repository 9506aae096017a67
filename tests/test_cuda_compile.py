"""Compile-only check of every CUDA source under csrc/ with nvcc for Hopper (sm_90a).

CPU machines build Tessel without its .cu files (torch has no CUDA there), so without this check a
CUDA syntax or type error would only surface on a GPU machine. The .cu files include no torch
headers (kernels + launchers on raw pointers), so nvcc alone compiles them. CPU torch hard-codes
CUDA_HOME=None, hence nvcc is called directly rather than through torch.utils.cpp_extension.
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
