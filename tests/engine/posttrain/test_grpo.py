"""engine/posttrain/grpo: group advantages against statistics.mean/stdev per group (an all-equal group gets
exactly 0); the clipped surrogate + k3 KL against a per-token loop reference (values and gradients) for
token/sequence (GSPO) ratios x token/sequence loss levels, with the clip active on both sides for positive
and negative advantages, clip-higher, masked inf/nan tokens, the units convention across micro-batches,
the statistics, and every bad-input error."""
import math
import statistics

import pytest
import torch

from engine.posttrain.grpo import GRPOOutput, group_advantages, grpo_loss, loss_units

F64 = torch.float64


# ------------------------------------------------------------------------------------------- advantages
def test_group_advantages_equal_per_group_mean_and_unbiased_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 2.0, -1.0, 0.0, 0.3, 0.7, 0.1]
    got = group_advantages(torch.tensor(rewards, dtype=F64), group_size=4, eps=1e-6)
    want = []
    for p in range(3):
        g = rewards[4 * p:4 * p + 4]
        mu, sd = statistics.mean(g), statistics.stdev(g)  # stdev: unbiased (n - 1)
        want += [(r - mu) / (sd + 1e-6) for r in g]
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)
    plain = group_advantages(rewards, group_size=4, scale="none")  # a list works; float32 result
    assert plain.dtype == torch.float32
    want_plain = [r - statistics.mean(rewards[4 * (i // 4):4 * (i // 4) + 4]) for i, r in enumerate(rewards)]
    torch.testing.assert_close(plain, torch.tensor(want_plain), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", ["std", "none"])
def test_all_equal_group_gets_exactly_zero(scale):
    # 0.1 * 3 / 3 != 0.1 in floating point: the mean alone would leave a residue.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float32)
    adv = group_advantages(rewards, group_size=3, scale=scale, eps=0.0)
    assert torch.isfinite(adv).all()
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and adv[6:].tolist() == [0.0, 0.0, 0.0]
    assert adv[3] > 0 and adv[4] < 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(rewards=torch.zeros(6), group_size=4), "group_size=4 does not divide the 6 rewards"),
    (dict(rewards=torch.zeros(6), group_size=1), "group_size must be an int >= 2"),
    (dict(rewards=torch.zeros(2, 3), group_size=3), "rewards must be 1-D"),
    (dict(rewards=torch.zeros(6), group_size=3, scale="minmax"), "unknown scale 'minmax'"),
    (dict(rewards=torch.tensor([0.0, float("nan")]), group_size=2), "1 non-finite reward"),
    (dict(rewards=torch.zeros(4), group_size=2, eps=-1.0), "eps must be >= 0"),
])
def test_group_advantages_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)


# ---------------------------------------------------------------------------------------------- fixture
# 6 sequences x 5 positions. Each row's per-token ratios r = exp(logp - old_logp) are set by hand so that
# the clip is active below (A < 0, r < 1 - eps) and above (A > 0, r > 1 + eps), for tokens and sequences.
RATIOS = [
    [1.5, 1.5, 1.5, 1.5, 1.0],     # A > 0, every ratio above 1.2: clipped high (row 0 masks its last token)
    [0.6, 0.6, 0.6, 1.0, 1.0],     # A < 0, below 0.8: clipped low
    [0.6, 0.9, 1.1, 1.25, 2.0],    # A > 0, mixed: 0.6 unclipped (min picks r A), 1.25 clipped unless clip-higher
    [0.5, 0.85, 1.0, 1.3, 1.6],    # A < 0, mixed: 0.5 clipped low, 1.3 / 1.6 unclipped
    [1.1, 0.95, 1.05, 1.0, 1.0],   # A > 0, all inside
    [0.7, 1.4, 1.0, 1.0, 1.0],     # A = 0 (an all-equal group): no surrogate gradient at all
]
ADV = [1.5, -0.8, 0.7, -1.2, 0.4, 0.0]
MASK = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]


def _fixture():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g, dtype=F64) * 3 - 0.1
    old = logp - torch.log(torch.tensor(RATIOS, dtype=F64))
    ref = logp + torch.randn(6, 5, generator=g, dtype=F64) * 0.3
    mask = torch.tensor(MASK, dtype=torch.bool)
    # Garbage where masked: the loss must never read it.
    logp = torch.where(mask, logp, torch.tensor(float("-inf"), dtype=F64))
    old = torch.where(mask, old, torch.tensor(float("nan"), dtype=F64))
    ref = torch.where(mask, ref, torch.tensor(float("inf"), dtype=F64))
    return logp.requires_grad_(), old, torch.tensor(ADV, dtype=F64), mask, ref


def _reference(logp, old, adv, mask, *, ref=None, kl_beta=0.0, lo=0.2, hi=None, ratio_level="token",
               loss_level="token"):
    """The formula token by token: python min and an if-chain for the clip (clipped = a constant)."""
    hi = lo if hi is None else hi
    total, units = 0.0, 0
    for i in range(logp.shape[0]):
        idx = [j for j in range(logp.shape[1]) if mask[i, j]]
        if not idx:
            continue
        if ratio_level == "sequence":
            r_seq = torch.exp(sum(logp[i, j] - old[i, j] for j in idx) / len(idx))
        a = float(adv[i])
        row = 0.0
        for j in idx:
            r = torch.exp(logp[i, j] - old[i, j]) if ratio_level == "token" else r_seq
            if r.item() < 1 - lo:
                rc = torch.tensor(1 - lo, dtype=F64)
            elif r.item() > 1 + hi:
                rc = torch.tensor(1 + hi, dtype=F64)
            else:
                rc = r
            loss = -min(r * a, rc * a, key=lambda x: x.item())
            if kl_beta:
                d = ref[i, j] - logp[i, j]
                loss = loss + kl_beta * (torch.exp(d) - d - 1)
            row = row + loss
        if loss_level == "token":
            total, units = total + row, units + len(idx)
        else:
            total, units = total + row / len(idx), units + 1
    return total, units


def _compare(out, want, logp):
    total, units = want
    assert int(out.units) == units
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(out.loss_sum, logp, retain_graph=True)
    (g_ref,) = torch.autograd.grad(total, logp)
    assert torch.isfinite(out.loss_sum) and torch.isfinite(g).all()
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    return g


# ------------------------------------------------------------------------------------------- surrogate
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_level", ["token", "sequence"])
def test_surrogate_equals_reference(ratio_level, loss_level):
    logp, old, adv, mask, _ = _fixture()
    out = grpo_loss(logp, old, adv, mask, ratio_level=ratio_level, loss_level=loss_level)
    g = _compare(out, _reference(logp, old, adv, mask, ratio_level=ratio_level, loss_level=loss_level), logp)
    assert (g[~mask] == 0).all()  # masked: exactly zero gradient though logp there is -inf
    assert (out.token_losses[~mask] == 0).all()
    assert (g[5] == 0).all()  # zero advantage: no gradient from the surrogate
    if ratio_level == "token":
        # Clipped-active tokens get no gradient; unclipped ones get -A r / units (token level).
        assert (g[0, :4] == 0).all() and (g[1, :3] == 0).all() and g[3, 0] == 0 and g[2, 3] == 0
        if loss_level == "token":
            torch.testing.assert_close(g[2, 0], torch.tensor(-0.7 * 0.6, dtype=F64))
            torch.testing.assert_close(g[3, 4], torch.tensor(1.2 * 1.6, dtype=F64))
    else:
        # Row 0's sequence ratio is 1.5 > 1.2 with A > 0, row 1's 0.6 < 0.8 with A < 0: both clipped.
        assert (g[0] == 0).all() and (g[1] == 0).all()
        assert (g[2, :5] != 0).all()


def test_gspo_sequence_loss_is_the_per_sequence_clipped_objective():
    # GSPO's objective: -(1/N) sum_i min(s_i A_i, clip(s_i) A_i), s_i = (pi/pi_old)^(1/|y_i|).
    logp, old, adv, mask, _ = _fixture()
    out = grpo_loss(logp, old, adv, mask, ratio_level="sequence", loss_level="sequence", clip_low=0.1)
    logp = logp.detach()
    want = 0.0
    for i in range(6):
        n = int(mask[i].sum())
        s = math.prod(math.exp(float(logp[i, j] - old[i, j])) for j in range(5) if mask[i, j]) ** (1 / n)
        want += -min(s * ADV[i], min(max(s, 0.9), 1.1) * ADV[i])
    assert out.loss_sum.item() == pytest.approx(want, rel=1e-12)
    assert int(out.units) == 6


def test_clip_higher_is_asymmetric():
    logp, old, adv, mask, _ = _fixture()
    sym = grpo_loss(logp, old, adv, mask, clip_low=0.2)
    dapo = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    g_sym = _compare(sym, _reference(logp, old, adv, mask, lo=0.2), logp)
    g_dapo = _compare(dapo, _reference(logp, old, adv, mask, lo=0.2, hi=0.28), logp)
    # r = 1.25, A > 0: clipped at 1.2 symmetric, free below 1.28.
    assert g_sym[2, 3] == 0 and g_dapo[2, 3] != 0
    # The low side is unchanged: r = 0.5 with A < 0 stays clipped; r = 1.5 with A > 0 still clipped at 1.28.
    assert g_dapo[3, 0] == 0 and (g_dapo[0, :4] == 0).all()
    # The high clip does not bound negative advantages: r = 1.6, A < 0 has gradient either way.
    assert g_sym[3, 4] == g_dapo[3, 4] != 0


@pytest.mark.parametrize("loss_level", ["token", "sequence"])
def test_kl_k3_equals_reference(loss_level):
    logp, old, adv, mask, ref = _fixture()
    out = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_beta=0.05, loss_level=loss_level, clip_high=0.3)
    _compare(out, _reference(logp, old, adv, mask, ref=ref, kl_beta=0.05, hi=0.3, loss_level=loss_level), logp)
    logp = logp.detach()
    kl = [math.exp(float(ref[i, j] - logp[i, j])) - float(ref[i, j] - logp[i, j]) - 1
          for i in range(6) for j in range(5) if mask[i, j]]
    assert out.kl_mean.item() == pytest.approx(sum(kl) / len(kl), rel=1e-12)
    assert min(kl) > 0


def test_kl_is_zero_when_policy_equals_reference():
    logp, _, _, mask, _ = _fixture()
    adv = torch.zeros(6, dtype=F64)
    ref = logp.detach().clone()
    out = grpo_loss(logp, logp.detach(), adv, mask, ref_logp=ref, kl_beta=0.5)
    assert out.loss_sum.item() == 0.0 and out.kl_mean.item() == 0.0
    (g,) = torch.autograd.grad(out.loss_sum, logp)
    assert (g == 0).all()
    # Without kl_beta, ref_logp only feeds the statistic; kl_mean is None without ref_logp.
    assert grpo_loss(logp, logp.detach(), adv, mask).kl_mean is None


def test_all_equal_group_gives_zero_surrogate_gradient():
    logp, old, _, mask, _ = _fixture()
    adv = group_advantages(torch.tensor([1.0] * 3 + [0.0] * 3), group_size=3).to(F64)
    assert (adv == 0).all()
    for ratio_level in ("token", "sequence"):
        out = grpo_loss(logp, old, adv, mask, ratio_level=ratio_level)
        (g,) = torch.autograd.grad(out.loss_sum, logp)
        assert out.loss_sum.item() == 0.0 and (g == 0).all()


def test_on_policy_first_update_is_the_plain_policy_gradient():
    # old == logp: r = 1, no clip; d loss_sum / d logp = -A on every masked token.
    logp, _, adv, mask, _ = _fixture()
    out = grpo_loss(logp, logp.detach(), adv, mask)
    (g,) = torch.autograd.grad(out.loss_sum, logp)
    want = torch.where(mask, -adv[:, None].expand(6, 5), torch.zeros((), dtype=F64))
    torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert out.ratio_mean.item() == 1.0 and out.clip_fraction.item() == 0.0


def test_units_split_over_micro_batches_equal_the_whole_batch():
    # The trainer's loss: sum of loss_sum over micro-batches / sum of units (global normalisation).
    logp, old, adv, mask, ref = _fixture()
    for loss_level in ("token", "sequence"):
        kw = dict(ref_logp=None, kl_beta=0.0, loss_level=loss_level)
        whole = grpo_loss(logp, old, adv, mask, **kw)
        parts = [grpo_loss(logp[s], old[s], adv[s], mask[s], **kw) for s in (slice(0, 2), slice(2, 6))]
        split = sum(p.loss_sum for p in parts) / sum(p.units for p in parts)
        torch.testing.assert_close(split, whole.loss_sum / whole.units, rtol=1e-14, atol=1e-14)
        assert int(whole.units) == int(loss_units(mask, loss_level=loss_level))
    assert int(loss_units(mask, loss_level="token")) == sum(map(sum, MASK))
    # A sequence without completion tokens is not a unit.
    empty = mask.clone()
    empty[4] = False
    assert int(loss_units(empty, loss_level="sequence")) == 5
    out = grpo_loss(logp, old, adv, empty.float(), loss_level="sequence")  # numeric mask works too
    _compare(out, _reference(logp, old, adv, empty, loss_level="sequence"), logp)


def test_statistics():
    logp, old, adv, mask, _ = _fixture()
    out = grpo_loss(logp, old, adv, mask)
    kept = [(i, j) for i in range(6) for j in range(5) if MASK[i][j]]
    clipped = [(i, j) for i, j in kept
               if (RATIOS[i][j] < 0.8 and ADV[i] < 0) or (RATIOS[i][j] > 1.2 and ADV[i] > 0)]
    assert int(out.tokens) == len(kept)
    assert len(clipped) == 4 + 3 + 2 + 1  # both sides are exercised
    assert out.clip_fraction.item() == pytest.approx(len(clipped) / len(kept))
    assert out.ratio_mean.item() == pytest.approx(sum(RATIOS[i][j] for i, j in kept) / len(kept), rel=1e-12)
    assert not out.loss_sum.detach().requires_grad and out.loss_sum.requires_grad
    assert isinstance(out, GRPOOutput) and out.token_losses.shape == (6, 5)


def test_low_precision_inputs_compute_in_float32():
    logp, old, adv, mask, _ = _fixture()
    out = grpo_loss(logp.detach().bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert out.loss_sum.dtype == torch.float32 and torch.isfinite(out.loss_sum)


@pytest.mark.parametrize("change,match", [
    (dict(old_logp=torch.zeros(6, 4)), r"old_logp \(6, 4\) must have logp's shape \(6, 5\)"),
    (dict(mask=torch.ones(5, 5)), r"mask \(5, 5\) must have logp's shape"),
    (dict(ref_logp=torch.zeros(6)), r"ref_logp \(6,\) must have logp's shape"),
    (dict(advantages=torch.zeros(6, 1)), r"advantages \(6, 1\) must be \(n,\) = \(6,\)"),
    (dict(logp=torch.zeros(6, 5, dtype=torch.long)), "logp must be a floating \\(n, t\\) tensor"),
    (dict(clip_low=0.0), r"clip_low must be in \(0, 1\)"),
    (dict(clip_low=1.0), r"clip_low must be in \(0, 1\)"),
    (dict(clip_high=0.0), "clip_high must be > 0"),
    (dict(clip_high=-0.1), "clip_high must be > 0"),
    (dict(kl_beta=-0.1), "kl_beta must be >= 0"),
    (dict(kl_beta=0.1), "kl_beta=0.1 needs ref_logp"),
    (dict(ratio_level="group"), "unknown ratio_level 'group'"),
    (dict(loss_level="batch"), "unknown loss_level 'batch'"),
])
def test_bad_input(change, match):
    logp, old, adv, mask, _ = _fixture()
    args = dict(logp=logp, old_logp=old, advantages=adv, mask=mask)
    kwargs = {}
    for k, v in change.items():
        (args if k in args else kwargs)[k] = v
    with pytest.raises(ValueError, match=match):
        grpo_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], **kwargs)
    if "loss_level" in change:
        with pytest.raises(ValueError, match="unknown loss_level"):
            loss_units(mask, loss_level=change["loss_level"])
