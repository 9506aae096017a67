"""The main job: layouts agree, runs are reproducible, and bad input fails clearly.

One small Llama (hidden 64, 4 layers, GQA) on a byte-tokenized corpus built in the test, same seed
and global batch (4 sequences of 32 tokens), 10 steps, fp32. The loss curves of TP=2xPP=2, TP=4,
DP=4, PP=4 and the 1-process run agree to 2e-4 absolute (different reduction orders in fp32,
compounded over 10 AdamW steps; measured: 3.6e-7), and so does the interleaved PP=2 x VP=2 run; two 1-process runs
agree bitwise.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from parallel.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10  # the loss falls by 1.1 in 10 steps; 20 took twice as long (tp4 on 2 cores: 31 s)
LAYOUTS = {"tp2pp2": (4, ["parallel.tp=2", "parallel.pp=2"]), "tp4": (4, ["parallel.tp=4"]),
           "dp4": (4, ["parallel.dp=4"]), "pp4": (4, ["parallel.pp=4"]),
           "pp2vp2": (2, ["parallel.pp=2", "parallel.vp=2", "parallel.schedule=interleaved"]),
           "single": (1, [])}


def _overrides(prefix, run_dir):
    return [f"data.paths={prefix}", f"data.tokenizer={prefix}.tokenizer.json", "model.vocab_size=257",
            "model.hidden_size=64", "model.num_layers=4", "model.num_attention_heads=8",
            "model.num_key_value_heads=4", "model.ffn_hidden_size=128", "model.max_position_embeddings=64",
            "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=1",
            f"train.steps={STEPS}", "train.eval_interval=0", "train.log_interval=100", "optim.warmup_steps=2",
            "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "parallel.sequence_parallel=true",
            "checkpoint.interval=0", "logging.tensorboard=false", "logging.progress_bar=off",
            "logging.peak_tflops=1.0", f"train.run_dir={run_dir}", "data.cache_dir=" + run_dir + "/cache"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    import json
    import textwrap
    docs = [textwrap.dedent(m.__doc__ or "") for m in (os, subprocess, json, textwrap, pytest)] * 8
    src = d / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs if t.strip()))
    prefix = str(d / "text_document")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(src),
                    "--output-prefix", prefix, "--tokenizer", "byte", "--workers", "1"], check=True,
                   capture_output=True)
    return prefix


def _train(prefix, run_dir, extra):
    import torch.distributed as dist

    from engine.config import load_config
    from tools.pretrain import train_from_config

    cfg = load_config("tiny_llama_cpu", _overrides(prefix, run_dir) + extra)
    hist = train_from_config(cfg, run_dir, rank=dist.get_rank(), world=dist.get_world_size())
    return [h.loss for h in hist]


def test_layouts_match_each_other_and_one_process(corpus, tmp_path):
    curves = {}
    for name, (world, extra) in LAYOUTS.items():
        curves[name] = run_distributed(_train, world, corpus, str(tmp_path / name), extra, timeout=300)[0]
    ref = curves["single"]
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.5  # it learns
    for name, curve in curves.items():
        assert max(abs(a - b) for a, b in zip(curve, ref)) < 2e-4, (name, curve, ref)
    again = run_distributed(_train, 1, corpus, str(tmp_path / "again"), [], timeout=300)[0]
    assert again == ref  # bitwise reproducible on CPU


def _cli(*args, nproc=1):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "tools", "pretrain.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def test_bad_input_is_a_clear_error(tmp_path, corpus, capsys):
    from tools.pretrain import main

    # refused in main()'s prepare(), before any process group: in this process (no interpreter start each)
    assert main(["--config", "no_such_preset"]) == 2
    err = capsys.readouterr().err
    assert "no_such_preset" in err and "tiny_llama_cpu" in err
    assert main(["--config", "tiny_llama_cpu", "--set", "data.paths=/nonexistent/text_document",
                 "--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "data.tokenizer=none"]) == 2
    assert "data path '/nonexistent/text_document' is missing" in capsys.readouterr().err
    # and through torchrun, two ranks: the layout's world size against the launch's, said by rank 0
    r = _cli("--config", "tiny_llama_cpu", *sum((["--set", o] for o in _overrides(corpus, str(tmp_path))), []),
             "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "parallel.dp=2", nproc=2)
    assert r.returncode != 0 and "world size 2" in r.stderr, r.stderr[-2000:]


def test_a_preset_too_big_is_refused_before_allocating(tmp_path, corpus):
    import time

    from engine.assembly import memory_plan
    from engine.config import load_config
    from models.hook import ModelHook

    cfg = load_config("llama3_8b", ["parallel.tp=2", "model.vocab_size=128256"])
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    plan = memory_plan(cfg, model, world=2, available=8 * 10**9)
    # 8.03e9 parameters, half the layers' and the vocab's on each TP rank: bf16 params (2) + fp32 grads (4)
    # + fp32 masters and moments (12) bytes each.
    assert not plan.fits and plan.bytes_per_param == 18 and 4.0e9 < plan.numel < 4.1e9
    assert "No layout of 2 ranks fits" in plan.error() and "refusing before allocating anything" in plan.error()
    roomy = memory_plan(cfg, model, world=2, available=10**12)
    assert roomy.fits
    sharded = memory_plan(load_config("llama3_8b", ["parallel.tp=2", "model.vocab_size=128256",
                                                    "parallel.dp=4", "optim.distributed=true"]),
                          model, world=8, available=30 * 10**9)
    assert not sharded.fits and "tp=8 pp=1 dp=1" in sharded.error()  # the layouts that would fit are named
    # ZeRO-2 shards the fp32 gradients too, ZeRO-3 the parameters as well: (2 + 4 + 12) / dp at dp = 4.
    for stage, want in ((2, 2 + 16 / 4), (3, 18 / 4)):
        z = memory_plan(load_config("llama3_8b", ["parallel.tp=2", "model.vocab_size=128256", "parallel.dp=4",
                                                  "optim.distributed=true", f"optim.zero_stage={stage}",
                                                  "optim.overlap_param_gather=false"]),
                        model, world=8, available=30 * 10**9)
        assert z.bytes_per_param == want and z.fits, (stage, z.bytes_per_param)
    # From the command line: refused at once, once (rank 0), with the plan.
    start = time.monotonic()
    r = _cli("--config", "llama3_8b", "--set", f"data.paths={corpus}", "--set", f"data.tokenizer={corpus}.tokenizer.json",
             "--set", "model.vocab_size=257", "--set", "parallel.tp=1", "--set", "train.global_batch_size=2",
             "--set", f"train.run_dir={tmp_path}", nproc=2)
    assert r.returncode != 0 and r.stderr.count("the run does not fit in memory") == 1, r.stderr[-2000:]
    assert "GB of parameters, fp32 gradients and optimizer state" in r.stderr
    assert time.monotonic() - start < 60


def test_the_plan_counts_the_data_parallel_methods_state():
    """DiLoCo's anchor, norm mask and momentum (+ 9 bytes per parameter; + 4 more with top-k, 4 fewer without
    momentum), 1-bit's error and mask (+ 5), PowerSGD's error feedback (+ 4), as engine.memory's report counts
    them; the layouts that would fit are sized without ZeRO, which these methods refuse, and say so."""
    from engine.assembly import memory_plan
    from engine.config import load_config
    from models.hook import ModelHook

    base = ["parallel.tp=2", "model.vocab_size=128256", "parallel.dp=4", "optim.distributed=false",
            "optim.overlap_param_gather=false"]
    model = ModelHook.from_run_config(load_config("llama3_8b", base), tokenizer_vocab=None)
    for sets, extra in (([], 0), (["outer.method=diloco"], 9), (["outer.method=diloco", "outer.compression=topk"], 13),
                        (["outer.method=diloco", "outer.momentum=0", "outer.nesterov=false"], 5),
                        (["optim.grad_compression=onebit"], 5), (["optim.grad_compression=powersgd"], 4)):
        plan = memory_plan(load_config("llama3_8b", base + sets), model, world=8, available=10**12)
        assert plan.bytes_per_param == 18 + extra, (sets, plan.bytes_per_param)
        assert ("DiLoCo's outer state" in plan.line()) == ("outer.method=diloco" in sets), plan.line()
    # tp=2 holds 4.0e9 parameters, 108 GB at 27 bytes each; tp=8 holds 1.0e9: 27.13 GB (18.09 GB without DiLoCo)
    tight = memory_plan(load_config("llama3_8b", base + ["outer.method=diloco"]), model, world=8, available=60 * 10**9)
    assert not tight.fits and "optim.distributed=false: DiLoCo and gradient compression run without ZeRO" in \
        tight.error() and "tp=8 pp=1 dp=1 (27.13 GB)" in tight.error(), tight.error()


def test_launch_mistakes_are_named_before_anything_is_written(tmp_path, corpus, capsys):
    """In-process (rank 0, before any process group): a post-training preset, no --config at all, and a
    checkpoint.load that does not exist, each named with its fix; the run directory is not created."""
    from tools.pretrain import main

    run_dir = tmp_path / "run"
    cases = [(["--config", "smollm2_sft"], "posttrain.method='sft' is post-training: run tools/posttrain.py"),
             (["--run-dir", str(run_dir)], "no --config: give a preset or TOML file, e.g. --config tiny_llama_cpu"),
             (["--config", "tiny_llama_cpu", "--run-dir", str(run_dir),
               *sum((["--set", o] for o in _overrides(corpus, str(run_dir))), []),
               "--set", "checkpoint.load=" + str(tmp_path / "nope")],
              f"checkpoint.load: checkpoint path {tmp_path / 'nope'} does not exist")]
    preset = ["--config", "tiny_llama_cpu", "--run-dir", str(run_dir), *sum((["--set", o] for o in _overrides(
        corpus, str(run_dir))), [])]
    for sets, message in ((["model.family=mixtral"], "the mixtral family needs config.json's 'num_local_experts', "
                                                     "which the [model] section has no key for"),
                          (["parallel.moe_dispatcher=allgather"], "parallel.moe_dispatcher='allgather' routes tokens "
                                                                  "to experts, but the llama model has none"),
                          (["train.activation_checkpointing=full", "train.recompute_num_layers=9"],
                           "train.recompute_num_layers=9 exceeds the model's 4 layers; set at most 4"),
                          (["model.fp8=tensorwise", "model.fp8_backend=te"],
                           "model.fp8_backend = 'te' needs Transformer Engine")):
        if sets[-1] == "model.fp8_backend=te" and importlib.util.find_spec("transformer_engine") is not None:
            continue
        cases.append(([*preset, *sum((["--set", s] for s in sets), [])], message))
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
        assert not run_dir.exists()


def test_interleaved_micro_batches_are_checked_in_the_configs_terms():
    from engine.assembly import check_microbatches
    from engine.config import load_config

    cfg = load_config("tiny_llama_cpu", ["parallel.vp=2", "parallel.schedule=interleaved",
                                         "train.global_batch_size=6", "train.micro_batch_size=2"])
    with pytest.raises(ValueError, match=r"train.global_batch_size=6 gives each of the dp=1 ranks 3 micro-batch\(es\) "
                                         r"of train.micro_batch_size=2; the interleaved schedule runs a multiple of "
                                         r"parallel.pp=2 .*set train.global_batch_size to 4 or 8$"):
        check_microbatches(cfg, 1)
    assert check_microbatches(load_config("tiny_llama_cpu", ["parallel.vp=2", "parallel.schedule=interleaved",
                                                             "train.global_batch_size=8"]), 2) == 2


def test_the_run_tokenizer_is_the_datas_own_unless_given_and_must_match_it(tmp_path, corpus):
    """data.tokenizer unset: the tokenizer preprocess_data.py saved beside the data (PREFIX.tokenizer.json);
    set to one with another vocabulary than the data's own: refused, naming the data's."""
    from tokenizers import Tokenizer, models

    from engine.assembly import run_tokenizer
    from engine.config import load_config

    base = _overrides(corpus, str(tmp_path))
    assert run_tokenizer(load_config("tiny_llama_cpu", base + ["data.tokenizer=none"])).vocab_size == 257
    other = tmp_path / "words.json"
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "</s>": 2}, unk_token="<unk>")).save(str(other))
    with pytest.raises(ValueError, match=rf"data path '{corpus}' was tokenized with {corpus}.tokenizer.json, whose "
                                         rf"vocabulary differs from data.tokenizer={other}: .*set data.tokenizer="
                                         rf"{corpus}.tokenizer.json"):
        run_tokenizer(load_config("tiny_llama_cpu", base + [f"data.tokenizer={other}"]))
    # two prefixes of one vocabulary pass; of two vocabularies (same size), refused naming both
    twin, alien = tmp_path / "twin", tmp_path / "alien"
    for prefix, vocab in ((twin, {"<unk>": 0, "a": 1, "</s>": 2}), (alien, {"<unk>": 0, "b": 1, "</s>": 2})):
        Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(f"{prefix}.tokenizer.json")
    words = ["data.tokenizer=none", "data.weights=none"]
    assert run_tokenizer(load_config("tiny_llama_cpu", base + words + [f"data.paths={twin},{twin}"])).vocab_size == 3
    with pytest.raises(ValueError, match=rf"data paths '{twin}' and '{alien}' were tokenized with different "
                                         r"vocabularies .*preprocess them with one tokenizer"):
        run_tokenizer(load_config("tiny_llama_cpu", base + words + [f"data.paths={twin},{alien}"]))
    run_tokenizer(load_config("tiny_llama_cpu", base + [f"data.paths={twin},{alien}", "data.weights=1,0",
                                                        "data.tokenizer=none"]))  # a prefix read 0 times is not


def test_relaunching_a_finished_run_says_so_and_exits_0(tmp_path, corpus, capsys):
    from tools.pretrain import main

    run_dir = str(tmp_path / "done")
    run_distributed(_train, 1, corpus, run_dir, ["train.steps=2"], timeout=120)
    lines = (tmp_path / "done" / "metrics.jsonl").read_text()
    argv = ["--config", "tiny_llama_cpu", "--run-dir", run_dir,
            *sum((["--set", o] for o in _overrides(corpus, run_dir) + ["train.steps=2"]), [])]
    assert main(argv) == 0
    assert (f"run directory '{run_dir}' is at step 2 (checkpoint step_00000002) and train.steps=2: nothing to train; "
            "raise train.steps (or train.max_tokens) to continue") in capsys.readouterr().err
    assert (tmp_path / "done" / "metrics.jsonl").read_text() == lines  # nothing started, nothing appended


def test_a_run_ended_by_max_tokens_is_finished_too(tmp_path):
    from engine.config import load_config
    from engine.fault import NothingToTrain, check_unfinished

    # 4 sequences x 32 tokens a step: max_tokens 300 ends the run at step 3 (the trainer's rule: ceil)
    cfg = load_config("tiny_llama_cpu", ["train.steps=10", "train.max_tokens=300", "train.global_batch_size=4",
                                         "train.seq_length=32", "optim.warmup_steps=0"])
    check_unfinished(cfg, str(tmp_path / "step_00000002"), "r")
    with pytest.raises(NothingToTrain, match=r"at step 3 .*train.max_tokens=300 ends it at step 3\): nothing"):
        check_unfinished(cfg, str(tmp_path / "step_00000003"), "r")
    check_unfinished(load_config("tiny_llama_cpu", ["train.steps=2", "optim.warmup_steps=0",
                                                    "checkpoint.peer_replica=true"]),
                     str(tmp_path / "step_00000002"), "r")  # peer replicas: the full start-up frees them
