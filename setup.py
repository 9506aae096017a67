"""Build Tessel: the Python packages plus the native extensions under csrc/.

Layout rule (so adding a native component never means editing this file):
every directory ``csrc/<name>/`` becomes one extension module ``engine._<name>``.

* Its ``*.cpp`` files are always compiled (pybind11 via torch's BuildExtension + ninja),
  so every machine, CPU-only included, gets the C++ path.
* Its ``*.cu`` files join the module only when torch was built with CUDA *and* nvcc is found;
  the module is then compiled with ``-DTESSEL_WITH_CUDA`` so its bindings can expose the GPU
  launchers. A CPU install never fails because of CUDA.
* ``.cu`` files include no torch headers (raw pointers + cudaStream_t launchers), which keeps
  the compile-only nvcc check in tests/test_cuda_compile.py fast and independent of torch.

``TESSEL_EXTENSIONS=fp8,adamw`` builds only the named components: with ``build_ext --inplace`` the others
keep their last build; a package built that way holds only the named ones.

Install (see README): torch==2.13.0 first, then ``pip install --no-build-isolation -e .[test]``.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_PIN = "torch==2.13.0"


def _cuda_build_enabled():
    if os.environ.get("TESSEL_NO_CUDA") == "1":
        return False
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return False
    return cpp_extension.CUDA_HOME is not None and shutil.which("nvcc") is not None


def _extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    with_cuda = _cuda_build_enabled()
    exts = []
    dirs = [d for d in sorted(glob.glob(os.path.join(ROOT, "csrc", "*"))) if os.path.isdir(d)]
    # TESSEL_EXTENSIONS=fp8,adamw builds only those (a quick rebuild of one component on a lent GPU)
    only = [n for n in os.environ.get("TESSEL_EXTENSIONS", "").split(",") if n]
    unknown = sorted(set(only) - {os.path.basename(d) for d in dirs})
    if unknown:
        raise SystemExit(f"TESSEL_EXTENSIONS names {unknown}, which are not directories under csrc/ "
                         f"({', '.join(os.path.basename(d) for d in dirs)})")
    for comp_dir in dirs:
        name = os.path.basename(comp_dir)
        if only and name not in only:
            continue
        cpp = sorted(glob.glob(os.path.join(comp_dir, "*.cpp")))
        cu = sorted(glob.glob(os.path.join(comp_dir, "*.cu")))
        if not cpp:
            continue
        rel = lambda paths: [os.path.relpath(p, ROOT) for p in paths]  # noqa: E731
        cxx = ["-O3", "-std=c++17"]
        inc = [os.path.join(ROOT, "csrc")]
        if with_cuda and cu:
            exts.append(
                CUDAExtension(
                    f"engine._{name}",
                    rel(cpp + cu),
                    include_dirs=inc,
                    define_macros=[("TESSEL_WITH_CUDA", "1")],
                    extra_compile_args={
                        "cxx": cxx,
                        "nvcc": ["-O3", "-std=c++17", *([] if name in EXACT_NVCC else ["--use_fast_math"]),
                                 "-gencode=arch=compute_90a,code=sm_90a",
                                 "-gencode=arch=compute_80,code=sm_80"],
                    },
                )
            )
        else:
            exts.append(CppExtension(f"engine._{name}", rel(cpp), include_dirs=inc,
                                     extra_compile_args=cxx))
    return exts


# Extensions built without nvcc's fast math: fp8's casts and its device-side scale (scale_from_amax, 1 / scale)
# must equal torch's CPU arithmetic bit for bit, subnormals included (fast math flushes them to zero).
EXACT_NVCC = {"fp8"}


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(
    name="tessel",
    version="0.1.0",
    description="Performance-first Megatron-style model-parallel training engine for transformers",
    packages=find_packages(include=["engine", "engine.*", "parallel", "parallel.*", "models", "models.*"]),
    package_data={"engine.posttrain.data": ["*.jsonl", "README.md"]},  # the bundled post-training sets
    python_requires=">=3.10",
    install_requires=[
        TORCH_PIN,
        "numpy>=1.26",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "triton==3.7.1; platform_system == \"Linux\"",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "jinja2>=3.1",  # chat templates (engine/posttrain/chat.py), as transformers renders them
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3",
            "transformers==5.23.0",
            "peft==0.21.2",  # the oracle for LoRA exports (tests only)
        ],
        # CPU machines run Triton kernels in the interpreter; GPU machines need it compiled.
        "triton": ["triton==3.7.1"],
        "gpu": ["triton==3.7.1", "nvidia-cutlass-dsl==4.8.1"],
        # The CuTe DSL FP8 GEMM (engine/ops/cute_fp8_gemm.py; ~300 MB); compiles for sm_90a on CPU too.
        "cute": ["nvidia-cutlass-dsl==4.8.1"],
    },
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
    zip_safe=False,
)
