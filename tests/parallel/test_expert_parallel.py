"""Expert parallelism: router, permutation, dispatchers over the ep group, the MoE layer.

Parity: at ep = 2 and 4 (alltoall and allgather dispatchers), and at tp = 2 x ep = 2 (with and without
sequence parallelism, and with ``expert_tp=1``: whole experts, each tp rank routing its own SP chunk), each
rank's outputs equal the 1-process layer's (all experts) on the same tokens, and its experts' gradients
equal the 1-process gradients of the summed loss of all ep ranks (fp32, dropless, atol 1e-6); replicated
parameters' gradients (router, shared expert) summed over ep equal the reference (at expert_tp=1 the
``sequence_parallel`` ones summed over tp first, as the trainer does); the aux and z losses equal the
reference's on the whole sequence (1e-6). Ledger: the all-to-all sends exactly the rows routed to other
ranks' experts, computed from the routing decisions (at expert_tp=1 from the rank's own chunk), in each
direction, and the count exchange E - E_local int64; at expert_tp=1 nothing of the routed experts crosses
tp (the only tp all-reduce is the 2E + 3 counts).
"""
from __future__ import annotations

import pytest
import torch

from parallel import comm
from parallel.comm import Group
from parallel.expert_parallel import (MoELayer, TopKRouter, check_routing, default_init, load_balancing_loss, permute,
                                      unpermute)
from parallel.testing import run_distributed

H, F_EXPERT, F_SHARED, E, K = 8, 6, 4, 8, 2


def test_router_renormalisation_per_family():
    torch.manual_seed(0)
    x = torch.randn(10, H)
    mixtral = TopKRouter(H, E, top_k=K, norm_topk_prob=True)
    torch.nn.init.normal_(mixtral.weight)
    r = mixtral(x)
    # Mixtral: softmax then top-k renormalised == softmax over the top-k logits.
    top_logits = r.logits.gather(1, r.indices)
    assert torch.allclose(r.weights, torch.softmax(top_logits, dim=-1), atol=1e-6)
    qwen = TopKRouter(H, E, top_k=K, norm_topk_prob=False)
    qwen.weight.data.copy_(mixtral.weight.data)
    q = qwen(x)
    assert torch.equal(q.indices, r.indices)
    assert torch.allclose(q.weights, torch.softmax(q.logits, -1).gather(1, q.indices))
    # One layer's aux loss: E * sum_e f_e P_e with f_e the share of top-k assignments.
    stats = mixtral.stats(r)
    f = torch.bincount(r.indices.flatten(), minlength=E).float() / 10
    assert torch.allclose(load_balancing_loss([stats], num_experts=E), E * (f * r.probs.mean(0)).sum())


def test_permute_then_unpermute_by_index():
    torch.manual_seed(1)
    tokens = torch.randn(7, H)
    indices = torch.stack([torch.randperm(E)[:K] for _ in range(7)])  # (T, k) distinct experts per token
    rows, order, counts = permute(tokens, indices, num_experts=E)
    assert torch.equal(counts, torch.bincount(indices.flatten(), minlength=E))
    experts_of_rows = indices.flatten()[order]
    assert torch.equal(experts_of_rows, experts_of_rows.sort().values)  # expert-contiguous
    weights = torch.full((7, K), 1.0 / K)
    assert torch.allclose(unpermute(rows, order, weights, num_tokens=7), tokens)


def test_bad_input_is_refused():
    from parallel.expert_parallel import check_expert_tp

    assert check_expert_tp(None, tp=2, sequence_parallel=False) == 2 and check_expert_tp(1, tp=1,
                                                                                         sequence_parallel=False) == 1
    with pytest.raises(ValueError, match="parallel.expert_tp=3 is not built at parallel.tp=2.*set parallel.expert_tp "
                                         "to 1 or 2"):
        check_expert_tp(3, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="parallel.expert_tp=1 at parallel.tp=2 needs sequence parallelism.*set "
                                         "parallel.sequence_parallel=true, or parallel.expert_tp=2"):
        check_expert_tp(1, tp=2, sequence_parallel=False)
    with pytest.raises(ValueError, match="not divisible by parallel.ep=3.*choose ep in \\[1, 2, 4, 8\\]"):
        check_routing(num_experts=8, top_k=2, ep=3)
    with pytest.raises(ValueError, match="top_k=9 .* exceeds num_experts=8"):
        check_routing(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="moe_dispatcher='ring'"):
        MoELayer(hidden_size=H, ffn_hidden_size=F_EXPERT, num_experts=E, top_k=K, tp_group=Group.trivial("tp"),
                 ep_group=Group.trivial("ep"), dispatcher="ring")


def _layer(tp, ep, dispatcher, *, sp=False, capacity=None, expert_tp=None):
    return MoELayer(hidden_size=H, ffn_hidden_size=F_EXPERT, num_experts=E, top_k=K, tp_group=tp, ep_group=ep,
                    dispatcher=dispatcher, sequence_parallel=sp, shared_expert_ffn_hidden_size=F_SHARED,
                    norm_topk_prob=False, aux_loss_coef=0.01, z_loss_coef=0.001, init=default_init(0.3, seed=5),
                    capacity_factor=capacity, expert_tp=expert_tp)


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(6, 2, H, generator=g), torch.randn(6, 2, H, generator=g)  # x (s, b, h), dL/dout


def _reference(members: list[int], capacity=None):
    """The 1-process layer over each member's batch; loss summed over members."""
    ref = _layer(Group.trivial("tp"), Group.trivial("ep"), "alltoall", capacity=capacity)
    outs = {}
    for m in members:
        x, g = _batch(m)
        x.requires_grad_()
        out = ref(x)
        (out * g).sum().backward()
        outs[m] = (out.detach(), x.grad, ref.last_aux_loss.item(), ref.last_z_loss.item())
    return ref, outs


def _remote_rows(members: list[int], me: int, ref, rows=slice(None)) -> tuple[int, int]:
    """(rows I send to other ranks' experts, rows other ranks send to mine), from the routing decisions on
    each member's sequence positions ``rows`` (its SP chunk when every tp rank routes its own)."""
    per_rank = E // len(members)
    owner = lambda idx: idx // per_rank  # noqa: E731
    sent = recv = 0
    with torch.no_grad():
        for pos, m in enumerate(members):
            owners = owner(ref.router(_batch(m)[0][rows].reshape(-1, H)).indices)
            if pos == me:
                sent = int((owners != me).sum())
            else:
                recv += int((owners == me).sum())
    return sent, recv


def _check_ep(mesh_ep, dp_index: int, members: list[int], dispatcher: str, tp=None, sp=False, capacity=None,
              expert_tp=None) -> dict:
    tp = tp or Group.trivial("tp")
    ref, ref_out = _reference(members, capacity)
    layer = _layer(tp, mesh_ep, dispatcher, sp=sp, capacity=capacity, expert_tp=expert_tp)
    x, g = _batch(dp_index)
    mine = slice(None)
    if sp:
        chunk = x.shape[0] // tp.size
        mine = slice(tp.rank * chunk, (tp.rank + 1) * chunk)
        x, g = x[mine], g[mine]
    x.requires_grad_()
    with mesh_ep.ledger.capture() as cap:
        out = layer(x)
        (out * g).sum().backward()
    want, want_dx, want_aux, want_z = ref_out[dp_index]
    want, want_dx = want[mine], want_dx[mine]
    res = {"out": (out.detach() - want).abs().max().item(), "dx": (x.grad - want_dx).abs().max().item(),
           "aux": abs(layer.last_aux_loss.item() - want_aux) / max(1.0, abs(want_aux)),  # relative above 1
           "z": abs(layer.last_z_loss.item() - want_z) / max(1.0, abs(want_z))}
    ref_params = dict(ref.named_parameters())
    err = 0.0
    for name, p in layer.named_parameters():
        grad = p.grad
        if getattr(p, "tensor_parallel", False):
            from parallel.tensor_parallel import full_param
            grad = full_param(p, tp, grad=True)
        if getattr(p, "sequence_parallel", False):  # each tp rank's tokens: the trainer sums these over tp
            grad = grad.clone()
            comm.all_reduce(grad, tp)
        if not getattr(p, "expert", False):
            grad = grad.clone()
            comm.all_reduce(grad, mesh_ep)  # replicated over ep: each rank holds its tokens' share
        err = max(err, (grad - ref_params[name].grad).abs().max().item())
    res["grad"] = err
    res["local_experts"] = sorted({int(n.split(".")[1]) for n, _ in layer.named_parameters()
                                   if n.startswith("experts.")})
    res["dropped"] = layer.last_dropped_fraction
    if layer.local_routing:  # the experts' rows never cross tp: the one tp all-reduce is the 2E + 3 counts
        res["tp_all_reduce"] = [(r.dtype, r.sent_bytes) for r in cap.select(op="all_reduce", axis="tp")]
    if dispatcher == "alltoall" and capacity is None:
        sent, recv = _remote_rows(members, mesh_ep.rank, ref, rows=mine if layer.local_routing else slice(None))
        rows = [r for r in cap.select(op="all_to_all", axis="ep") if r.dtype == "torch.float32"]
        counts = [r for r in cap.select(op="all_to_all", axis="ep") if r.dtype == "torch.int64"]
        row_bytes = H * 4
        res["a2a"] = ([r.sent_bytes for r in rows], [r.recv_bytes for r in rows], [r.sent_bytes for r in counts])
        # forward dispatch, forward combine, backward of the combine, backward of the dispatch
        res["a2a_want"] = ([sent * row_bytes, recv * row_bytes, sent * row_bytes, recv * row_bytes],
                           [recv * row_bytes, sent * row_bytes, recv * row_bytes, sent * row_bytes],
                           [(E - E // mesh_ep.size) * 8])
    return res


def _model_logits_error(mesh, dp_index: int) -> dict:
    """Whole MoE models built on the mesh's tp and ep groups (SP on) against the same models at 1 process:
    weights are drawn per global name, so both hold the same experts."""
    from models import build_model, gather_logits
    from tests.models.test_moe import MOE

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dp_index))
    out = {}
    for name, expert_tp in (("mixtral", None), ("qwen2_moe", None), ("qwen2_moe", 1)):
        ref = build_model(MOE[name], tp_group=Group.trivial("tp")).eval()
        model = build_model(MOE[name], tp_group=mesh.tp, ep_group=mesh.ep, sequence_parallel=True,
                            expert_tp=expert_tp).eval()
        with torch.no_grad():
            got = gather_logits(model(ids), mesh.tp, vocab_size=64)
            out[(name, expert_tp)] = (got - ref(ids)[..., :64]).abs().max().item()
    return out


def _worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    rank = dist.get_rank()
    out = {}
    for ep in (2, 4):
        mesh = Mesh.build(ParallelDims(dp=4, ep=ep))
        members = list(mesh.ep.ranks)  # dp index = global rank here
        for dispatcher in ("alltoall", "allgather"):
            out[(ep, dispatcher)] = _check_ep(mesh.ep, rank, members, dispatcher)
            if ep == 2:  # with a capacity factor: the same pairs drop as at 1 process
                out[("drop", dispatcher)] = _check_ep(mesh.ep, rank, members, dispatcher, capacity=0.75)
    mesh = Mesh.build(ParallelDims(dp=2, tp=2, ep=2))
    members = list(range(2))  # batches by dp index
    for sp in (False, True):  # tp2 x ep2: the tp ranks hold the same tokens (replicated, or SP chunks)
        out[("tp2", sp)] = _check_ep(mesh.ep, mesh.coords["dp"], members, "alltoall", tp=mesh.tp, sp=sp)
    for dispatcher in ("alltoall", "allgather"):  # expert_tp=1: whole experts, each tp rank routes its SP chunk
        out[("etp1", dispatcher)] = _check_ep(mesh.ep, mesh.coords["dp"], members, dispatcher, tp=mesh.tp, sp=True,
                                              expert_tp=1)
    out["model"] = _model_logits_error(mesh, mesh.coords["dp"])
    return out


@pytest.fixture(scope="module")
def ep_results():
    return run_distributed(_worker, 4, timeout=180)


@pytest.mark.parametrize("case", [(2, "alltoall"), (4, "alltoall"), (2, "allgather"), (4, "allgather"),
                                  ("tp2", False), ("tp2", True), ("etp1", "alltoall"), ("etp1", "allgather"),
                                  ("drop", "alltoall"), ("drop", "allgather")])
def test_parity_with_one_process(ep_results, case):
    for rank, res in enumerate(ep_results):
        r = res[case]
        assert r["out"] < 1e-6 and r["grad"] < 1e-6 and r["dx"] < 1e-6, (rank, r)
        if case[0] != "drop":  # the aux and z losses of the whole sequence (dropping: per-rank capacity)
            assert r["aux"] < 1e-6 and r["z"] < 1e-6, (rank, r)
        assert (r["dropped"] > 0) == (case[0] == "drop"), r
        if isinstance(case[0], int):
            per = E // case[0]
            first = (rank % case[0]) * per
            assert r["local_experts"] == list(range(first, first + per))


@pytest.mark.parametrize("case", [(2, "alltoall"), (4, "alltoall"), ("etp1", "alltoall")])
def test_all_to_all_bytes_are_the_remote_rows(ep_results, case):
    for res in ep_results:
        got, want = res[case]["a2a"], res[case]["a2a_want"]
        assert got == tuple(want)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_tp1_sends_no_expert_rows_over_tp(ep_results, dispatcher):
    """At expert_tp=1 the tp group carries no routed rows: the one all-reduce over tp per forward is the
    counts, probability sums, z-loss, dropped and routed pairs (2E + 3 fp32); the shared expert's traffic is
    an all-gather and a reduce-scatter, as the dense MLP's."""
    for res in ep_results:
        assert res[("etp1", dispatcher)]["tp_all_reduce"] == [("torch.float32", (2 * E + 3) * 4)]


def test_moe_models_at_tp2_ep2_equal_one_process(ep_results):
    for res in ep_results:
        assert max(res["model"].values()) < 1e-5, res["model"]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
def test_grouped_gemm_experts_equal_the_loop():
    def run(gemm):
        layer = MoELayer(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K, tp_group=Group.trivial("tp"),
                         ep_group=Group.trivial("ep"), init=default_init(0.3, seed=2), expert_gemm=gemm)
        x, g = _batch(0)
        x.requires_grad_()
        out = layer(x)
        (out * g).sum().backward()
        return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]

    try:
        got = run("torch")
    except (RuntimeError, NotImplementedError) as e:  # no CPU kernel in this torch build
        pytest.skip(str(e))
    for a, b in zip(got, run("reference")):
        assert torch.allclose(a, b, atol=1e-6)


def _plain_keep(indices, weights, *, capacity: int, policy: str):
    """The capacity policy in plain Python: visit the (token, choice) pairs by priority, keep while the
    expert has room."""
    pairs = [(t, j) for t in range(indices.shape[0]) for j in range(indices.shape[1])]
    if policy == "probs":
        pairs.sort(key=lambda p: -weights[p].item())  # stable: ties keep the earlier position
    used, keep = [0] * E, torch.zeros(indices.shape, dtype=torch.bool)
    for t, j in pairs:
        e = int(indices[t, j])
        if used[e] < capacity:
            used[e] += 1
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dropping_matches_a_plain_reference(policy):
    from parallel.expert_parallel import drop_over_capacity, expert_capacity

    layer = MoELayer(hidden_size=H, ffn_hidden_size=F_EXPERT, num_experts=E, top_k=K, tp_group=Group.trivial("tp"),
                     ep_group=Group.trivial("ep"), init=default_init(0.3, seed=7), capacity_factor=0.5,
                     drop_policy=policy)
    x = _batch(3)[0]
    tokens = x.reshape(-1, H)
    with torch.no_grad():
        routing = layer.router(tokens)
        cap = expert_capacity(tokens.shape[0], num_experts=E, top_k=K, capacity_factor=0.5)
        want = _plain_keep(routing.indices, routing.weights, capacity=cap, policy=policy)
        dropped, n = drop_over_capacity(routing, num_experts=E, capacity_factor=0.5, policy=policy)
        assert torch.equal(dropped.indices != E, want) and n == int((~want).sum()) > 0
        out = layer(x).reshape(-1, H)
        ref = torch.zeros_like(tokens)
        for t in range(tokens.shape[0]):  # plain loop over tokens and their kept choices
            for j in range(K):
                if want[t, j]:
                    ref[t] += routing.weights[t, j] * layer.experts[str(int(routing.indices[t, j]))](tokens[t:t + 1])[0]
    assert torch.allclose(out, ref, atol=1e-6)
    assert layer.last_dropped_fraction == n / routing.indices.numel()


def test_aux_and_z_losses_train_the_router_through_the_injector():
    """Backward through the layer output adds d(aux_coef * aux + z_coef * z) to the router's gradient: the
    same gradient as adding the losses to the objective explicitly."""
    from parallel.expert_parallel import z_loss

    x, g = _batch(4)

    def grads(coefs: bool):
        layer = MoELayer(hidden_size=H, ffn_hidden_size=F_EXPERT, num_experts=E, top_k=K,
                         tp_group=Group.trivial("tp"), ep_group=Group.trivial("ep"), init=default_init(0.3, seed=9),
                         aux_loss_coef=0.1 if coefs else 0.0, z_loss_coef=0.01 if coefs else 0.0)
        loss = (layer(x) * g).sum()
        if not coefs:
            assert torch.allclose(layer.last_z_loss, torch.logsumexp(
                torch.nn.functional.linear(x.reshape(-1, H), layer.router.weight), -1).square().mean())
            loss = loss + 0.1 * layer.last_aux_loss + 0.01 * z_loss(
                torch.nn.functional.linear(x.reshape(-1, H), layer.router.weight))
        loss.backward()
        return layer.router.weight.grad

    assert torch.allclose(grads(True), grads(False), atol=1e-7)


def test_aux_loss_free_bias_selects_by_biased_scores_and_weights_by_unbiased():
    """DeepSeek-V3's balancing: the bias changes which experts are chosen, never their weights; one update
    step moves every overloaded expert's bias down and every underloaded one's up by the rate."""
    torch.manual_seed(0)
    router = TopKRouter(8, 4, top_k=2, norm_topk_prob=False)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(32, 8)
    plain = router(x)
    router.enable_bias_balancing(0.5)
    assert torch.equal(router(x).indices, plain.indices)  # a zero bias selects as before
    router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # experts 0 and 1 always win
    biased = router(x)
    assert torch.equal(biased.indices.sort(dim=-1).values, torch.tensor([[0, 1]] * 32))
    assert torch.equal(biased.weights, plain.probs.gather(-1, biased.indices))  # unbiased scores of the chosen
    router.update_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]))  # mean 3: expert 0 over, 1 under, 2 and 3 even
    assert torch.equal(router.expert_bias, torch.tensor([9.5, 10.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        TopKRouter(8, 4, top_k=2).enable_bias_balancing(0.0)


def test_aux_loss_free_bias_balances_a_skewed_router():
    """Repeated updates from the router's own load (rate 1e-3, DeepSeek-V3's) flatten a skewed load: the
    coefficient of variation of tokens per expert falls from 1.09 to below a tenth of it and stays there."""
    torch.manual_seed(1)
    router = TopKRouter(16, 8, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight, std=0.3)
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 attracts the tokens
    x = torch.randn(512, 16) + 0.5
    router.enable_bias_balancing(1e-3)
    cvs = []
    for _ in range(600):
        counts = router.stats(router(x)).counts  # (E,)
        cvs.append((counts.std(unbiased=False) / counts.mean()).item())
        router.update_bias(counts)
    assert cvs[0] > 1.0 and max(cvs[-50:]) < cvs[0] / 10, (cvs[0], max(cvs[-50:]))
