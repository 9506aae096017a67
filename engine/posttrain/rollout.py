"""GRPO on the training assembly line: rollouts as the data loader, the clipped surrogate as the step loss.

The trainer loop does not change. :class:`RolloutLoader` hands out micro-batches like the pretraining
loader; when its buffer is empty it runs a rollout, collectively over the world:

1. prompts: this dp rank's share of the next ``P`` prompt records (``P = steps_per_rollout *
   global_batch_size / group_size``; a seeded permutation per epoch, the same at every layout);
2. generation with the current weights (engine/posttrain/generate.py, collective over tp and pp):
   ``group_size`` samples per prompt, seeded by ``(train.seed, rollout, dp rank)``;
3. rewards: each record's reward function on the decoded completion, called on the replica's first rank
   (tp and pp rank 0) and broadcast to the others; advantages normalised within each group (every group
   lives on one dp rank);
4. rows ``prompt + completion`` padded to ``seq_length``, loss mask on the completion (its stop token
   included); the sampling policy's per-token log-probabilities (``old_logp``) from one forward-only
   pass, and with ``kl_beta > 0`` the reference's (``ref_logp``: the base weights, swapped in for the
   pass, or the adapters switched off under LoRA).

The rollout then feeds ``steps_per_rollout`` optimizer steps (``global_batch_size`` rows each);
after the first, the policy has moved and the importance ratios and clipping matter.
:class:`GRPOObjective` is the step loss. :func:`heldout_reward` scores greedy completions of held-out
prompt records (the run's evaluation).

Resume: the loader's state is the rows consumed; a checkpoint on a rollout boundary resumes bitwise
(the rollout is regenerated from the same weights and seeds), one inside a rollout regenerates that
rollout with the saved weights and skips what was consumed.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Sequence

import numpy as np
import torch

from engine.posttrain.chat import ChatTemplate, check_messages, prompt_ids
from engine.posttrain.generate import generate
from engine.posttrain.grpo import group_advantages, grpo_loss
from engine.posttrain.rewards import RewardRegistry, default_registry
from parallel import comm


def reward_registry(modules: Sequence[str] = ()) -> RewardRegistry:
    """The shipped rewards plus those each module in ``modules`` adds with ``register(registry)``."""
    registry = default_registry()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"posttrain.grpo.reward_modules: cannot import {name!r} ({e}); give an importable "
                             "module that defines register(registry)") from None
        if not callable(getattr(module, "register", None)):
            raise ValueError(f"posttrain.grpo.reward_modules: module {name!r} defines no register(registry) "
                             "function to add its rewards")
        module.register(registry)
    return registry


def reward_check(fn):
    """How a reward declares the record fields it reads: ``fn.check(record)``, raising ValueError (naming the
    field and the fix) for a record the reward could not score (engine/posttrain/rewards.py's ``arithmetic``
    declares one); None: no declaration, the record reaches the reward unchecked."""
    return getattr(fn, "check", None)


def prompt_records(records: Sequence[dict], *, template: ChatTemplate, tokenizer, registry: RewardRegistry,
                   seq_length: int, max_new_tokens: int) -> list[list[int]]:
    """Check GRPO prompt records (messages, a registered reward and the inputs it declares, see
    :func:`reward_check`; room for the completion) and return each one's prompt ids (the conversation so far
    and the generation prompt)."""
    out = []
    for rec in records:
        where = rec.get("_where", "record")
        if "messages" not in rec:
            raise ValueError(f"{where}: a GRPO prompt record needs 'messages' (the conversation to answer)")
        msgs = check_messages(rec["messages"], where=where, need_assistant=False)
        if not isinstance(rec.get("reward"), str):
            raise ValueError(f"{where}: a GRPO prompt record needs 'reward', the name of its reward function (a "
                             f"string); registered: {registry.names()}")
        if rec["reward"] not in registry:
            raise ValueError(f"{where}: unknown reward function {rec['reward']!r}; registered: {registry.names()} "
                             "(add yours with posttrain.grpo.reward_modules)")
        check = reward_check(registry.get(rec["reward"]))
        if check is not None:
            try:
                check(dict(rec))
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        ids = prompt_ids(template, tokenizer, msgs)
        if len(ids) + max_new_tokens > seq_length:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens; with posttrain.grpo.max_new_tokens="
                             f"{max_new_tokens} it does not fit train.seq_length={seq_length}: raise "
                             "train.seq_length or lower max_new_tokens")
        out.append(ids)
    return out


def check_rollout_shape(grpo, *, global_batch_size: int, dp: int) -> int:
    """Prompts each dp rank draws per rollout; ValueError unless every rank gets whole groups."""
    rows = grpo.steps_per_rollout * global_batch_size
    if rows % dp or (rows // dp) % grpo.group_size:
        raise ValueError(f"a rollout of posttrain.grpo.steps_per_rollout={grpo.steps_per_rollout} x "
                         f"train.global_batch_size={global_batch_size} rows must give each of the dp={dp} ranks "
                         f"whole groups of posttrain.grpo.group_size={grpo.group_size}; make the product a multiple "
                         f"of group_size x dp = {grpo.group_size * dp}")
    return rows // dp // grpo.group_size


def _row(prompt: Sequence[int], completion: Sequence[int], *, seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    ids = list(prompt) + list(completion)
    n, p = len(ids), len(prompt)
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, pad_id, dtype=np.int64)
    mask = np.zeros(seq_length, dtype=np.float32)
    tokens[:n] = ids
    labels[:n - 1] = ids[1:]
    mask[p - 1:n - 1] = 1.0  # predicting each completion token
    return {"tokens": tokens, "labels": labels, "loss_mask": mask,
            "position_ids": np.arange(seq_length, dtype=np.int64)}


@contextlib.contextmanager
def reference_weights(chunks, reference: list[torch.Tensor] | None):
    """The reference policy for the block: the base weights copied into the parameters (and the trained
    ones back afterwards), or with ``reference=None`` (LoRA) the adapters switched off."""
    if reference is None:
        from engine.posttrain.lora import adapters_disabled

        with adapters_disabled(chunks):
            yield
        return
    params = list(chunks.parameters())
    current = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, r in zip(params, reference):
            p.copy_(r)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, c in zip(params, current):
                p.copy_(c)


class RolloutLoader:
    """Micro-batches of GRPO rows for this rank, generated a rollout at a time (see the module doc).

    ``reference``: the base weights (a list matching ``trainer.chunks.parameters()``), or None to use
    :func:`engine.posttrain.lora.adapters_disabled`; only read when ``kl_beta > 0``.
    """

    def __init__(self, trainer, records: Sequence[dict], prompts: Sequence[Sequence[int]], *, tokenizer,
                 registry: RewardRegistry, grpo, seq_length: int, global_batch_size: int, micro_batch_size: int,
                 seed: int, reference: list[torch.Tensor] | None = None):
        self.trainer, self.records, self.prompts = trainer, list(records), [list(p) for p in prompts]
        self.tokenizer, self.registry, self.g = tokenizer, registry, grpo
        self.seq_length, self.gbs, self.mbs, self.seed = seq_length, global_batch_size, micro_batch_size, seed
        self.reference = reference
        mesh = trainer.mesh
        self.dp, self.dp_rank = mesh.dp_cp.size, mesh.dp_cp.rank
        self.rows_per_rollout = grpo.steps_per_rollout * global_batch_size  # global
        self.prompts_per_rank = check_rollout_shape(grpo, global_batch_size=global_batch_size, dp=self.dp)
        self.consumed_samples = 0
        self._buffer: list[dict] = []
        self._perm: tuple[int, np.ndarray] | None = None

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.consumed_samples)}

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_samples"])
        if consumed % (self.mbs * self.dp):
            raise ValueError(f"loader position {consumed} is not a whole micro-batch step of this layout "
                             f"(micro_batch_size x dp = {self.mbs * self.dp}); resume at a step boundary")
        self.consumed_samples, self._buffer = consumed, []

    # -- iteration ------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self._buffer:
            rollout, within = divmod(self.consumed_samples, self.rows_per_rollout)
            self._buffer = self._rollout(rollout)[within // (self.mbs * self.dp):]
        self.consumed_samples += self.mbs * self.dp
        return self._buffer.pop(0)

    def _prompt_index(self, k: int) -> int:
        """Global prompt draw ``k`` -> record index: every epoch a fresh seeded permutation."""
        n = len(self.records)
        epoch, i = divmod(k, n)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, 7, epoch]).permutation(n))
        return int(self._perm[1][i])

    def _rollout(self, rollout: int) -> list[dict[str, torch.Tensor]]:
        tr, g = self.trainer, self.g
        first = (rollout * self.dp + self.dp_rank) * self.prompts_per_rank
        picks = [self._prompt_index(first + j) for j in range(self.prompts_per_rank)]
        prompts = [self.prompts[i] for i in picks for _ in range(g.group_size)]  # groups contiguous
        tr.ddp.finish_param_sync()
        eod = self.tokenizer.eod_id
        completions = generate(tr.chunks, mesh=tr.mesh, prompts=prompts, max_new_tokens=g.max_new_tokens,
                               temperature=g.temperature, top_p=g.top_p, stop_tokens=[eod], pad_id=eod,
                               seed=int(np.random.default_rng([self.seed, 11, rollout, self.dp_rank]).integers(2**62)))
        rewards = self._scores([self.records[i] for i in picks for _ in range(g.group_size)], completions)
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size=g.group_size,
                               scale=g.advantage_scale)  # (rows,)
        rows = [_row(p, c, seq_length=self.seq_length, pad_id=eod) for p, c in zip(prompts, completions)]
        for r, a, rew in zip(rows, adv.tolist(), rewards):
            r["advantages"] = np.asarray(a, dtype=np.float32)
            r["reward"] = np.asarray(rew, dtype=np.float32)
            r["units"] = np.asarray(r["loss_mask"].sum() if g.loss_level == "token" else 1.0, dtype=np.float32)
        micro = [{k: torch.from_numpy(np.stack([r[k] for r in rows[i:i + self.mbs]])) for k in rows[0]}
                 for i in range(0, len(rows), self.mbs)]
        self._logps(micro, "old_logp")
        if g.kl_beta > 0:
            with reference_weights(tr.chunks, self.reference):
                self._logps(micro, "ref_logp")
        return micro

    def _scores(self, records: list[dict], completions: list[list[int]]) -> list[float]:
        """The rewards of this replica's completions, scored once, on its first rank (tp and pp rank 0), and
        broadcast over tp, then pp (the first stage's tp rank 0 reaches every rank): the replica's ranks
        generated the same completions, and a non-deterministic reward (a sampled judge) scored on each would
        give them different advantages, so different gradients for the same weights. Collective over tp, pp."""
        mesh = self.trainer.mesh
        out = torch.zeros(len(completions), dtype=torch.float64, device=self.trainer.device)  # (rows,)
        if mesh.tp.rank == 0 and mesh.pp.rank == 0:
            out.copy_(torch.tensor([self.registry.score(rec, self.tokenizer.decode(c))
                                    for rec, c in zip(records, completions)], dtype=torch.float64))
        for group in (mesh.tp, mesh.pp):
            comm.broadcast(out, group, src=0)
        return out.cpu().tolist()

    def _logps(self, micro: list[dict], key: str) -> None:
        """Per-token log-probabilities (b, s) of each micro-batch's labels under the current weights, into
        ``micro[i][key]`` on the last stage (zeros elsewhere: only the last stage computes the loss)."""
        m = self.trainer.num_micro
        for mb in micro:
            mb[key] = torch.zeros(mb["tokens"].shape, dtype=torch.float32)
        for start in range(0, len(micro), m):
            def on_last(token_loss, batch, i, start=start):
                micro[start + i][key] = (-token_loss).detach().float().cpu()
            self.trainer.forward_token_losses(micro[start:start + m], on_last)


class GRPOObjective:
    """The GRPO step loss on rollout micro-batches (see :func:`engine.posttrain.grpo.grpo_loss`)."""

    STATS = ("rows", "reward", "tokens", "clipped", "ratio", "kl")

    def __init__(self, grpo):
        self.g = grpo

    def loss(self, token_loss: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
        g = self.g
        out = grpo_loss(-token_loss, batch["old_logp"], batch["advantages"], batch["loss_mask"],
                        ref_logp=batch.get("ref_logp") if g.kl_beta > 0 else None, kl_beta=g.kl_beta,
                        clip_low=g.clip_low, clip_high=g.clip_high, ratio_level=g.ratio_level,
                        loss_level=g.loss_level)
        tokens = out.tokens.to(torch.float64)
        stats = {"rows": torch.tensor(float(token_loss.shape[0])), "reward": batch["reward"].sum(), "tokens": tokens,
                 "clipped": out.clip_fraction * tokens, "ratio": out.ratio_mean * tokens,
                 "kl": (out.kl_mean if out.kl_mean is not None else torch.zeros(())) * tokens}
        return out.loss_sum, stats

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        rows, tokens = max(sums["rows"], 1.0), max(sums["tokens"], 1.0)
        out = {"reward": sums["reward"] / rows, "completion_tokens": sums["tokens"] / rows,
               "clip_fraction": sums["clipped"] / tokens, "ratio": sums["ratio"] / tokens}
        if self.g.kl_beta > 0:
            out["kl"] = sums["kl"] / tokens
        return out


def heldout_reward(trainer, records: Sequence[dict], prompts: Sequence[Sequence[int]], *, tokenizer,
                   registry: RewardRegistry, max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean reward of greedy completions of ``records`` (each dp rank scores a share; one SUM all-reduce
    over dp). Collective over the world."""
    mesh = trainer.mesh
    dp, r = mesh.dp_cp.size, mesh.dp_cp.rank
    mine = list(range(r, len(records), dp))
    total = torch.zeros(2, dtype=torch.float64, device=trainer.device)  # (sum of rewards, count)
    trainer.ddp.finish_param_sync()
    eod = tokenizer.eod_id
    for k in range(0, len(mine), batch_size):  # generate is collective over this replica's tp and pp only
        part = mine[k:k + batch_size]
        outs = generate(trainer.chunks, mesh=mesh, prompts=[prompts[i] for i in part], max_new_tokens=max_new_tokens,
                        temperature=0.0, stop_tokens=[eod], pad_id=eod)
        for i, c in zip(part, outs):
            total[0] += registry.score(records[i], tokenizer.decode(c))
            total[1] += 1
    comm.all_reduce(total, mesh.dp_cp)
    return float(total[0] / total[1].clamp(min=1))
