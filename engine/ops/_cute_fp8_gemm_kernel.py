"""CuTe DSL (nvidia-cutlass-dsl) FP8 GEMM kernel for sm_90a. Private: use engine.ops.cute_fp8_gemm.

Importing this module imports ``cutlass``; engine.ops.cute_fp8_gemm is the one guarded place that
does so. What the kernel computes, per output tile (BM, BN) of D (M, N):

    D[m, n] = bf16( scale_a * scale_b * sum_k float(A[m, k]) * float(B[n, k]) )

A (M, K) and B (N, K) are float8_e4m3fn with K contiguous ("TN"; both operands K-major, the only
operand layout FP8 wgmma accepts). scale_a/scale_b are one-element float32 tensors read on device.

Design (one CTA per output tile, not persistent, no clusters):
- TMA (cp.async.bulk.tensor) loads (BM, BK) tiles of A and (BN, BK) tiles of B into 128B-swizzled
  shared memory; a ``stages``-deep ring of buffers with full/empty mbarriers (PipelineTmaAsync).
  One thread of the CTA issues the loads; TMA zero-fills rows/columns past M, N and K, so the
  mainloop has no bounds checks.
- BM // 64 warpgroups each own a (64, BN) slice of the tile and issue ``wgmma.mma_async`` (m64nBNk32,
  e4m3 x e4m3 -> f32) straight from shared memory. One k-tile of wgmmas stays in flight
  (wait_group(1)) while the next stage is consumed; a stage is released once its wgmmas retired.
- Epilogue: fp32 accumulators * (scale_a * scale_b) -> bf16 in registers, stored to global memory
  by each thread (vectorised for interior tiles, predicated per element on the M/N edges).
  A TMA-store epilogue through shared memory would be faster; this one is simpler to get right.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

AB_DTYPE = cutlass.Float8E4M3FN
ACC_DTYPE = cutlass.Float32
OUT_DTYPE = cutlass.BFloat16
WGMMA_M = 64  # rows per warpgroup MMA instruction
WARPGROUP_THREADS = 128


class Fp8GemmSm90:
    """One compiled configuration: tile (BM, BN, BK) and pipeline depth are compile-time constants."""

    def __init__(self, tile_m: int = 128, tile_n: int = 128, tile_k: int = 128, stages: int = 4):
        assert tile_m % WGMMA_M == 0 and tile_n % 8 == 0 and 8 <= tile_n <= 256
        assert tile_k % 32 == 0
        self.tile_mnk = (tile_m, tile_n, tile_k)
        self.stages = stages
        self.num_warpgroups = tile_m // WGMMA_M
        self.num_threads = self.num_warpgroups * WARPGROUP_THREADS

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, d_ptr: cute.Pointer,
                 scale_a_ptr: cute.Pointer, scale_b_ptr: cute.Pointer,
                 m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, stream: cuda_driver.CUstream):
        tile_m, tile_n, tile_k = self.tile_mnk
        # The caller checks K % 16 == 0 (TMA needs 16-byte aligned row strides) and N % 8 == 0 (16-byte
        # aligned rows of D, so the epilogue can store several bf16 at once).
        k_aligned = cute.assume(k, divby=16)
        n_aligned = cute.assume(n, divby=8)
        m_a = cute.make_tensor(a_ptr, cute.make_layout((m, k_aligned), stride=(k_aligned, 1)))  # (M, K)
        m_b = cute.make_tensor(b_ptr, cute.make_layout((n_aligned, k_aligned), stride=(k_aligned, 1)))  # (N, K)
        m_d = cute.make_tensor(d_ptr, cute.make_layout((m, n_aligned), stride=(n_aligned, 1)))  # (M, N)
        scale_a = cute.make_tensor(scale_a_ptr, cute.make_layout(1))
        scale_b = cute.make_tensor(scale_b_ptr, cute.make_layout(1))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            AB_DTYPE, AB_DTYPE, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, ACC_DTYPE,
            (self.num_warpgroups, 1, 1), (WGMMA_M, tile_n))
        # (BM, BK, stages) and (BN, BK, stages), 128B-swizzled K-major atoms.
        sa_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile_mnk, AB_DTYPE, self.stages)
        sb_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, AB_DTYPE, self.stages)
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, m_a_tma = cpasync.make_tiled_tma_atom(
            tma_op, m_a, cute.slice_(sa_layout, (None, None, 0)), (tile_m, tile_k))
        tma_b, m_b_tma = cpasync.make_tiled_tma_atom(
            tma_op, m_b, cute.slice_(sb_layout, (None, None, 0)), (tile_n, tile_k))

        grid = (cute.ceil_div(m, tile_m), cute.ceil_div(n, tile_n), 1)
        self.kernel(tiled_mma, tma_a, m_a_tma, tma_b, m_b_tma, m_d, scale_a, scale_b,
                    sa_layout, sb_layout).launch(grid=grid, block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, m_a_tma: cute.Tensor,
               tma_b: cute.CopyAtom, m_b_tma: cute.Tensor, m_d: cute.Tensor,
               scale_a: cute.Tensor, scale_b: cute.Tensor,
               sa_layout: cute.ComposedLayout, sb_layout: cute.ComposedLayout):
        tile_m, tile_n, tile_k = self.tile_mnk
        tidx, _, _ = cute.arch.thread_idx()
        bid_m, bid_n, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        is_tma_thread = tidx == 0

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = SmemAllocator()
        barriers = smem.allocate_array(cutlass.Int64, 2 * self.stages, byte_alignment=8)
        # The swizzle goes on the pointer (wgmma descriptors want an affine layout over it).
        s_a = smem.allocate_tensor(AB_DTYPE, sa_layout.outer, 1024, sa_layout.inner)  # (BM, BK, stages)
        s_b = smem.allocate_tensor(AB_DTYPE, sb_layout.outer, 1024, sb_layout.inner)  # (BN, BK, stages)

        stage_bytes = (tile_m + tile_n) * tile_k * (AB_DTYPE.width // 8)
        # Empty barriers: lane 0 of every consumer warp arrives once per stage it releases.
        ring = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_threads // 32),
            tx_count=stage_bytes,
            barrier_storage=barriers,
        )

        # This CTA's tiles of the TMA coordinate tensors.
        g_a = cute.local_tile(m_a_tma, (tile_m, tile_k), (bid_m, None))  # (BM, BK, k_tiles)
        g_b = cute.local_tile(m_b_tma, (tile_n, tile_k), (bid_n, None))  # (BN, BK, k_tiles)
        t_as, t_ag = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2))
        t_bs, t_bg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2))
        # t_as: (TMA, stages), t_ag: (TMA, k_tiles)

        thr_mma = tiled_mma.get_slice(tidx)
        t_cs_a = thr_mma.partition_A(s_a)  # (MMA, MMA_M, MMA_K, stages)
        t_cs_b = thr_mma.partition_B(s_b)  # (MMA, MMA_N, MMA_K, stages)
        t_cr_a = tiled_mma.make_fragment_A(t_cs_a)  # smem descriptors
        t_cr_b = tiled_mma.make_fragment_B(t_cs_b)

        g_d = cute.local_tile(m_d, (tile_m, tile_n), (bid_m, bid_n))  # (BM, BN)
        t_cg_d = thr_mma.partition_C(g_d)  # (MMA, MMA_M, MMA_N)
        acc = cute.make_rmem_tensor(t_cg_d.shape, ACC_DTYPE)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        k_tiles = cute.size(g_a, mode=[2])
        k_blocks = cute.size(t_cr_a, mode=[2])
        prefetch = cutlass.min(self.stages - 1, k_tiles)

        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        for kt in range(prefetch):
            if is_tma_thread:
                ring.producer_acquire(produce)
                bar = ring.producer_get_barrier(produce)
                cute.copy(tma_a, t_ag[None, kt], t_as[None, produce.index], tma_bar_ptr=bar)
                cute.copy(tma_b, t_bg[None, kt], t_bs[None, produce.index], tma_bar_ptr=bar)
            produce.advance()

        for kt in range(k_tiles):
            ring.consumer_wait(consume)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, t_cr_a[None, None, kb, consume.index],
                          t_cr_b[None, None, kb, consume.index], acc)
            warpgroup.commit_group()
            # The wgmmas of k-tile kt-1 have retired now: hand their stage back to the producer.
            warpgroup.wait_group(1)
            if kt > 0:
                ring.consumer_release(release)
                release.advance()
            consume.advance()
            if kt + prefetch < k_tiles:
                if is_tma_thread:
                    ring.producer_acquire(produce)
                    bar = ring.producer_get_barrier(produce)
                    cute.copy(tma_a, t_ag[None, kt + prefetch], t_as[None, produce.index], tma_bar_ptr=bar)
                    cute.copy(tma_b, t_bg[None, kt + prefetch], t_bs[None, produce.index], tma_bar_ptr=bar)
                produce.advance()
        warpgroup.wait_group(0)

        # Epilogue: scale, round to bf16, store (vectorised inside the matrix, predicated on edges).
        scale = scale_a[0] * scale_b[0]
        out = cute.make_rmem_tensor(t_cg_d.shape, OUT_DTYPE)
        out.store((acc.load() * scale).to(OUT_DTYPE))
        m_total, n_total = m_d.shape
        if (bid_m + 1) * tile_m <= m_total and (bid_n + 1) * tile_n <= n_total:
            cute.autovec_copy(out, t_cg_d)
        else:
            c_d = cute.local_tile(cute.make_identity_tensor(m_d.shape), (tile_m, tile_n), (bid_m, bid_n))
            t_cc_d = thr_mma.partition_C(c_d)  # (MMA, MMA_M, MMA_N) of (m, n) coordinates
            for i in cutlass.range(cute.size(out), unroll_full=True):
                if cute.elem_less(t_cc_d[i], m_d.shape):
                    t_cg_d[i] = out[i]
