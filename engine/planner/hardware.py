"""The accelerators the planner knows, each figure with its source (docs/planner.md).

Peak rates are dense (no 2:4 sparsity) tensor-core rates; HBM sizes are the datasheet's (GB = 1e9 bytes);
``intra_gbps`` is the NVLink bandwidth per GPU in one direction (half the datasheet's bidirectional
figure), ``inter_gbps`` one InfiniBand NIC per GPU (the reference DGX/HGX systems). Latencies (alpha) are
typical NCCL start-up costs, not datasheet figures: override them (``--intra-alpha-us``) where a
measurement is at hand. ``gemm_efficiency`` and ``attention_efficiency`` are the fraction of the dense
peak that large cuBLAS GEMMs and flash-attention kernels reach; they are assumptions of the model
(stated in docs/planner.md), the same for every row the planner validates, never tuned per row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

A100_DATASHEET = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
H200_DATASHEET = "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
B200_DATASHEET = "https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet"
DGX_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf"
DGX_H100 = "https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx"
A100_ARCH = "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf"
H100_ARCH = "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper"
B200_SMS = "https://chipsandcheese.com/p/nvidias-b200-keeping-the-cuda-juggernaut (74 SMs enabled per die, 2 dies)"
FA3 = "https://arxiv.org/abs/2407.08608 (FlashAttention-3: 'FlashAttention-2 achieves only 35% utilization on H100')"


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator type: rates in TFLOP/s, bandwidths in GB/s, memory in GB (1e9 bytes)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    hbm_gbps: float
    hbm_gb: float
    intra_gbps: float
    inter_gbps: float
    intra_alpha_us: float = 5.0
    inter_alpha_us: float = 10.0
    gemm_efficiency: float = 0.80
    gemm_overhead_us: float = 4.0  # per GEMM launch and tail: what makes small GEMMs slower than the peak
    attention_efficiency: float = 0.55
    tf32_tflops: float | None = None  # dense TF32: the rate of fp32 training
    link_efficiency: float = 0.80  # NCCL's bus bandwidth over the link's: ring collectives do not saturate it
    collective_overhead_us: float = 0.0  # per collective call beyond alpha-beta (host, sync); CPU: measured
    # per framework op (aten dispatch, autograd node, allocation) on the host: synchronous on CPU, where every op
    # waits for it (measured by --calibrate); 0 for the GPUs, whose launches run ahead of the kernels
    host_op_us: float = 0.0
    # the memory-bound activation ops' bandwidth (norms, adds, RoPE, the activation function, the loss);
    # None: hbm_gbps. A CPU's activations of the calibrated sizes stay in its caches (--calibrate measures it)
    activation_gbps: float | None = None
    sms: int | None = None  # streaming multiprocessors: a GEMM's output tiles run in whole waves over them
    gemm_tile: tuple[int, int] = (256, 128)  # cuBLAS's large bf16/fp16 GEMM tile (its kernels' names), either way round
    sources: tuple[str, ...] = ()

    @property
    def act_gbps(self) -> float:
        return self.hbm_gbps if self.activation_gbps is None else self.activation_gbps

    def peak_tflops(self, precision: str) -> float:
        if precision == "bf16":
            return self.bf16_tflops
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise ValueError(f"--precision fp8: the {self.name} has no FP8 tensor cores; use --precision bf16 "
                                 f"or an fp8-capable --gpu ({', '.join(fp8_gpus())})")
            return self.fp8_tflops
        if precision == "fp32":
            if self.tf32_tflops is None:
                raise ValueError(f"fp32 training: no TF32/fp32 rate for {self.name}; use bf16")
            return self.tf32_tflops
        raise ValueError(f"precision={precision!r} must be 'bf16', 'fp8' or 'fp32'")

    def with_links(self, *, intra_gbps=None, inter_gbps=None, intra_alpha_us=None, inter_alpha_us=None) -> "GPU":
        """A copy with the given link figures overridden (None keeps the default)."""
        kw = {k: v for k, v in dict(intra_gbps=intra_gbps, inter_gbps=inter_gbps, intra_alpha_us=intra_alpha_us,
                                   inter_alpha_us=inter_alpha_us).items() if v is not None}
        for k, v in kw.items():
            if v <= 0:
                raise ValueError(f"--{k.replace('_', '-')}={v} must be > 0")
        return replace(self, **kw)


GPUS: dict[str, GPU] = {
    # A100: 312 TFLOP/s dense bf16 (156 TF32), no FP8; 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s
    # bidirectional. DGX A100: eight 200 Gb/s HDR InfiniBand NICs (one per GPU) = 25 GB/s per GPU.
    "a100-40gb": GPU(name="a100-40gb", bf16_tflops=312.0, fp8_tflops=None, hbm_gbps=1555.0, hbm_gb=40.0,
                     intra_gbps=300.0, inter_gbps=25.0, tf32_tflops=156.0, sms=108,
                     sources=(A100_DATASHEET, DGX_A100, A100_ARCH)),
    "a100-80gb": GPU(name="a100-80gb", bf16_tflops=312.0, fp8_tflops=None, hbm_gbps=2039.0, hbm_gb=80.0,
                     intra_gbps=300.0, inter_gbps=25.0, tf32_tflops=156.0, sms=108,
                     sources=(A100_DATASHEET, DGX_A100, A100_ARCH)),
    # H100 SXM5: 989 TFLOP/s dense bf16 (1,979 with sparsity), 1,979 dense FP8, 494.5 dense TF32; 80 GB HBM3 at 3.35 TB/s;
    # NVLink 900 GB/s bidirectional. DGX H100: eight 400 Gb/s NDR NICs = 50 GB/s per GPU. 132 SMs. Attention at
    # FlashAttention-2's 35% of the dense peak on H100 (the FA3 paper's figure; FA3 itself reaches 75% forward).
    "h100-sxm": GPU(name="h100-sxm", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gbps=3350.0, hbm_gb=80.0,
                    intra_gbps=450.0, inter_gbps=50.0, gemm_efficiency=0.75, attention_efficiency=0.35,
                    tf32_tflops=494.5, sms=132, sources=(H100_DATASHEET, DGX_H100, H100_ARCH, FA3)),
    # H200 SXM: the H100's compute (132 SMs) with 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional.
    "h200": GPU(name="h200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gbps=4800.0, hbm_gb=141.0,
                intra_gbps=450.0, inter_gbps=50.0, gemm_efficiency=0.75, attention_efficiency=0.35,
                tf32_tflops=494.5, sms=132, sources=(H200_DATASHEET, DGX_H100, H100_ARCH, FA3)),
    # B200: DGX B200 holds 8 GPUs with 1,440 GB HBM3e (180 GB each) and 64 TB/s in all (8 TB/s each); dense
    # per-GPU rates 2.25 PFLOP/s bf16, 4.5 PFLOP/s FP8 and 1.1 PFLOP/s TF32 (half the datasheet's sparse figures); NVLink 5
    # 1.8 TB/s bidirectional; eight 400 Gb/s ConnectX-7 NICs = 50 GB/s per GPU.
    "b200": GPU(name="b200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gbps=8000.0, hbm_gb=180.0,
                intra_gbps=900.0, inter_gbps=50.0, gemm_efficiency=0.75, tf32_tflops=1100.0, sms=148,
                sources=(B200_DATASHEET, B200_SMS)),
}


def fp8_gpus() -> list[str]:
    """The --gpu names with FP8 tensor cores (an FP8 peak in the table)."""
    return [name for name, g in GPUS.items() if g.fp8_tflops is not None]


def gpu(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"--gpu {name!r} is not in the table; choose one of {', '.join(GPUS)} (or add a row "
                         "with its sources to engine/planner/hardware.py)") from None
