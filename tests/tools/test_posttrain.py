"""tools/posttrain.py: chat SFT and DPO on a converted tiny Llama, at 1 process and TP2 x PP2.

The base is a tiny random Llama saved by transformers with a word-level chat tokenizer (ChatML-like
template in its tokenizer_config.json), converted with hf-to-tessel. Records are JSONL written here.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.tools.test_convert import WORDS, make_hf_dir

SPECIAL = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
STEPS = 3


def write_chat_tokenizer(path: Path, *, template: str | None = TEMPLATE) -> None:
    """Word-level tokenizer over the tiny vocab (100 ids) with chat special tokens and a template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS[:100 - len(SPECIAL)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>", "</s>")])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "unk_token": "<unk>"}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def words(rng, n):
    return " ".join(WORDS[int(i)] for i in torch.randint(0, 90, (n,), generator=rng))


def chat_records(n, seed):
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": words(rng, 3 + i % 4)},
                {"role": "assistant", "content": words(rng, 2 + i % 3)}]
        if i % 3 == 0:  # multi-turn: both answers train
            msgs += [{"role": "user", "content": words(rng, 2)}, {"role": "assistant", "content": words(rng, 3)}]
        out.append({"messages": msgs})
    return out


def pref_records(n, seed):
    rng = torch.Generator().manual_seed(seed)
    return [{"prompt": words(rng, 3 + i % 3), "chosen": words(rng, 2 + i % 2), "rejected": words(rng, 3)}
            for i in range(n)]


def prompt_records(n, seed, rewards=("share_of_w1",)):
    rng = torch.Generator().manual_seed(seed)
    return [{"messages": [{"role": "user", "content": words(rng, 2 + i % 3)}], "reward": rewards[i % len(rewards)]}
            for i in range(n)]


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(tessel checkpoint dir, hf dir, data dir) of a tiny chat Llama."""
    from tools.convert_checkpoint import hf_to_tessel

    root = tmp_path_factory.mktemp("posttrain")
    hf = make_hf_dir(root / "hf", "llama", seed=7)
    write_chat_tokenizer(hf)
    ckpt = hf_to_tessel(hf, root / "ckpt", tp=1, pp=1)
    data = root / "data"
    data.mkdir()
    write_jsonl(data / "sft.jsonl", chat_records(24, 1))
    write_jsonl(data / "sft_valid.jsonl", chat_records(8, 2))
    write_jsonl(data / "pref.jsonl", pref_records(4, 3))  # one global batch: every step sees every pair
    write_jsonl(data / "prompts.jsonl", prompt_records(8, 4))
    write_jsonl(data / "prompts_heldout.jsonl", prompt_records(4, 5, ("share_of_w1", "words_over_6")))
    return Path(ckpt), hf, data


def overrides(ckpt, data, run_dir, method, extra=()):
    kind = {"sft": ("sft.jsonl", "sft_valid.jsonl"), "dpo": ("pref.jsonl", None),
            "grpo": ("prompts.jsonl", "prompts_heldout.jsonl")}[method]
    out = [f"checkpoint.load={ckpt}", f"posttrain.method={method}", f"posttrain.data={data / kind[0]}",
           "model.dtype=fp32", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=1",
           f"train.steps={STEPS}", "train.log_interval=100", "optim.warmup_steps=1", "optim.lr=1e-3",
           "parallel.dp=-1", "checkpoint.interval=0", "logging.tensorboard=false", "logging.progress_bar=off",
           "logging.peak_tflops=1.0", f"train.run_dir={run_dir}", "data.num_workers=0"]
    out += [f"posttrain.valid_data={data / kind[1]}", "train.eval_interval=3", "train.eval_iters=1"] if kind[1] \
        else ["train.eval_interval=0"]
    return out + list(extra)


def _posttrain(ckpt, data, run_dir, method, extra):
    import torch.distributed as dist

    from engine.config import load_config
    from tools.posttrain import base_defaults, posttrain_from_config

    cfg = load_config(None, overrides(ckpt, data, run_dir, method, extra), defaults=base_defaults)
    hist = posttrain_from_config(cfg, run_dir, world=dist.get_world_size())
    return [(h.loss, h.extra) for h in hist]


GRPO = ["posttrain.grpo.reward_modules=tests.tools.grpo_rewards", "posttrain.grpo.group_size=4",
        "posttrain.grpo.max_new_tokens=6", "train.global_batch_size=8", "train.micro_batch_size=2",
        "posttrain.grpo.steps_per_rollout=2", "posttrain.grpo.kl_beta=0.1", "posttrain.grpo.clip_high=0.28",
        "optim.lr=3e-2", "optim.min_lr=3e-2", "train.steps=6", "train.eval_interval=6", "checkpoint.interval=6"]


# -- data: the assistant mask -------------------------------------------------------------------------

def test_assistant_tokens_and_packing(base):
    from engine.data.tokenizer import load_tokenizer
    from engine.posttrain.chat import load_chat_template, tokenize_conversation
    from engine.posttrain.datasets import ChatSFTDataset

    _, hf, _ = base
    tok = load_tokenizer(str(hf))
    template = load_chat_template(str(hf))
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"},
            {"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5 w6"}]
    ids, target = tokenize_conversation(template, tok, msgs)
    text = [tok.backend.id_to_token(int(i)) for i in ids]
    assert text == ["<|im_start|>", "user", "w1", "w2", "<|im_end|>", "<|im_start|>", "assistant", "w3",
                    "<|im_end|>", "<|im_start|>", "user", "w4", "<|im_end|>", "<|im_start|>", "assistant",
                    "w5", "w6", "<|im_end|>"]
    # Targets: each answer and the end-of-turn token the template writes after it.
    assert [t for t, m in zip(text, target) if m] == ["w3", "<|im_end|>", "w5", "w6", "<|im_end|>"]
    ds = ChatSFTDataset([{"messages": msgs}] * 3, template=template, tokenizer=tok, seq_length=40, num_samples=4,
                        seed=0)
    assert len(ds.rows) == 2  # 3 conversations of 18 tokens in rows of 40: packed 2 + 1
    row = ds[0]
    assert float(row["units"]) == row["loss_mask"].sum() > 0
    labels_counted = [tok.backend.id_to_token(int(i)) for i, m in zip(row["labels"], row["loss_mask"]) if m]
    assert labels_counted[:5] == ["w3", "<|im_end|>", "w5", "w6", "<|im_end|>"]
    assert set(row["position_ids"][18:36].tolist()) == set(range(18))  # positions restart per conversation


def test_prompt_and_padding_tokens_have_zero_loss_and_gradient(base):
    """Changing a prompt or padding token's label changes neither the loss nor any gradient (bitwise)."""
    from engine.data.tokenizer import load_tokenizer
    from engine.posttrain.chat import load_chat_template
    from engine.posttrain.datasets import ChatSFTDataset
    from models.transformer import build_model
    from parallel.comm import Group, Ledger

    _, hf, _ = base
    tok = load_tokenizer(str(hf))
    ds = ChatSFTDataset(chat_records(4, 5), template=load_chat_template(str(hf)), tokenizer=tok, seq_length=48,
                        num_samples=1, seed=0)
    row = {k: torch.from_numpy(v)[None] for k, v in ds[0].items()}
    mask = row["loss_mask"][0]
    assert 0 < mask.sum() < mask.numel()
    stage = build_model(json.loads((hf / "config.json").read_text()),
                        tp_group=Group(axis="tp", ranks=[0], rank=0, pg=None, ledger=Ledger()))

    def run(labels):
        stage.zero_grad()
        loss = stage(row["tokens"], labels=labels, position_ids=row["position_ids"], loss_mask=row["loss_mask"])
        assert torch.all(loss[0][mask == 0] == 0)
        loss.sum().backward()
        return loss.detach().clone(), [p.grad.clone() for p in stage.parameters()]

    loss_a, grads_a = run(row["labels"])
    other = row["labels"].clone()
    other[0][mask == 0] = (other[0][mask == 0] + 7) % 90  # every non-target label changed
    loss_b, grads_b = run(other)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


# -- training ------------------------------------------------------------------------------------------

def test_sft_tp2_pp2_equals_one_process(base, tmp_path):
    ckpt, _, data = base
    one = run_distributed(_posttrain, 1, ckpt, data, str(tmp_path / "one"), "sft", [], timeout=240)[0]
    four = run_distributed(_posttrain, 4, ckpt, data, str(tmp_path / "tp2pp2"), "sft",
                           ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], timeout=300)[0]
    assert len(one) == STEPS
    for (a, _), (b, _) in zip(one, four):
        assert abs(a - b) <= 1e-5 * abs(a), (one, four)
    metrics = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    valid = [m for m in metrics if m["split"] == "valid"]
    assert len(valid) == 1 and valid[0]["step"] == STEPS and valid[0]["loss"] > 0  # held-out records evaluated
    # The run's checkpoint is a complete base for the next stage (architecture, tokenizer, chat template).
    prep = _prepare(tmp_path / "one" / "checkpoints", data, tmp_path / "next", "dpo")
    assert prep.model.hf_config["hidden_size"] == 64 and "hf/tokenizer_config.json" in prep.side_files


def test_dpo_tp2_pp2_equals_one_process(base, tmp_path):
    ckpt, _, data = base
    one = run_distributed(_posttrain, 1, ckpt, data, str(tmp_path / "one"), "dpo", [], timeout=240)[0]
    four = run_distributed(_posttrain, 4, ckpt, data, str(tmp_path / "tp2pp2"), "dpo",
                           ["parallel.tp=2", "parallel.pp=2"], timeout=300)[0]
    # Step 1 runs the reference weights: every margin is 0 and the loss is log 2.
    assert one[0][0] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert one[0][1]["rewards_margin"] == pytest.approx(0.0, abs=1e-6)
    margins = [e["rewards_margin"] for _, e in one]
    assert 0 < margins[1] < margins[2]  # the same pairs every step: the policy moves toward the chosen answers
    assert one[-1][0] < one[0][0]
    for (a, ea), (b, eb) in zip(one, four):
        assert abs(a - b) <= 1e-5 * abs(a), (one, four)
        for k in ea:
            assert ea[k] == pytest.approx(eb[k], rel=1e-4, abs=1e-6), (k, ea, eb)


# -- bad input -------------------------------------------------------------------------------------

def _prepare(ckpt, data, run_dir, method, extra=()):
    from engine.config import load_config
    from tools.posttrain import base_defaults, prepare

    cfg = load_config(None, overrides(ckpt, data, run_dir, method, extra), defaults=base_defaults)
    return prepare(cfg, world=1)


def test_bad_input_fails_before_training(base, tmp_path):
    ckpt, hf, data = base
    bad = write_jsonl(tmp_path / "noassist.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}])
    with pytest.raises(ValueError, match=r"noassist.jsonl:1: the record has no assistant turn"):
        _prepare(ckpt, data, tmp_path, "sft", [f"posttrain.data={bad}"])
    plain = tmp_path / "plain_tok"
    plain.mkdir()
    write_chat_tokenizer(plain, template=None)
    with pytest.raises(ValueError, match=r"no chat template: .*posttrain.chat_template"):
        _prepare(ckpt, data, tmp_path, "sft", [f"data.tokenizer={plain}"])
    long = write_jsonl(tmp_path / "long.jsonl", [{"messages": [{"role": "user", "content": "w1 " * 40},
                                                               {"role": "assistant", "content": "w2"}]}])
    with pytest.raises(ValueError, match=r"train.seq_length=32.*posttrain.truncate"):
        _prepare(ckpt, data, tmp_path, "sft", [f"posttrain.data={long}"])
    with pytest.raises(ValueError, match=r"'chosen' is missing"):
        _prepare(ckpt, data, tmp_path, "dpo", [f"posttrain.data={write_jsonl(tmp_path / 'p.jsonl', [{'prompt': 'w1'}])}"])
    with pytest.raises(ValueError, match=r"posttrain.method is 'none'"):
        _prepare(ckpt, data, tmp_path, "sft", ["posttrain.method=none"])
    with pytest.raises(ValueError, match=r"posttrain.lora.targets entry 'q_proj' matches no linear"):
        _prepare(ckpt, data, tmp_path, "sft", ["posttrain.lora.rank=4", "posttrain.lora.targets=q_proj"])
    unknown = write_jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "user", "content": "w1"}], "reward": "nope"}])
    with pytest.raises(ValueError, match=r"r.jsonl:1: unknown reward function 'nope'; registered: \['arithmetic', 'format'"):
        _prepare(ckpt, data, tmp_path, "grpo", [f"posttrain.data={unknown}", "train.eval_interval=0",
                                                 "train.global_batch_size=4", "posttrain.grpo.max_new_tokens=4"])
    with pytest.raises(ValueError, match=r"whole groups of posttrain.grpo.group_size=4"):
        _prepare(ckpt, data, tmp_path, "grpo", GRPO + ["train.global_batch_size=6", "train.micro_batch_size=1",
                                                 "posttrain.grpo.steps_per_rollout=1"])
    with pytest.raises(ValueError, match=r"does not fit train.seq_length=32"):
        _prepare(ckpt, data, tmp_path, "grpo", GRPO + ["posttrain.grpo.max_new_tokens=31"])


def test_sft_with_lora_tp2_equals_one_process_and_saves_adapters_only(base, tmp_path):
    """LoRA through tools/posttrain.py: TP=2 (SP) equals 1 process; the run's checkpoint holds the
    adapters and their optimizer state only, and records the settings."""
    from engine.checkpoint import read_metadata, resolve_checkpoint

    ckpt, _, data = base
    lora = ["posttrain.lora.rank=4", "posttrain.lora.alpha=8", "posttrain.lora.targets=qkv,fc2",
            f"checkpoint.interval={STEPS}", "optim.lr=1e-2"]
    one = run_distributed(_posttrain, 1, ckpt, data, str(tmp_path / "one"), "sft", lora, timeout=240)[0]
    two = run_distributed(_posttrain, 2, ckpt, data, str(tmp_path / "tp2"), "sft",
                          lora + ["parallel.tp=2", "parallel.sequence_parallel=true"], timeout=240)[0]
    for (a, _), (b, _) in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
    assert one[-1][0] < one[0][0]
    meta = read_metadata(resolve_checkpoint(tmp_path / "one" / "checkpoints"))
    model_keys = [k for k in meta["tensors"] if k.startswith("model.")]
    assert model_keys and all(".lora_A" in k or ".lora_B" in k for k in model_keys), model_keys
    assert meta["trainer_state"]["lora"]["adapters_only"] is True
    assert meta["trainer_state"]["lora"]["rank"] == 4


def test_grpo_tp2_pp2_equals_one_process_and_reward_rises(base, tmp_path):
    """GRPO end to end: rollouts (sampled, seeded) and losses at TP2 x PP2 equal 1 process; step 1 runs
    the reference weights (KL 0, ratio 1); the held-out greedy reward is logged before and after."""
    ckpt, _, data = base
    one = run_distributed(_posttrain, 1, ckpt, data, str(tmp_path / "one"), "grpo", GRPO, timeout=240)[0]
    four = run_distributed(_posttrain, 4, ckpt, data, str(tmp_path / "tp2pp2"), "grpo",
                           GRPO + ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], timeout=300)[0]
    assert len(one) == 6
    assert one[0][1]["kl"] == pytest.approx(0.0, abs=1e-7) and one[0][1]["ratio"] == pytest.approx(1.0, abs=1e-6)
    for (a, ea), (b, eb) in zip(one, four):
        assert ea["reward"] == eb["reward"]  # the same completions were sampled
        # fp32 reduction-order differences compounded by 6 large steps (lr 3e-2; observed rel 1.5e-4)
        assert a == pytest.approx(b, rel=1e-3, abs=1e-6), (one, four)
    rewards = [e["reward"] for _, e in one]
    assert sum(rewards[-2:]) > sum(rewards[:2]), rewards
    valid = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
             if '"valid"' in x]
    assert [v["step"] for v in valid] == [0, 6]


def test_grpo_resume_on_a_rollout_boundary_is_bitwise(base, tmp_path):
    """Stopped after rollout 1 (train.max_tokens) and resumed: the same losses, rewards and metrics as
    the run that never stopped (the rollout is regenerated from the same weights and seeds)."""
    ckpt, _, data = base
    common = GRPO + ["train.steps=4", "train.eval_interval=0", "checkpoint.interval=2"]
    full = run_distributed(_posttrain, 1, ckpt, data, str(tmp_path / "full"), "grpo", common, timeout=240)[0]
    run = str(tmp_path / "stopped")
    first = run_distributed(_posttrain, 1, ckpt, data, run, "grpo", common + ["train.max_tokens=512"], timeout=240)[0]
    rest = run_distributed(_posttrain, 1, ckpt, data, run, "grpo", common, timeout=240)[0]
    assert len(first) == 2 and len(rest) == 2
    assert full[1][0] != 0.0 and full[3][0] != 0.0  # rollout 1 moved the weights that rollout 2 samples with
    assert first + rest == full


def _generate(argv):
    from tools.generate import run_generate

    return run_generate(argv)


def test_generate_records_scores_rewards_like_the_grpo_evaluation(base, tmp_path):
    """tools/generate.py --records renders prompt records with the chat template and scores them; on the
    base model its mean reward equals GRPO's held-out evaluation at step 0 (the same greedy decoding)."""
    ckpt, _, data = base
    argv = ["--ckpt", str(ckpt), "--records", str(data / "prompts_heldout.jsonl"), "--max-new-tokens", "6",
            "--reward-module", "tests.tools.grpo_rewards", "--tp", "2", "--pp", "2"]
    out = run_distributed(_generate, 4, argv, timeout=120)[0]
    assert len(out["rewards"]) == 4 and out["reward"] == pytest.approx(sum(out["rewards"]) / 4)
    from tests.tools.grpo_rewards import share_of_w1, words_over_6
    assert out["rewards"] == [(share_of_w1, words_over_6)[i % 2]({}, t) for i, t in enumerate(out["text"])]
    assert out["reward"] > 0
    run = tmp_path / "grpo"
    run_distributed(_posttrain, 1, ckpt, data, str(run), "grpo", GRPO + ["train.steps=2", "checkpoint.interval=2"],
                    timeout=240)
    step0 = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"valid"' in x][0]
    assert step0["step"] == 0 and step0["reward"] == pytest.approx(out["reward"], abs=1e-12)


def test_memory_plan_counts_a_lora_base_as_weights_only():
    """A LoRA run's frozen base needs its weights, not gradients and optimizer state: a preset that does not
    fit for full fine-tuning fits with adapters."""
    from engine.assembly import memory_plan
    from engine.config import load_config
    from models.hook import ModelHook

    sets = ["parallel.tp=1", "parallel.pp=1", "model.vocab_size=128256", "train.seq_length=1024"]
    full_cfg = load_config("llama3_8b", sets)
    model = ModelHook.from_run_config(full_cfg, tokenizer_vocab=None)
    full = memory_plan(full_cfg, model, world=1, available=40 * 10**9)
    lora = memory_plan(load_config("llama3_8b", sets + ["posttrain.method=sft", "posttrain.data=chat.jsonl",
                                                         "posttrain.lora.rank=8"]), model, world=1,
                       available=40 * 10**9)
    assert not full.fits and full.bytes_per_param == 18
    assert lora.fits and lora.bytes_per_param == 2 and "frozen weights under LoRA adapters" in lora.line()


@pytest.mark.parametrize("sets, message", [
    (["posttrain.lora.rank=4"], r"posttrain.lora is set but posttrain.method is 'none'"),
    (["posttrain.method=sft", "posttrain.data=x.jsonl", "posttrain.grpo.group_size=8"],
     r"\[posttrain.grpo\] is set but posttrain.method='sft'"),
    (["posttrain.method=grpo", "posttrain.data=x.jsonl", "posttrain.truncate=true"],
     "posttrain.truncate does not apply to grpo"),
    (["posttrain.method=dpo", "posttrain.data=x.jsonl", "posttrain.pack=true"], "posttrain.pack=true does not apply"),
])
def test_keys_another_method_reads_are_refused(sets, message):
    from engine.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config("tiny_llama_cpu", sets)


def test_chat_template_override_is_kept_in_the_checkpoints_hf_files(base, tmp_path):
    """posttrain.chat_template: the template the run trained with goes into every checkpoint's hf/ (the base's
    tokenizer_config.json rewritten, and chat_template.jinja), so the next stage chats the same way."""
    from engine.posttrain.chat import load_chat_template

    ckpt, hf, data = base
    override = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} <|im_end|> {% endfor %}"
    (tmp_path / "chat.jinja").write_text(override)
    prep = _prepare(ckpt, data, tmp_path, "sft", [f"posttrain.chat_template={tmp_path / 'chat.jinja'}"])
    out = tmp_path / "hf_out"
    out.mkdir()
    for name, content in prep.side_files.items():  # bytes, written as the checkpoint writes them
        (tmp_path / "hf_out" / Path(name).name).write_bytes(content)
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"  # the rest kept
    assert load_chat_template(str(out)).text == override
    assert (out / "chat_template.jinja").read_text() == override
    assert "chat_template.jinja" not in {Path(n).name for n in _prepare(ckpt, data, tmp_path, "sft", []).side_files}
