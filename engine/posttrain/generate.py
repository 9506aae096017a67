"""Generation on the TP x PP model with a KV cache: greedy, temperature and top-p sampling, stop tokens.

:func:`generate` is collective over one model replica (its tp and pp groups): every rank passes the same
prompts and options and gets the same continuations back. Prompts of different lengths share one batch,
right-padded: each row's token at position p sits at cache index p (models/attention.py ``KVCache``), so
positions, rotary angles and learned position embeddings are those of the unpadded prompt, and a query
sees only the keys at positions <= its own (padding and stale entries never reach a real token).

One step (the prefill of all prompts, then one token per sequence per step):

* virtual stage 0 (chunk 0 of pp rank 0) embeds the tokens; virtual stage s = c * pp + r is chunk c of
  pp rank r, and its hidden state ``(s, b, h)`` goes to stage s + 1 by ``comm.send``/``comm.recv`` over pp;
* the last stage computes the logits of each row's newest token only (vocab-parallel ``(b, 1, V/tp)``),
  all-gathers them over tp and samples; every TP rank draws the same tokens (same logits, same seeded
  generator);
* the sampled ids are broadcast over pp from the last rank, so the first stage feeds them next and every
  rank tracks the same stop state.

Sequence parallelism: one-token steps cannot be sharded over the sequence, so the stages run inside
``TransformerStage.without_sequence_parallel()`` (the same weights and mathematics); the SP flags and every
module's train/eval mode are restored afterwards. Generation runs under ``torch.no_grad()`` in the weights'
dtype (fp32 or bf16); logits are sampled in fp32.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
from typing import Sequence

import torch

from parallel import comm
from parallel.comm import Group


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids (b,) int64 from full-vocabulary logits (b, V).

    ``temperature == 0``: greedy (the first maximum, as ``argmax`` and Hugging Face). Otherwise softmax of
    ``logits / temperature`` restricted to the top-p nucleus (the most likely tokens whose mass reaches
    ``top_p``; the most likely token always stays), drawn with ``generator``. Deterministic for equal
    inputs and generator states."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_p < 1.0:
        ranked, order = logits.sort(dim=-1, descending=True, stable=True)  # (b, V) each
        probs = ranked.softmax(dim=-1)
        above = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked strictly higher
        ranked = ranked.masked_fill(above >= top_p, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, ranked)  # (b, V) back in vocab order
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)  # (b,)


def generate(chunks, *, prompts: Sequence[Sequence[int]], max_new_tokens: int, mesh=None,
             tp_group: Group | None = None, pp_group: Group | None = None, temperature: float = 0.0,
             top_p: float = 1.0, stop_tokens: Sequence[int] = (), seed: int = 0, pad_id: int = 0) -> list[list[int]]:
    """The continuation ids of each prompt: up to ``max_new_tokens`` tokens, ending at (and including)
    the first token in ``stop_tokens``. Collective over ``mesh.tp`` and ``mesh.pp`` (or ``tp_group`` and
    ``pp_group``); every rank returns the same lists.

    ``chunks``: this pp rank's model chunks (``TransformerStage``; a single stage, or a list where chunk
    c is virtual stage ``c * pp + pp_rank``, as engine/assembly.py builds them). ``temperature`` 0 is
    greedy; ``seed`` seeds the sampling generator (the same on every rank); ``pad_id`` fills the batch's
    right padding and the inputs of finished rows (never seen by a real token). Every argument is
    checked before any communication (ValueError). The stages' SP flags and train/eval modes are
    restored on return.
    """
    tp_group, pp_group = _groups(mesh, tp_group, pp_group)
    chunks = _check_chunks(chunks, tp_group=tp_group, pp_group=pp_group)
    cfg = chunks[0].config
    prompts = check_generate_args(prompts, vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                                  max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  stop_tokens=stop_tokens, seed=seed, pad_id=pad_id)
    param = next(chunks[0].parameters())
    device = param.device
    _check_agreement([prompts, max_new_tokens, float(temperature), float(top_p), sorted(set(stop_tokens)),
                      seed, pad_id], groups=(tp_group, pp_group), device=device)
    modes = [(m, m.training) for c in chunks for m in c.modules()]
    try:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for c in chunks:
                c.eval()
                stack.enter_context(c.without_sequence_parallel())
            return _decode(chunks, tp_group=tp_group, pp_group=pp_group, prompts=prompts,
                           max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                           stop_tokens=set(stop_tokens), seed=seed, pad_id=pad_id, device=device,
                           act_dtype=param.dtype)
    finally:
        for m, training in modes:
            m.training = training


def check_generate_args(prompts, *, vocab_size: int, max_positions: int, max_new_tokens: int, temperature: float,
                        top_p: float, stop_tokens: Sequence[int], seed: int, pad_id: int) -> list[list[int]]:
    """The prompts as lists of ints, or a ValueError naming the bad argument (no communication)."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists (one per sequence)")
    out = []
    for i, p in enumerate(prompts):
        p = p.tolist() if isinstance(p, torch.Tensor) else p
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompt {i} is empty (or not a list of ids): every prompt needs at least one token "
                             "(e.g. a BOS token)")
        if not all(is_int(x) for x in p):
            raise ValueError(f"prompt {i} holds non-integer ids; pass token ids, not text")
        bad = sorted({x for x in p if not 0 <= x < vocab_size})
        if bad:
            raise ValueError(f"prompt {i}: ids {bad[:10]} lie outside the vocabulary [0, {vocab_size})")
        out.append(list(p))
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    longest = max(len(p) for p in out)
    if longest + max_new_tokens > max_positions:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                         f"model's {max_positions} positions (max_position_embeddings); shorten the prompt or "
                         f"generate at most {max(max_positions - longest, 0)} tokens")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 = no nucleus cut)")
    if isinstance(stop_tokens, (int, str)) or not all(is_int(t) for t in stop_tokens):
        raise ValueError(f"stop_tokens={stop_tokens!r} must be a sequence of token ids")
    bad = sorted({t for t in stop_tokens if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"stop token(s) {bad} lie outside the vocabulary [0, {vocab_size}): the model can never "
                         "produce them; check the tokenizer's EOS id")
    if not is_int(seed):
        raise ValueError(f"seed={seed!r} must be an integer")
    if not is_int(pad_id) or not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id={pad_id!r} must be a token id in [0, {vocab_size})")
    return out


def _groups(mesh, tp_group, pp_group) -> tuple[Group, Group]:
    if mesh is not None:
        if tp_group is not None or pp_group is not None:
            raise ValueError("pass either mesh= or tp_group=/pp_group=, not both")
        return mesh.tp, mesh.pp
    return comm.as_group(tp_group, axis="tp"), comm.as_group(pp_group, axis="pp")


def _check_chunks(chunks, *, tp_group: Group, pp_group: Group) -> list:
    chunks = [chunks] if isinstance(chunks, torch.nn.Module) and not isinstance(
        chunks, (torch.nn.ModuleList, torch.nn.Sequential)) else list(chunks)
    if not chunks:
        raise ValueError("generate needs this rank's model chunks; got none")
    pp, r = pp_group.size, pp_group.rank
    num_stages = pp * len(chunks)
    for c, chunk in enumerate(chunks):
        if not all(hasattr(chunk, a) for a in ("config", "new_kv_cache", "without_sequence_parallel")):
            raise ValueError(f"chunk {c} ({type(chunk).__name__}) is not a models.TransformerStage; pass the "
                             "stages built by models.build_model / engine.assembly (unwrapped)")
        if chunk.config != chunks[0].config:
            raise ValueError(f"chunk {c} is built from a different model config than chunk 0")
        if chunk.tp_group.size != tp_group.size:
            raise ValueError(f"chunk {c} was built for tp={chunk.tp_group.size} but the tp group has "
                             f"{tp_group.size} ranks; pass the group the stages were built with")
        stage = c * pp + r
        if chunk.pre_process != (stage == 0) or chunk.post_process != (stage == num_stages - 1):
            raise ValueError(f"chunk {c} on pp rank {r} is virtual stage {stage} of {num_stages} (chunk c of pp "
                             f"rank r is stage c*pp + r), so it should have pre_process={stage == 0} and "
                             f"post_process={stage == num_stages - 1}; got {chunk.pre_process} and "
                             f"{chunk.post_process}: pass this rank's chunks in order, with the pp group they "
                             "were built for")
    return chunks


def _check_agreement(args, *, groups: tuple[Group, ...], device) -> None:
    """Every rank of the tp and pp groups must generate from the same prompts and options (a symmetric
    check: a mismatch raises on all ranks instead of hanging one)."""
    digest = hashlib.blake2b(json.dumps(args).encode(), digest_size=7).digest()
    mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64, device=device)
    for group in groups:
        seen = comm.all_gather(mine, group, dim=0)  # (group.size,)
        if bool((seen != seen[0]).any()):
            raise ValueError(f"the ranks of the {group.axis} group called generate with different prompts or "
                             "options; every rank of a model replica must pass the same ones")


def _decode(chunks, *, tp_group: Group, pp_group: Group, prompts: list[list[int]], max_new_tokens: int,
            temperature: float, top_p: float, stop_tokens: set[int], seed: int, pad_id: int, device,
            act_dtype) -> list[list[int]]:
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)  # (b,)
    longest = max(len(p) for p in prompts)
    # The last token fed sits at position len + max_new_tokens - 2; the prefill writes up to longest - 1.
    max_len = longest + max_new_tokens - 1
    caches = [c.new_kv_cache(batch=b, max_len=max_len) for c in chunks]
    generator = None
    if temperature > 0 and chunks[-1].post_process:
        generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.full((b, longest), pad_id, dtype=torch.int64, device=device)  # (b, s) right-padded
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.int64)
    positions = torch.arange(longest, device=device).expand(b, longest)  # (b, s)
    step = dict(chunks=chunks, caches=caches, tp_group=tp_group, pp_group=pp_group, act_dtype=act_dtype,
                temperature=temperature, top_p=top_p, generator=generator)
    new = _step(tokens, positions, logits_index=lengths - 1, **step)
    out: list[list[int]] = [[] for _ in range(b)]
    finished = [False] * b
    for t in range(max_new_tokens):
        for i, tok in enumerate(new.tolist()):
            if not finished[i]:
                out[i].append(tok)
                finished[i] = tok in stop_tokens
        if all(finished) or t == max_new_tokens - 1:
            break
        done = torch.tensor(finished, device=device)
        feed = torch.where(done, torch.full_like(new, pad_id), new).unsqueeze(1)  # (b, 1)
        new = _step(feed, (lengths + t).unsqueeze(1), logits_index=torch.zeros_like(lengths), **step)
    return out


def _step(tokens: torch.Tensor, positions: torch.Tensor, *, logits_index: torch.Tensor, chunks, caches,
          tp_group: Group, pp_group: Group, act_dtype, temperature: float, top_p: float,
          generator) -> torch.Tensor:
    """One forward of every virtual stage in order, then sampling on the last; returns the next ids
    (b,) on every rank. ``tokens``, ``positions``: (b, s) (the inputs of this step)."""
    pp, r = pp_group.size, pp_group.rank
    num_stages = pp * len(chunks)
    b, s = tokens.shape
    h = chunks[0].config.hidden_size
    x = None
    for stage in range(r, num_stages, pp):
        c = stage // pp
        if stage > 0 and pp > 1:
            x = comm.recv(torch.empty((s, b, h), dtype=act_dtype, device=tokens.device), pp_group,
                          src=(stage - 1) % pp)  # (s, b, h)
        out = chunks[c](tokens if stage == 0 else x, position_ids=positions, kv_cache=caches[c],
                        logits_index=logits_index if stage == num_stages - 1 else None)
        if stage < num_stages - 1:
            out = out.to(act_dtype)  # (s, b, h)
            if pp > 1:
                comm.send(out, pp_group, dst=(stage + 1) % pp)
            else:
                x = out  # vp > 1 on one pipeline rank: the next chunk is local
    new = torch.empty(b, dtype=torch.int64, device=tokens.device)  # (b,)
    if chunks[-1].post_process:
        logits = chunks[-1].gather_logits(out)[:, 0].float()  # (b, 1, V_local) -> (b, vocab)
        new.copy_(sample_tokens(logits, temperature=temperature, top_p=top_p, generator=generator))
    comm.broadcast(new, pp_group, src=pp - 1)
    return new
