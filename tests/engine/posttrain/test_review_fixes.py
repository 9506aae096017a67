"""Post-training bugs found in review, each reproduced and now right:

* LoRA on a mixture-of-experts model: ``fc1``/``fc2`` (also through ``all``) would name the expert MLPs,
  which get no adapters; refused by check_lora (given the model's ``num_experts``) and by apply_lora,
  before any stage changes, naming the attention-only fix; attention targets still adapt.
* The chat-template environment is transformers': ``{% break %}``/``{% continue %}``, the
  ``{% generation %}`` block, ``strftime_now``, ``tools``/``documents`` defined as None, the guarded
  ``namespace``; each template renders the text transformers' ``render_jinja_template`` renders.
* chat_template.jinja wins over tokenizer_config.json's ``chat_template`` (transformers 5's precedence).
* A resume may not change the base (``checkpoint.load``), the LoRA scaling, dropout, rank or targets, or
  GRPO's group size or steps per rollout (check_run_dir); load_trainer compares the checkpoint's
  ``trainer_state.lora`` with the run's adapters before it reads any tensor.
* A GRPO record whose reward inputs are bad (an ``arithmetic`` record without a numeric ``answer``) is
  refused while the records are prepared, naming its file and line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# -- LoRA on mixture-of-experts models -----------------------------------------------------------------

_BASE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 64, "max_position_embeddings": 64, "tie_word_embeddings": False}
MIXTRAL = {**_BASE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 24,
           "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
# Layer 1 dense (mlp_only_layers): its mlp.fc1 matches 'fc1', the expert layer's do not.
QWEN2_MOE = {**_BASE, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "intermediate_size": 40,
             "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_experts": 4,
             "num_experts_per_tok": 2, "mlp_only_layers": [1], "router_aux_loss_coef": 0.01}


def _moe_stage(hf):
    from models import build_model
    from parallel.comm import Group

    return build_model(hf, tp_group=Group.trivial("tp"), seed=1)


@pytest.mark.parametrize("hf", [MIXTRAL, QWEN2_MOE], ids=["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("targets", [["fc1", "fc2"], ["all"], ["qkv", "mlp.fc2"]])
def test_lora_on_expert_mlps_is_refused_before_anything_changes(hf, targets):
    from engine.posttrain.lora import apply_lora

    stage = _moe_stage(hf)
    with pytest.raises(ValueError, match=r"mixture-of-experts.*expert MLPs.*not supported.*"
                                         r"posttrain.lora.targets=\['qkv', 'out'\]") as err:
        apply_lora(stage, rank=4, alpha=8.0, targets=targets, seed=1)
    assert "mlp.fc" in str(err.value)
    assert all(p.requires_grad for p in stage.parameters())  # nothing frozen, nothing added
    assert not any(n.endswith((".lora_A", ".lora_B")) for n, _ in stage.named_parameters())


def test_lora_mlp_targets_on_an_moe_model_are_refused_at_config_time():
    from engine.posttrain.lora import check_lora

    with pytest.raises(ValueError, match=r"num_experts=4.*set posttrain.lora.targets=\['qkv', 'out'\]"):
        check_lora(rank=4, alpha=8.0, targets=["all"], num_experts=4)
    assert check_lora(rank=4, alpha=8.0, targets=["qkv", "out"], num_experts=4).targets == (
        "attention.qkv", "attention.out")
    assert check_lora(rank=4, alpha=8.0, targets=["all"]).targets[-1] == "mlp.fc2"  # dense: every linear


def test_lora_attention_targets_on_an_moe_model_adapt():
    from engine.posttrain.lora import apply_lora

    stage = _moe_stage(MIXTRAL)
    names = apply_lora(stage, rank=4, alpha=8.0, targets=["qkv", "out"], seed=1)
    assert names == ["layers.0.attention.qkv", "layers.0.attention.out", "layers.1.attention.qkv",
                     "layers.1.attention.out"]
    assert sum(p.numel() for p in stage.parameters() if p.requires_grad) > 0


# -- the chat-template environment ---------------------------------------------------------------------

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <b>&"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": "sure"}]
VARIABLES = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None, "unk_token": "<unk>"}
TEMPLATES = {
    "break_continue": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                      "{% if loop.index > 4 %}{% break %}{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}",
    "generation": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
                  "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}"
                  "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "strftime_now": "Today: {{ strftime_now('%Y') }}\n{% for m in messages %}{{ m.content }}\n{% endfor %}",
    "everything": "{%- set ns = namespace(n=0) -%}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                  "{% if ns.n > 3 %}{% break %}{% endif %}{% generation %}{{ m | tojson(indent=2, sort_keys=true) }}"
                  "{% endgeneration %}{{ m.content | tojson }}\n{% endfor %}{{ dict(a=1, b=[2]) | tojson }}"
                  "{{ dict.fromkeys(['x'], 0) | tojson }}"
                  "{% if tools is defined and tools is none %}[no tools]{% endif %}"
                  "{% if documents is defined %}[docs]{% endif %}{{ strftime_now('%Y') }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_renders_as_transformers(name, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    from engine.posttrain.chat import ChatTemplate

    text = TEMPLATES[name]
    (hf,), _ = render_jinja_template([MSGS], chat_template=text, add_generation_prompt=add_generation_prompt,
                                     **VARIABLES)
    ours = ChatTemplate(text=text, source="test", variables=VARIABLES).render(
        MSGS, add_generation_prompt=add_generation_prompt)
    assert ours == hf


def test_reasoning_fields_render_as_transformers():
    """A record's reasoning under any of transformers' names reaches the template as reasoning_content and
    thinking (Qwen3 templates read the first, gpt-oss ones the second)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from engine.posttrain.chat import ChatTemplate

    text = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
            "</think>{% endif %}{{ m.thinking }}|{{ m | tojson }}\n{% endfor %}")
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "two twos"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "thinking": "add"}]
    (hf,), _ = render_jinja_template([msgs], chat_template=text)
    assert ChatTemplate(text=text, source="test", variables={}).render(msgs) == hf
    assert "<think>two twos</think>" in hf


def test_chat_template_namespace_refuses_underscore_attributes_as_transformers():
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    from engine.posttrain.chat import ChatTemplate

    text = "{% set ns = namespace(_secret=1) %}{{ messages[0].content }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_jinja_template([MSGS], chat_template=text)
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        ChatTemplate(text=text, source="test", variables={}).render(MSGS)


# -- template precedence -------------------------------------------------------------------------------

def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from engine.posttrain.chat import load_chat_template

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "OLD{% for m in messages %}{{ m.content }}{% endfor %}"}))
    (tmp_path / "chat_template.jinja").write_text("NEW{% for m in messages %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "a"}]
    template = load_chat_template(str(tmp_path))
    assert template.render(msgs) == "NEWa" == AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        msgs, tokenize=False)
    assert template.source == str(tmp_path / "chat_template.jinja")


# -- resume keys ---------------------------------------------------------------------------------------

def _pt_cfg(*extra):
    from engine.config import load_config

    return load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "train.global_batch_size=8", "train.micro_batch_size=1",
        "train.eval_interval=0", "posttrain.method=grpo", "posttrain.data=/data/p.jsonl",
        "checkpoint.load=/ckpt/baseA", "posttrain.lora.rank=8", *extra])


def _saved_run(tmp_path, cfg) -> Path:
    """A run directory holding ``cfg`` and a complete (empty) checkpoint: what check_run_dir reads."""
    from engine.checkpoint.format import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / METADATA_FILE).write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": 2,
                                                  "tensors": {}, "files": {}}))
    cfg.to_json(str(run / "config.json"))
    return run


CHANGES = {"checkpoint.load": ("/ckpt/baseB", '"/ckpt/baseA" -> "/ckpt/baseB"'),
           "posttrain.lora.alpha": ("64", "16.0 -> 64.0"),
           "posttrain.lora.dropout": ("0.1", "0.0 -> 0.1"),
           "posttrain.grpo.group_size": ("2", "4 -> 2"),
           "posttrain.grpo.steps_per_rollout": ("2", "1 -> 2")}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_posttrain_resume_refuses_each_change(tmp_path, key):
    from engine.fault import POSTTRAIN_RESUME_KEYS, check_run_dir

    run = _saved_run(tmp_path, _pt_cfg())
    assert check_run_dir(_pt_cfg("train.steps=40", "optim.lr=1e-3"), str(run), keys=POSTTRAIN_RESUME_KEYS)
    value, shown = CHANGES[key]
    with pytest.raises(ValueError, match="start a new run directory") as err:
        check_run_dir(_pt_cfg(f"{key}={value}"), str(run), keys=POSTTRAIN_RESUME_KEYS)
    assert f"{key} ({shown})" in str(err.value) and "\n" not in str(err.value)


def test_posttrain_resume_names_every_change_in_one_line(tmp_path):
    from engine.fault import POSTTRAIN_RESUME_KEYS, check_run_dir

    run = _saved_run(tmp_path, _pt_cfg())
    changed = [f"{k}={v}" for k, (v, _) in CHANGES.items()] + ["posttrain.lora.rank=4",
                                                                 "posttrain.lora.targets=[\"qkv\"]"]
    with pytest.raises(ValueError) as err:
        check_run_dir(_pt_cfg(*changed), str(run), keys=POSTTRAIN_RESUME_KEYS)
    msg = str(err.value)
    for key in [*CHANGES, "posttrain.lora.rank", "posttrain.lora.targets"]:
        assert f"{key} (" in msg, (key, msg)
    # An adapter-only checkpoint is no base for a new run: not offered as checkpoint.load.
    assert "to start from its weights" not in msg, msg


# the tiny Llama, its token stream and the hook that adds adapters: test_lora.py's
from tests.engine.posttrain.test_lora import GBS, HF, SEQ, LoraHook, _Tokens  # noqa: E402


def _lora_trainer(**lora):
    from engine.assembly import build_run
    from engine.config.loader import load_config
    from models.hook import ModelHook

    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "train.steps=8", f"train.global_batch_size={GBS}",
        "train.micro_batch_size=2", f"train.seq_length={SEQ}", "optim.lr=0.01", "optim.warmup_steps=0",
        "logging.progress_bar=off", "logging.tensorboard=false", "logging.jsonl=false", "train.eval_interval=0",
        "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
        "model.ffn_hidden_size=64", "model.vocab_size=64"])
    hook = ModelHook.from_hf(HF, dtype=torch.float32, sequence_parallel=False, seed=cfg.train.seed)
    run = build_run(cfg, model=LoraHook(hook, **lora), train_data=_Tokens(), checkpoints=False)
    return run.trainer, run.train_loader


def test_load_trainer_refuses_an_adapter_checkpoint_of_other_lora_settings(tmp_path):
    from engine.checkpoint import Checkpointer
    from engine.checkpoint.trainer_state import load_trainer, save_trainer

    trainer, loader = _lora_trainer(rank=4, alpha=8.0, targets=["qkv", "fc2"])
    trainer.train_step(loader)
    save_trainer(Checkpointer(tmp_path / "run", group=trainer.mesh.world), trainer, loader=loader,
                 model_config=HF, params="trainable")
    other, loader2 = _lora_trainer(rank=4, alpha=32.0, dropout=0.1, targets=["qkv", "fc2"])
    before = {n: p.detach().clone() for n, p in other.chunks.named_parameters()}
    with pytest.raises(ValueError, match=r"LoRA settings.*alpha \(8.0 -> 32.0\).*dropout \(0.0 -> 0.1\).*"
                                         r"posttrain.lora") as err:
        load_trainer(other, tmp_path / "run", group=other.mesh.world, loader=loader2, params="trainable")
    assert "rank (" not in str(err.value)
    assert other.step == 0 and all(torch.equal(p, before[n]) for n, p in other.chunks.named_parameters())
    same, loader3 = _lora_trainer(rank=4, alpha=8.0, targets=["qkv", "fc2"])
    load_trainer(same, tmp_path / "run", group=same.mesh.world, loader=loader3, params="trainable")
    assert same.step == 1


# -- GRPO reward inputs --------------------------------------------------------------------------------

@pytest.mark.parametrize("record, match", [
    ({}, r"p.jsonl:1: reward 'arithmetic': the record has no 'answer' field"),
    ({"answer": "six"}, r"p.jsonl:1: reward 'arithmetic': record answer 'six' is not a finite number"),
    ({"answer": "nan"}, r"p.jsonl:1: reward 'arithmetic': record answer 'nan' is not a finite number"),
])
def test_grpo_records_with_bad_reward_inputs_are_refused_at_preparation(record, match):
    from engine.data.tokenizer import ByteTokenizer
    from engine.posttrain.chat import ChatTemplate
    from engine.posttrain.rollout import prompt_records, reward_registry

    template = ChatTemplate(text="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                 "{% if add_generation_prompt %}<assistant>{% endif %}", source="x", variables={})
    good = {"messages": [{"role": "user", "content": "2+2?"}], "reward": "arithmetic", "answer": 4,
            "_where": "p.jsonl:2"}
    bad = {"messages": [{"role": "user", "content": "3+3?"}], "reward": "arithmetic", "_where": "p.jsonl:1", **record}
    kw = dict(template=template, tokenizer=ByteTokenizer(), registry=reward_registry(), seq_length=128,
              max_new_tokens=8)
    assert len(prompt_records([good], **kw)) == 1
    with pytest.raises(ValueError, match=match):
        prompt_records([good, bad], **kw)


def test_a_reward_declares_its_record_check():
    from engine.data.tokenizer import ByteTokenizer
    from engine.posttrain.chat import ChatTemplate
    from engine.posttrain.rollout import prompt_records, reward_registry

    def contains(record, completion):
        return float(record["needle"] in completion)

    def check(record):
        if not isinstance(record.get("needle"), str):
            raise ValueError("reward 'contains' needs a string 'needle'")
    contains.check = check
    registry = reward_registry()
    registry.register("contains", contains)
    template = ChatTemplate(text="{% for m in messages %}{{ m.content }}{% endfor %}", source="x", variables={})
    rec = {"messages": [{"role": "user", "content": "q"}], "reward": "contains", "_where": "p.jsonl:1"}
    kw = dict(template=template, tokenizer=ByteTokenizer(), registry=registry, seq_length=64, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"p.jsonl:1: reward 'contains' needs a string 'needle'"):
        prompt_records([rec], **kw)
    assert len(prompt_records([{**rec, "needle": "x"}], **kw)) == 1


def _scores_part():
    """tp2 x pp2 on 4 ranks: a reward that answers each rank differently (as a sampled judge may) is called on
    the replica's first rank only, and every rank takes its scores."""
    import torch.distributed as dist

    from engine.data.tokenizer import ByteTokenizer
    from engine.posttrain.rewards import RewardRegistry
    from engine.posttrain.rollout import RolloutLoader
    from parallel.mesh import Mesh, ParallelDims

    calls = []

    def by_rank(record, completion):
        calls.append(completion)
        return float(dist.get_rank()) + len(completion)

    registry = RewardRegistry()
    registry.register("by_rank", by_rank)
    loader = object.__new__(RolloutLoader)  # only what _scores reads
    loader.trainer = type("T", (), {"mesh": Mesh.build(ParallelDims(tp=2, pp=2)), "device": torch.device("cpu")})()
    loader.registry, loader.tokenizer = registry, ByteTokenizer()
    records = [{"reward": "by_rank"}] * 3
    return loader._scores(records, [[104, 105], [104], []]), len(calls)


def test_rollout_rewards_are_scored_once_per_replica_and_broadcast():
    from parallel.testing import run_distributed

    out = run_distributed(_scores_part, 4)
    assert [scores for scores, _ in out] == [[2.0, 1.0, 0.0]] * 4  # rank 0's: 0 + the completions' lengths
    assert [n for _, n in out] == [3, 0, 0, 0]
