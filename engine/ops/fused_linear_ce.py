"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` without the (tokens, vocab) logits.

Tokens are processed in chunks of ``chunk_size``: only one (chunk, vocab_local) logits block lives at
a time, so peak extra memory is ~``chunk_size * vocab_local`` elements instead of
``tokens * vocab``. Per chunk the logits come from one matmul (cuBLAS / CPU BLAS); a Triton kernel
(or its PyTorch reference) reduces each row to four float32 statistics:

    m = max_j z_j,   S = sum_j exp(z_j - m),   z_t = z[target],   Z = sum_j z_j

Tensor parallel (vocab-parallel, as Megatron's ``vocab_parallel_cross_entropy``): ``weight`` is
this rank's vocab shard ``[vocab_start, vocab_start + V_local)``. Targets outside the shard give
``z_t = 0`` locally. After all chunks the statistics of all tokens are combined across the TP group
with exactly two collectives (not two per chunk): ``all_reduce_max(m)``, then each rank rescales
``S *= exp(m_local - m)`` and one ``all_reduce_sum`` over the packed ``[S, z_t, Z, V_local]``.
Then, with ``eps = label_smoothing`` and ``V`` the full vocab size:

    lse  = m + log(S)
    loss = lse - (1 - eps) * z_t - eps / V * Z        (0 where target == ignore_index)

which equals ``F.cross_entropy(..., label_smoothing=eps, reduction="none")`` on the full logits.

Backward recomputes the logits block by block (one more matmul; nothing of size tokens x vocab is
stored): vocab blocks of ``Vb`` weight rows outside, all tokens inside, each (T, Vb) tile the size of
a forward chunk. It turns each tile in place into ``dz = g * (softmax - eps / V - (1 - eps) *
onehot)``, writes the block's ``grad_weight = dz.T @ h`` once in the weight dtype (no (V, H)
accumulator) and adds ``dz @ W_block`` into a (T, H) accumulator for ``grad_hidden`` (fp32 for
bf16/fp16, rounded once). Under TP, ``grad_hidden`` is
this shard's partial sum over its vocab slice: the caller's ``copy_to_tp`` (the identity whose
backward all-reduces) sums it over the group, as for any column-parallel linear. The backward needs
no communication of its own.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.ops._triton import Kernel, check_float, check_same_device, check_triton_dtype, use_triton

_OP = "fused_linear_cross_entropy"
_BLOCK_V = 4096
_CHUNK_ELEMENTS = 1 << 26  # auto chunk: ~64M logits elements (128 MiB in bf16) per chunk
# Finite "minus infinity" for the running max (keeps exp(m - m_new) finite); constexpr so kernels may read it.
_NEG_BIG = tl.constexpr(-3.0e38)


class TPReduce(Protocol):
    """In-place collectives over the tensor-parallel group (implemented in parallel/)."""

    def all_reduce_max(self, t: Tensor) -> None: ...

    def all_reduce_sum(self, t: Tensor) -> None: ...


# ----------------------------------------------------------------------------------------------
# Oracle: full logits + torch cross-entropy (single shard; what tests and benchmarks compare to)
# ----------------------------------------------------------------------------------------------
def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, target: Tensor, *,
                                   ignore_index: int = -100, label_smoothing: float = 0.0) -> Tensor:
    """Unfused, single shard: materialises (tokens, vocab) logits. Returns float32 loss of target's shape."""
    logits = (hidden @ weight.t()).float()  # (..., V)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction="none")
    return loss.view(target.shape)


# ----------------------------------------------------------------------------------------------
# Row kernels (Triton) and their PyTorch references
# ----------------------------------------------------------------------------------------------
@Kernel
def _ce_stats_kernel(Z, TGT, M, SUMEXP, ZT, SUMZ, stride_z, n_vocab, vocab_start,
                     BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    # Per-lane online softmax: each lane keeps its own running max and sum; lanes are combined
    # once at the end, so the loop has no cross-lane reductions except for the logit sum.
    m_lane = tl.full((BLOCK_V,), _NEG_BIG, tl.float32)
    s_lane = tl.zeros((BLOCK_V,), tl.float32)
    z_sum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, n_vocab, BLOCK_V):
        mask = start + cols < n_vocab
        z = tl.load(z_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, z)
        s_lane = s_lane * tl.exp(m_lane - m_new) + tl.exp(z - m_new)
        m_lane = m_new
        z_sum += tl.where(mask, z, 0.0)
    m = tl.max(m_lane, axis=0)
    tl.store(M + row, m)
    tl.store(SUMEXP + row, tl.sum(s_lane * tl.exp(m_lane - m), axis=0))
    tl.store(SUMZ + row, tl.sum(z_sum, axis=0))
    t = tl.load(TGT + row) - vocab_start
    in_shard = (t >= 0) & (t < n_vocab)
    z_t = tl.load(z_row + tl.where(in_shard, t, 0), mask=in_shard, other=0.0).to(tl.float32)
    tl.store(ZT + row, z_t)


@Kernel
def _ce_grad_kernel(Z, TGT, LSE, G, SMOOTH, stride_z, n_vocab, vocab_start, ignore_index,
                    one_minus_eps, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(TGT + row)
    g = tl.load(G + row).to(tl.float32)
    g = tl.where(target == ignore_index, 0.0, g)
    lse = tl.load(LSE + row)
    smooth = tl.load(SMOOTH)
    t = target - vocab_start
    for start in range(0, n_vocab, BLOCK_V):
        idx = start + cols
        mask = idx < n_vocab
        z = tl.load(z_row + idx, mask=mask, other=0.0).to(tl.float32)
        dz = tl.exp(z - lse) - smooth - tl.where(idx == t, one_minus_eps, 0.0)
        tl.store(z_row + idx, (dz * g).to(Z.dtype.element_ty), mask=mask)


def _chunk_stats(logits: Tensor, target: Tensor, stats: Tensor, vocab_start: int, triton_: bool):
    """Fill stats (4, c) = [m, S, z_t, Z] for logits (c, V_local)."""
    rows, n_vocab = logits.shape
    if triton_:
        _ce_stats_kernel.on(logits.device)[(rows,)](
            logits, target, stats[0], stats[1], stats[2], stats[3], logits.stride(0), n_vocab,
            vocab_start, BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(n_vocab)), num_warps=8)
        return
    z = logits.float()  # (c, V_local)
    m = z.amax(dim=1)
    stats[0] = m
    stats[1] = torch.exp(z - m[:, None]).sum(dim=1)
    stats[3] = z.sum(dim=1)
    local = target - vocab_start
    in_shard = (local >= 0) & (local < n_vocab)
    picked = z.gather(1, torch.where(in_shard, local, 0)[:, None]).squeeze(1)
    stats[2] = torch.where(in_shard, picked, 0.0)


def _chunk_grad(logits: Tensor, target: Tensor, lse: Tensor, grad: Tensor, smooth: Tensor,
                vocab_start: int, ignore_index: int, label_smoothing: float, triton_: bool):
    """Overwrite logits (c, V_local) with d loss / d logits, in the logits dtype."""
    rows, n_vocab = logits.shape
    if triton_:
        _ce_grad_kernel.on(logits.device)[(rows,)](
            logits, target, lse, grad, smooth, logits.stride(0), n_vocab, vocab_start,
            ignore_index, 1.0 - label_smoothing,
            BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(n_vocab)), num_warps=8)
        return
    dz = torch.exp(logits.float() - lse[:, None]) - smooth  # (c, V_local)
    local = target - vocab_start
    in_shard = (local >= 0) & (local < n_vocab)
    # Subtract (1 - eps) at each in-shard target; a scatter rather than indexing by nonzero()
    # keeps this free of host syncs and data-dependent shapes.
    hit = torch.where(in_shard, -(1.0 - label_smoothing), 0.0).to(dz.dtype)[:, None]  # (c, 1)
    dz.scatter_add_(1, torch.where(in_shard, local, 0)[:, None], hit)
    g = torch.where(target == ignore_index, 0.0, grad.float())
    logits.copy_(dz * g[:, None])


# ----------------------------------------------------------------------------------------------
# Chunked forward / backward, shared by the single-shard custom op and the TP autograd Function
# ----------------------------------------------------------------------------------------------
def _auto_chunk(tokens: int, v_local: int) -> int:
    """Tokens per chunk: the largest power of two with chunk * v_local <= _CHUNK_ELEMENTS."""
    chunk = max(1, _CHUNK_ELEMENTS // max(v_local, 1))
    return max(1, min(tokens, 1 << (chunk.bit_length() - 1)))


def _forward(hidden: Tensor, weight: Tensor, target: Tensor, *, vocab_start: int,
             tp_reduce: Optional[TPReduce], ignore_index: int, label_smoothing: float,
             chunk_size: int, triton_: bool) -> tuple[Tensor, Tensor, Tensor]:
    """hidden (T, H), weight (V_local, H), target (T,) -> loss (T,), lse (T,), smooth (1,): fp32."""
    tokens, v_local = hidden.shape[0], weight.shape[0]
    stats = torch.empty(4, tokens, dtype=torch.float32, device=hidden.device)  # [m, S, z_t, Z]
    if v_local == 0:  # a TP shard made only of vocab padding: contributes nothing to any token
        stats[0].fill_(_NEG_BIG.value)
        stats[1:].zero_()
    for start in range(0, tokens if v_local else 0, chunk_size):
        end = min(start + chunk_size, tokens)
        logits = hidden[start:end] @ weight.t()  # (c, V_local): the only vocab-sized buffer
        _chunk_stats(logits, target[start:end], stats[:, start:end], vocab_start, triton_)
        del logits
    m, sumexp, z_t, z_sum = stats
    n_vocab = torch.full((1,), float(v_local), dtype=torch.float32, device=hidden.device)
    if tp_reduce is not None:
        m_global = m.clone()
        tp_reduce.all_reduce_max(m_global)
        sumexp.mul_(torch.exp(m - m_global))
        packed = torch.cat([stats[1:].reshape(-1), n_vocab])  # (3T + 1,): [S, z_t, Z, V_local]
        tp_reduce.all_reduce_sum(packed)
        sumexp, z_t, z_sum = packed[:-1].view(3, tokens)  # (T,) each
        m, n_vocab = m_global, packed[-1:]
    lse = m + torch.log(sumexp)
    smooth = label_smoothing / n_vocab  # (1,): eps / V, on device (no host sync under TP)
    loss = lse - (1.0 - label_smoothing) * z_t - smooth * z_sum
    loss = torch.where(target == ignore_index, 0.0, loss)
    return loss, lse, smooth


def _vocab_block(tokens: int, v_local: int, chunk_size: int) -> int:
    """Weight rows per backward block: the (T, block) gradient tile holds as many elements as the
    forward's (chunk_size, V_local) logits chunk."""
    return max(1, min(v_local, (chunk_size * v_local) // max(tokens, 1)))


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with the product kept at ``acc``'s precision (fp32 for bf16/fp16 operands)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        # cuBLAS accumulates in fp32 and can return the fp32 result (torch >= 2.8); else upcast.
        try:
            acc += torch.mm(a, b, out_dtype=acc.dtype)
        except (TypeError, RuntimeError, NotImplementedError):
            acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor,
              smooth: Tensor, *, vocab_start: int, ignore_index: int, label_smoothing: float,
              chunk_size: int, triton_: bool, need_hidden: bool, need_weight: bool):
    """Returns (grad_hidden (T, H) or None, grad_weight (V_local, H) or None).

    Vocab blocks outside, all tokens inside: for each block of ``Vb`` weight rows the logits
    ``(T, Vb)`` are recomputed and turned in place into d loss / d logits; then
    ``grad_weight[block] = dz.T @ hidden`` is written once, in the weight's dtype (no (V, H)
    accumulator and no per-chunk (V, H) temporaries), and ``grad_hidden += dz @ w_block`` goes into
    a (T, H) accumulator (fp32 for bf16/fp16, rounded once at the end). Extra memory: one (T, Vb)
    tile (the size of a forward chunk) plus the (T, H) accumulator.
    """
    tokens, v_local = hidden.shape[0], weight.shape[0]
    grad_loss = grad_loss.contiguous()
    low = hidden.dtype in (torch.bfloat16, torch.float16)
    acc = (torch.zeros(hidden.shape, dtype=torch.float32 if low else hidden.dtype, device=hidden.device)
           if need_hidden else None)  # (T, H)
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_weight else None
    block = _vocab_block(tokens, v_local, chunk_size)
    for v0 in range(0, v_local if tokens else 0, block):
        v1 = min(v0 + block, v_local)
        w_block = weight[v0:v1]  # (Vb, H)
        dz = hidden @ w_block.t()  # (T, Vb): recomputed logits, overwritten by their gradient
        _chunk_grad(dz, target, lse, grad_loss, smooth, vocab_start + v0, ignore_index,
                    label_smoothing, triton_)
        if need_weight:
            torch.mm(dz.t(), hidden, out=grad_weight[v0:v1])
        if need_hidden:
            _add_product(acc, dz, w_block)
        del dz
    grad_hidden = None
    if need_hidden:
        grad_hidden = acc.to(hidden.dtype) if acc.dtype != hidden.dtype else acc
    return grad_hidden, grad_weight


# ----------------------------------------------------------------------------------------------
# Single shard: torch.library custom op (traceable by torch.compile)
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("tessel::fused_linear_ce_fwd", mutates_args=())
def _flce_fwd(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
              label_smoothing: float, chunk_size: int, triton_: bool) -> tuple[Tensor, Tensor]:
    loss, lse, _ = _forward(hidden, weight, target, vocab_start=0, tp_reduce=None,
                            ignore_index=ignore_index, label_smoothing=label_smoothing,
                            chunk_size=chunk_size, triton_=triton_)
    return loss, lse


@_flce_fwd.register_fake
def _(hidden, weight, target, ignore_index, label_smoothing, chunk_size, triton_):
    shape = (hidden.shape[0],)
    return hidden.new_empty(shape, dtype=torch.float32), hidden.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("tessel::fused_linear_ce_bwd", mutates_args=())
def _flce_bwd(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor,
              ignore_index: int, label_smoothing: float, chunk_size: int, triton_: bool,
              need_hidden: bool, need_weight: bool) -> tuple[Tensor, Tensor]:
    """Returns (grad_hidden, grad_weight); a gradient not needed comes back empty."""
    smooth = torch.full((1,), label_smoothing / weight.shape[0], dtype=torch.float32,
                        device=hidden.device)
    gh, gw = _backward(grad_loss, hidden, weight, target, lse, smooth, vocab_start=0,
                       ignore_index=ignore_index, label_smoothing=label_smoothing,
                       chunk_size=chunk_size, triton_=triton_, need_hidden=need_hidden,
                       need_weight=need_weight)
    return (gh if gh is not None else hidden.new_empty(0),
            gw if gw is not None else weight.new_empty(0))


@_flce_bwd.register_fake
def _(grad_loss, hidden, weight, target, lse, ignore_index, label_smoothing, chunk_size, triton_,
      need_hidden, need_weight):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, ignore_index, label_smoothing, chunk_size, triton_ = inputs
    ctx.save_for_backward(hidden, weight, target, output[1])
    ctx.args = (ignore_index, label_smoothing, chunk_size, triton_)


def _custom_op_backward(ctx, grad_loss, grad_lse):
    hidden, weight, target, lse = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gh, gw = _flce_bwd(grad_loss, hidden, weight, target, lse, *ctx.args, need_hidden, need_weight)
    return (gh if need_hidden else None), (gw if need_weight else None), None, None, None, None, None


_flce_fwd.register_autograd(_custom_op_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Tensor parallel: an autograd Function (the reduce object cannot cross the torch.library boundary)
# ----------------------------------------------------------------------------------------------
class _FusedLinearCETP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_start, tp_reduce, ignore_index, label_smoothing,
                chunk_size, triton_):
        loss, lse, smooth = _forward(hidden, weight, target, vocab_start=vocab_start,
                                     tp_reduce=tp_reduce, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, chunk_size=chunk_size,
                                     triton_=triton_)
        ctx.save_for_backward(hidden, weight, target, lse, smooth)
        ctx.args = dict(vocab_start=vocab_start, ignore_index=ignore_index,
                        label_smoothing=label_smoothing, chunk_size=chunk_size, triton_=triton_)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target, lse, smooth = ctx.saved_tensors
        gh, gw = _backward(grad_loss, hidden, weight, target, lse, smooth, **ctx.args,
                           need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])
        return gh, gw, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check(hidden, weight, target, vocab_start, tp_reduce, label_smoothing, chunk_size) -> None:
    check_float(hidden, name="hidden", op=_OP)
    check_float(weight, name="weight", op=_OP)
    if weight.dim() != 2 or hidden.dim() == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{_OP}: weight must be (vocab_local, hidden) with hidden = hidden.shape[-1]; "
                         f"got weight {tuple(weight.shape)} for hidden {tuple(hidden.shape)}.")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{_OP}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a "
                         "dtype; cast one of them (e.g. both bfloat16).")
    if target.dtype.is_floating_point or target.dtype == torch.bool or target.shape != hidden.shape[:-1]:
        raise ValueError(f"{_OP}: target must be an integer tensor of shape hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}; got {target.dtype} {tuple(target.shape)}.")
    if tp_reduce is None and vocab_start != 0:
        raise ValueError(f"{_OP}: vocab_start={vocab_start} needs tp_reduce (the shard's group "
                         "collectives); a single shard holds the whole vocab at offset 0.")
    if tp_reduce is None and weight.shape[0] == 0:
        raise ValueError(f"{_OP}: weight has no rows; a single shard must hold the whole vocabulary.")
    if vocab_start < 0:
        raise ValueError(f"{_OP}: vocab_start={vocab_start} must be >= 0.")
    if tp_reduce is not None and not all(callable(getattr(tp_reduce, name, None))
                                         for name in ("all_reduce_max", "all_reduce_sum")):
        raise ValueError(f"{_OP}: tp_reduce must provide in-place all_reduce_max(t) and "
                         f"all_reduce_sum(t) over the TP group; got {type(tp_reduce).__name__}.")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"{_OP}: label_smoothing={label_smoothing} must be in [0, 1).")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"{_OP}: chunk_size={chunk_size!r} must be a positive int or None (auto).")
    check_same_device(_OP, hidden=hidden, weight=weight, target=target)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                               vocab_start: int = 0, tp_reduce: Optional[TPReduce] = None,
                               ignore_index: int = -100, label_smoothing: float = 0.0,
                               chunk_size: Optional[int] = None, backend: str = "auto") -> Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` against ``target``, never materialising logits.

    hidden: (..., H) e.g. (s, b, H); weight: (V_local, H), same dtype; target: hidden.shape[:-1],
    integer, global vocab ids (or ``ignore_index``). With ``tp_reduce`` (in-place all_reduce_max /
    all_reduce_sum over the TP group) ``weight`` is the shard starting at ``vocab_start``.
    Returns the unreduced float32 loss of target's shape; ignored tokens get 0 and no gradient.
    ``chunk_size``: tokens per chunk (None: about 64M logits elements per chunk).
    Gradients flow to hidden (this shard's partial sum under TP) and weight. On CPU tensors,
    target ids are range-checked in eager mode; on CUDA they are not (that would cost a host sync).
    """
    _check(hidden, weight, target, vocab_start, tp_reduce, label_smoothing, chunk_size)
    triton_ = use_triton(backend, hidden, op=_OP)
    if triton_:
        check_triton_dtype(hidden, name="hidden", op=_OP)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (T, H)
    target1 = target.reshape(-1).to(torch.int64)  # (T,)
    # A data-dependent check: only where it is free (CPU, eager; not while torch.compile traces).
    if (hidden.device.type == "cpu" and tp_reduce is None and target1.numel() > 0
            and not torch.compiler.is_compiling()):
        bad = (target1 != ignore_index) & ((target1 < 0) | (target1 >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"{_OP}: target has ids outside [0, {weight.shape[0]}) that are not "
                             f"ignore_index={ignore_index}: {target1[bad][:5].tolist()}.")
    chunk = chunk_size or _auto_chunk(hidden2.shape[0], weight.shape[0])
    if hidden2.shape[0] == 0:
        return hidden.new_zeros(target.shape, dtype=torch.float32)
    if tp_reduce is None:
        loss, _ = _flce_fwd(hidden2, weight, target1, int(ignore_index), float(label_smoothing),
                            int(chunk), triton_)
    else:
        loss = _FusedLinearCETP.apply(hidden2, weight, target1, int(vocab_start), tp_reduce,
                                      int(ignore_index), float(label_smoothing), int(chunk), triton_)
    return loss.view(target.shape)


class FusedLinearCrossEntropy(torch.nn.Module):
    """Module form: ``forward(hidden, weight, target)`` with the options fixed at construction."""

    def __init__(self, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                 chunk_size: Optional[int] = None, backend: str = "auto"):
        super().__init__()
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.chunk_size = chunk_size
        self.backend = backend

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, *, vocab_start: int = 0,
                tp_reduce: Optional[TPReduce] = None) -> Tensor:
        return fused_linear_cross_entropy(
            hidden, weight, target, vocab_start=vocab_start, tp_reduce=tp_reduce,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            chunk_size=self.chunk_size, backend=self.backend)
