"""Every legal layout of a model on a cluster, predicted and ranked (fastest that fits first).

Legal: tp divides the heads, the k/v heads and the MLP width (models/config.py's rule) and stays inside
a node; pp * vp stages of at least one layer (interleaved stages may differ by one layer, as
parallel/pipeline/split.py splits them for the trainer); cp > 1 splits the sequence into 2 * cp zigzag
chunks; tp * pp * cp * dp is the world;
mbs * dp divides the global batch; with an MoE model ep divides dp and the expert count; the run config
accepts it (engine/config: the same checks as a run).
Pins (``--tp 8``) keep one value; a pin no layout can honour is an error that names the fix.
"""
from __future__ import annotations

from dataclasses import replace

from engine.planner.predict import Cluster, Layout, Prediction, Training, predict

MBS_CHOICES = (1, 2, 4)
VP_CHOICES = (1, 2, 3, 4, 5, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(model, cluster: Cluster, tr: Training, pins: dict) -> None:
    """Raise ValueError naming the fix for a pin that no layout can honour, before any enumeration."""
    c = model.config
    world = cluster.world
    cluster.gpu.peak_tflops(tr.precision)  # the GPU has the precision's rate (no FP8 on an A100)
    for k, v in pins.items():
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"--{k} {v!r} must be a positive integer")
    tp, pp, vp, dp, cp, ep, mbs = (pins.get(k) for k in ("tp", "pp", "vp", "dp", "cp", "ep", "mbs"))
    if tp is not None:
        if tp > c.num_heads:
            fit = max(d for d in _divisors(c.num_heads) if d <= cluster.gpus_per_node)
            raise ValueError(f"--tp {tp} exceeds the model's {c.num_heads} attention heads (each TP rank needs whole "
                             f"heads); pin --tp to a divisor of {c.num_heads}, e.g. {fit}")
        c.check_tensor_parallel(tp)
        if tp > cluster.gpus_per_node:
            raise ValueError(f"--tp {tp} spans more than one node of {cluster.gpus_per_node} GPUs (TP collectives "
                             "run in every layer and need NVLink); pin --tp <= --gpus-per-node")
    if pp is not None and pp * (vp or 1) > c.num_layers:
        raise ValueError(f"--pp {pp}" + (f" x --vp {vp}" if vp else "") + f" = {pp * (vp or 1)} stages for "
                         f"{c.num_layers} layers: a stage needs at least one layer; pin fewer stages")
    if vp is not None and vp > 1:
        if pp == 1:
            raise ValueError(f"--vp {vp} needs --pp >= 2 (virtual stages interleave across pipeline ranks)")
    if cp is not None and cp > 1 and tr.seq_length % (2 * cp):  # cp 1 cuts no zigzag chunks
        raise ValueError(f"--cp {cp}: the sequence of {tr.seq_length} tokens does not split into 2 * cp = {2 * cp} "
                         f"zigzag chunks; pin a cp dividing {tr.seq_length // 2}")
    if ep is not None and ep != 1:
        try:  # an MoE model whose expert count ep divides
            model.hook.check_expert_parallel(ep)
        except ValueError as e:
            raise ValueError(f"--ep {ep}: {e}") from None
        if dp is not None and dp % ep:
            raise ValueError(f"--ep {ep} must divide --dp {dp} (experts are sharded inside the data-parallel ranks)")
    fixed = [(k, v) for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp)) if v is not None]
    prod = 1
    for _, v in fixed:
        prod *= v
    if world % prod:
        names = " * ".join(f"{k} {v}" for k, v in fixed)
        raise ValueError(f"the pins {names} = {prod} do not divide the world of {world} GPUs ({cluster.nodes} nodes x "
                         f"{cluster.gpus_per_node}); pin degrees whose product divides {world}, or use a world that "
                         f"is a multiple of {prod} (--nodes)")
    if len(fixed) == 4 and prod != world:
        raise ValueError(f"the pins tp*pp*cp*dp = {prod} must equal the world of {world} GPUs; unpin dp or change "
                         "--nodes")
    if mbs is not None and tr.global_batch_size % mbs:
        raise ValueError(f"--mbs {mbs} does not divide --global-batch-size {tr.global_batch_size}; pin a divisor")
    if dp is not None and tr.global_batch_size % (dp * (mbs or 1)):
        raise ValueError(f"--dp {dp} * mbs {mbs or 1} does not divide --global-batch-size {tr.global_batch_size}")


def candidates(model, cluster: Cluster, tr: Training, pins: dict) -> list[Layout]:
    """Every layout the pins allow that passes the shape rules (not yet the run config's)."""
    c = model.config
    world = cluster.world
    out = []
    for tp in _divisors(min(cluster.gpus_per_node, world)):
        if pins.get("tp") not in (None, tp):
            continue
        try:
            c.check_tensor_parallel(tp)
        except ValueError:
            continue
        for cp in _divisors(world // tp):
            if pins.get("cp") not in (None, cp) or tr.seq_length % (2 * cp if cp > 1 else 1):
                continue
            for pp in _divisors(world // (tp * cp)):
                if pins.get("pp") not in (None, pp) or pp > c.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                if pins.get("dp") not in (None, dp):
                    continue
                for vp in VP_CHOICES:
                    if pins.get("vp") not in (None, vp):
                        continue
                    # interleaving: pp * vp stages of at least one layer, split as the trainer splits them
                    # (parallel/pipeline/split.py: stages differ by at most one layer when pp * vp does not
                    # divide the layers)
                    if vp > 1 and (pp == 1 or pp * vp > c.num_layers):
                        continue
                    for mbs in MBS_CHOICES:
                        if pins.get("mbs") not in (None, mbs) or tr.global_batch_size % (dp * mbs):
                            continue
                        m = tr.global_batch_size // (dp * mbs)
                        if vp > 1 and m % pp:
                            continue  # interleaved 1F1B runs micro-batches in groups of pp
                        for ep in ep_choices(model, tr, dp=dp, cp=cp):
                            if pins.get("ep") in (None, ep):
                                out.append(Layout(tp=tp, pp=pp, vp=vp, dp=dp, cp=cp, mbs=mbs, ep=ep))
    return out


def ep_choices(model, tr: Training, *, dp: int, cp: int) -> list[int]:
    """Expert-parallel degrees of one (dp, cp): 1, and with an MoE model every divisor of dp that divides
    the expert count (the trainer carves ep out of dp at each cp index; expert buffers reduce, and under
    ZeRO shard, over edp = dp x cp / ep)."""
    e = model.config.num_experts
    if not e:
        return [1]
    return [d for d in _divisors(dp) if e % d == 0]


def state_lower_bound(model, lay: Layout, tr: Training) -> float:
    """Bytes per GPU of parameters, gradients and optimizer state alone, from the parameter count spread
    evenly over tp * pp (no padding, no activations): at most engine/memory.py's figure, so a layout
    above the capacity by this bound cannot fit (used to skip the full prediction).

    ZeRO shards as the runtime shards (engine/memory.py, DataParallel): the dense parameters over
    DataParallel's group dpr = dp x cp (mesh.dp_cp), an ep rank's experts over edp = dpr / ep; each part
    is divided by its own group where the stage shards that term (ZeRO 3: parameters; 2: gradients;
    1: optimizer state) and held whole otherwise. (Before 2026-11-28 the bound sharded over dp alone: at
    dp 1 x cp 8 it was 2x (ZeRO 1) to 4x (ZeRO 3) above the real state, and plan() dropped fitting layouts.)"""
    c = model.config
    numel = model.hook.stage_numel(tp=1, layer_range=(0, c.num_layers), pre_process=True, post_process=True)
    experts = 0  # elements of one ep rank's experts (the whole model's at tp 1)
    if lay.ep > 1:  # each rank holds 1/ep of the experts
        from engine.memory import stage_param_sizes

        experts = sum(n for _, n, _, expert in stage_param_sizes(model.hook, tp=1, ep=lay.ep,
                                                                 layer_range=(0, c.num_layers), pre_process=True,
                                                                 post_process=True) if expert)
    dense = numel - experts * lay.ep  # everything but the experts (replicated over ep)
    dense_local, experts_local = dense / (lay.tp * lay.pp), experts / (lay.tp * lay.pp)  # elements per GPU
    dpr = lay.dp * lay.cp  # DataParallel's group: the dense buffer's ZeRO shards
    edp = dpr // lay.ep  # the expert buffer's ZeRO shards

    def held(sharded: bool) -> float:
        """Elements of the state term per GPU: the dense and expert parts each over their own group."""
        return dense_local / dpr + experts_local / edp if sharded else dense_local + experts_local

    elem = 4 if tr.precision == "fp32" else 2
    params = elem * held(tr.zero == 3)  # the low-precision (or fp32) parameters
    grads = 4 * held(tr.zero >= 2)  # fp32 gradient buffer
    optimizer = (8 + (4 if elem != 4 else 0)) * held(tr.zero >= 1)  # Adam moments (+ fp32 master)
    return params + grads + optimizer


def plan(model, cluster: Cluster, tr: Training, pins: dict | None = None) -> tuple[list[Prediction], list[str]]:
    """(predictions of every legal layout whose state alone could fit, fitting ones first, each group
    fastest first; the reasons layouts were refused by the run config, deduplicated). Where no layout's
    state fits, every layout is predicted (the caller reports the least memory needed)."""
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    check_pins(model, cluster, tr, pins)
    preds, refused = [], []
    layouts = candidates(model, cluster, tr, pins)
    could = [lay for lay in layouts if state_lower_bound(model, lay, tr) <= cluster.capacity_bytes]
    for lay in could or layouts:
        try:
            preds.append(predict(model, lay, tr, cluster))
        except ValueError as e:
            refused.append(f"{lay.label()}: {e}")
    if not preds:
        detail = ("; the run config refused them: " + "; ".join(dict.fromkeys(refused))[:800]) if refused else ""
        raise ValueError(f"no layout of {model.name} on {cluster.world} GPUs honours the pins "
                         f"{pins or '(none)'} with global batch {tr.global_batch_size}{detail}; relax a pin or "
                         "change --global-batch-size / --nodes")
    preds.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes))
    return preds, refused


def smallest_fit(model, cluster: Cluster, tr: Training, pins: dict | None = None, *, max_nodes: int = 4096):
    """When nothing fits: (the smallest node count, doubling, at which a layout fits, or None; the least
    memory per GPU any layout needs on the given cluster, bytes)."""
    preds, _ = plan(model, cluster, tr, pins)
    least = min(p.memory_bytes for p in preds)
    nodes = cluster.nodes * 2
    while nodes <= max_nodes:
        bigger = replace(cluster, nodes=nodes)
        try:
            more, _ = plan(model, bigger, tr, pins)
        except ValueError:
            more = []
        if any(p.fits for p in more):
            return nodes, least
        nodes *= 2
    return None, least
