"""engine/posttrain/dpo: DPO (with cDPO label smoothing) and IPO losses and their gradients against the
papers' formulas written out per pair with math and hand derivatives, sequence log-prob reduction with
inf/nan at masked positions, stability at large margins, logging fields, and every bad-input error."""
import math

import pytest
import torch

from engine.posttrain.dpo import DPOOutput, dpo_accuracy, dpo_loss, sequence_logps

# Fixed sequence log-probabilities of 5 pairs (sums over completion tokens), float64.
PC = [-12.0, -30.5, -7.25, -50.0, -3.0]
PR = [-14.0, -29.0, -7.25, -41.0, -9.5]
RC = [-13.0, -30.0, -8.0, -48.0, -3.5]
RR = [-13.5, -30.0, -7.0, -44.0, -8.0]
WEIGHTS = [1.0, -0.5, 2.0, 0.25, 3.0]  # a weighted sum tells every pair's gradient apart


def _inputs():
    return [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (PC, PR, RC, RR)]


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _reference(beta, eps, loss_type):
    """Per-pair loss and d loss / d (pc, pr) straight from the paper's formula (math, no torch)."""
    losses, d_pc = [], []
    for pc, pr, rc, rr in zip(PC, PR, RC, RR):
        z = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses.append(-(1 - eps) * _log_sigmoid(beta * z) - eps * _log_sigmoid(-beta * z))
            # d/dz [-(1-e) log s(bz)] = -(1-e) b (1 - s(bz)); d/dz [-e log s(-bz)] = e b s(bz)
            d_pc.append(-(1 - eps) * beta * (1 - _sigmoid(beta * z)) + eps * beta * _sigmoid(beta * z))
        else:
            losses.append((z - 1 / (2 * beta)) ** 2)
            d_pc.append(2 * (z - 1 / (2 * beta)))
    return losses, d_pc  # d/d pr = -d/d pc (z = pc - pr - ...)


@pytest.mark.parametrize("beta,eps,loss_type", [(0.1, 0.0, "sigmoid"), (0.5, 0.2, "sigmoid"), (2.0, 0.45, "sigmoid"),
                                                 (0.1, 0.0, "ipo"), (0.7, 0.0, "ipo")])
def test_losses_and_gradients_equal_the_paper_formula(beta, eps, loss_type):
    pc, pr, rc, rr = _inputs()
    out = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps, loss_type=loss_type)
    want, d_pc = _reference(beta, eps, loss_type)
    assert out.losses.dtype == torch.float64 and out.losses.shape == (5,)
    torch.testing.assert_close(out.losses, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    g_pc, g_pr, g_rc, g_rr = torch.autograd.grad((out.losses * w).sum(), (pc, pr, rc, rr), allow_unused=True)
    torch.testing.assert_close(g_pc, w * torch.tensor(d_pc, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_pr, -w * torch.tensor(d_pc, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # The reference is a constant: no gradient flows into it.
    assert g_rc is None and g_rr is None
    torch.testing.assert_close(out.loss_sum, out.losses.sum())
    assert out.units == 5


def test_rewards_margins_and_accuracy():
    beta = 0.25
    out = dpo_loss(*_inputs(), beta=beta)
    chosen = [beta * (a - b) for a, b in zip(PC, RC)]
    rejected = [beta * (a - b) for a, b in zip(PR, RR)]
    torch.testing.assert_close(out.chosen_rewards, torch.tensor(chosen, dtype=torch.float64))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor(rejected, dtype=torch.float64))
    want_margins = torch.tensor(chosen, dtype=torch.float64) - torch.tensor(rejected, dtype=torch.float64)
    torch.testing.assert_close(out.margins, want_margins)
    assert not out.chosen_rewards.requires_grad and not out.margins.requires_grad
    wins = [c > r for c, r in zip(chosen, rejected)]
    assert out.correct.tolist() == [float(x) for x in wins]
    assert out.accuracy.item() == pytest.approx(sum(wins) / len(wins))
    assert dpo_accuracy(out.chosen_rewards, out.rejected_rewards).item() == pytest.approx(sum(wins) / len(wins))
    # Margin = beta * z.
    z = [(a - b) - (c - d) for a, b, c, d in zip(PC, PR, RC, RR)]
    torch.testing.assert_close(out.margins, beta * torch.tensor(z, dtype=torch.float64))
    assert dpo_accuracy(torch.zeros(0), torch.zeros(0)).item() == 0.0


def test_stable_at_large_margins_and_low_precision_upcast():
    z = torch.tensor([1e4, -1e4, 0.0], dtype=torch.float32, requires_grad=True)
    zero = torch.zeros(3)
    out = dpo_loss(z, zero, zero, zero, beta=1.0, label_smoothing=0.1)
    assert torch.isfinite(out.losses).all()
    # -(0.9) logsig(1e4) - 0.1 logsig(-1e4) ~ 0.1 * 1e4; the other side ~ 0.9 * 1e4; z = 0: log 2.
    torch.testing.assert_close(out.losses, torch.tensor([1e3, 9e3, math.log(2)]), rtol=1e-6, atol=1e-4)
    (g,) = torch.autograd.grad(out.losses.sum(), z)
    assert torch.isfinite(g).all()
    bf = dpo_loss(z.detach().bfloat16(), zero.bfloat16(), zero.bfloat16(), zero.bfloat16(), beta=1.0)
    assert bf.losses.dtype == torch.float32


def test_sequence_logps_sum_mean_and_masked_inf():
    tok = torch.tensor([[-1.0, -2.0, float("-inf"), float("nan")],
                        [-0.5, -0.25, -4.0, float("inf")],
                        [float("nan")] * 4], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    s = sequence_logps(tok, mask, average=False)
    m = sequence_logps(tok, mask.bool(), average=True)
    assert s.tolist() == [-3.0, -4.75, 0.0]
    assert m.tolist() == pytest.approx([-1.5, -4.75 / 3, 0.0])
    (g,) = torch.autograd.grad(s.sum() + m.sum(), tok)
    want = mask.double() * (1 + 1 / mask.sum(-1, keepdim=True).clamp(min=1).double())
    torch.testing.assert_close(g, want, rtol=1e-15, atol=0)
    assert (g[mask == 0] == 0).all()  # exactly zero where masked, though the values there are inf/nan


def test_dpo_on_masked_token_logps_end_to_end():
    # Per-token log-probs with garbage on padding; the loss and gradient are finite and ignore it.
    tok = torch.tensor([[-1.0, -1.0, float("-inf")], [-2.0, float("nan"), float("nan")]], dtype=torch.float64,
                       requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    seq = sequence_logps(tok, mask, average=False)
    out = dpo_loss(seq[:1], seq[1:], torch.tensor([-2.5]), torch.tensor([-2.5]), beta=0.1)
    (g,) = torch.autograd.grad(out.losses.sum(), tok)
    assert torch.isfinite(out.losses).all() and torch.isfinite(g).all()
    assert g[~mask].abs().sum() == 0
    torch.testing.assert_close(out.losses, torch.tensor([-_log_sigmoid(0.1 * 0.0)], dtype=torch.float64))


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta=0.0), "beta must be > 0"),
    (dict(beta=-1.0), "beta must be > 0"),
    (dict(beta=0.1, label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
    (dict(beta=0.1, label_smoothing=-0.1), r"label_smoothing must be in \[0, 0.5\)"),
    (dict(beta=0.1, loss_type="hinge"), "unknown loss_type 'hinge'"),
    (dict(beta=0.1, loss_type="ipo", label_smoothing=0.1), "only applies to loss_type='sigmoid'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo_loss(*_inputs(), **kwargs)


def test_bad_shapes():
    pc, pr, rc, rr = _inputs()
    with pytest.raises(ValueError, match="same \\(n,\\) shape"):
        dpo_loss(pc, pr[:4], rc, rr, beta=0.1)
    with pytest.raises(ValueError, match="same \\(n,\\) shape"):
        dpo_loss(pc[None], pr[None], rc[None], rr[None], beta=0.1)
    with pytest.raises(ValueError, match="token_logp must be \\(n, t\\)"):
        sequence_logps(pc, pc, average=False)
    with pytest.raises(ValueError, match="mask \\(2, 2\\) must have token_logp's shape"):
        sequence_logps(torch.zeros(2, 3), torch.ones(2, 2), average=True)
    with pytest.raises(ValueError, match="same shape"):
        dpo_accuracy(torch.zeros(2), torch.zeros(3))
    assert isinstance(dpo_loss(pc, pr, rc, rr, beta=0.1), DPOOutput)


def test_a_multi_turn_prompts_assistant_turns_are_context_not_completion():
    """A preference record whose prompt already holds an assistant turn: the chosen and rejected loss masks cover
    their own answers only (TRL masks the completion). Before 2026-11-28 the prompt's assistant turn was in both."""
    from engine.data.tokenizer import ByteTokenizer
    from engine.posttrain.chat import ChatTemplate
    from engine.posttrain.datasets import PreferenceDataset

    template = ChatTemplate(text="{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                                 "{% if add_generation_prompt %}<assistant>{% endif %}", source="inline", variables={})
    rec = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EARLIER"},
                      {"role": "user", "content": "q"}], "chosen": "YES", "rejected": "NO"}
    rows = PreferenceDataset([rec], template=template, tokenizer=ByteTokenizer(), seq_length=96, num_samples=1,
                             seed=0).pair_rows(0)
    answers = [bytes(int(i) for i in rows["labels"][k][rows["loss_mask"][k] > 0]).decode() for k in (0, 1)]
    assert answers == ["YES</s>", "NO</s>"]
