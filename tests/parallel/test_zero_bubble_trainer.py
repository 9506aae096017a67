"""The V schedules (``parallel.schedule = zbv | dualpipev``) in the trainer, at pp = 2 on the tiny Llama with
tied embeddings (4 layers: one per virtual stage; rank 0 holds stages 0 and 3, rank 1 stages 1 and 2).

* Parity: after one step's pipeline every gradient (the tied embedding's in-rank sum included) equals the
  1-process run's within 1e-6 absolute (fp32), and the next two training steps and the forward-only
  evaluation give the 1-process losses within 1e-5 absolute (the tolerance of the zb-h1 trainer test).
* Bubble: the action order the trainer's runtime actually executed, timed at F = B = W = 1, idles exactly
  ``analytic_bubble``'s ``(p-1)F/(2m(F+B+W))`` (deterministic: no wall clock).
* Checkpoints (keys are by global layer): a zbv run stopped at step 1 and resumed gives step 2's loss
  bitwise; its checkpoint loads into 1F1B (pp = 2, loop placement) and gives the same loss within 1e-5,
  and 1F1B's step-2 checkpoint loads back into zbv and gives step 3's loss within 1e-5.
* Library: the V forward-only (evaluation) schedule validates over p in {2, 3, 4, 8}, m in [1, 4p]; the
  embedding group is each rank alone under the V placement; the config accepts zbv / dualpipev only
  with vp = 2 and refuses them with ZeRO-3 before any group exists.
One 2-rank launch runs every distributed part.
"""
from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.engine.test_assembly import HF, _cfg, _Masked

HF4 = {**HF, "num_hidden_layers": 4, "tie_word_embeddings": True}
GBS = 4  # micro-batches of 1 sample at dp = 1: m = 4 = 2 pp (DualPipeV's minimum)
STEPS = 2


def _build(cfg, *, run_dir=None, n=GBS * (STEPS + 3)):
    from engine.assembly import build_run
    from models.hook import ModelHook

    model = ModelHook.from_hf(HF4, dtype=torch.float32, seed=cfg.train.seed)
    return build_run(cfg, model=model, train_data=_Masked(n), checkpoints=run_dir is not None, run_dir=run_dir)


def _grads(run) -> dict[str, torch.Tensor]:
    """One step's pipeline and tied-embedding sum; every gradient by checkpoint key (the tied output copy
    under its own name)."""
    from parallel.pipeline.runtime import allreduce_tied_embedding_grads

    tr = run.trainer
    tr.optimizer.zero_grad()
    micro = [tr._to_device(next(run.train_loader)) for _ in range(tr.num_micro)]
    tr._pipeline(micro, train=True)
    allreduce_tied_embedding_grads(tr.tied, tr.mesh.embedding)
    tr.ddp.finish_grad_sync()  # as the optimizer step would (a no-op reduction at dp = 1)
    out = {}
    for name, q in tr.chunks.named_parameters():
        key = name.split(".", 1)[1]
        g = getattr(q, "main_grad", None)
        out[key] = (q.grad if g is None else g).detach().clone()
    return out


def _steps_and_eval(run) -> list[float]:
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(STEPS)]
    return losses + [run.trainer.evaluate(run.train_loader, 1)]


def _cfg_pp(schedule: str, **kw):
    vp = 2 if schedule in ("zbv", "dualpipev") else 1
    return _cfg(mbs=1, gbs=GBS, steps=STEPS + 1, extra=["parallel.pp=2", f"parallel.vp={vp}",
                                                          f"parallel.schedule={schedule}", *kw.get("extra", ())])


def _worker(root: str):
    import engine.trainer as trainer_mod
    from engine.checkpoint.trainer_state import load_trainer

    out = {}
    executed = []
    real = trainer_mod.run_schedule

    def recording(schedule, **kw):  # the action order the runtime really ran (training schedules only)
        res = real(schedule, **kw)
        if not schedule.forward_only:
            executed.append(res.executed)
        return res
    trainer_mod.run_schedule = recording
    try:
        for name in ("zbv", "dualpipev"):
            executed.clear()
            run = _build(_cfg_pp(name))
            tr = run.trainer
            info = {"stages": list(tr.my_stages), "eval_placement": tr.eval_schedule.placement,
                    "embedding_group": tr.mesh.embedding.size, "tied": len(tr.tied)}
            grads = _grads(run)  # the first global batch (no optimizer step); the steps train on the next ones
            order = list(executed[0])
            out[name] = {"info": info, "grads": grads, "losses": _steps_and_eval(run), "order": order}
    finally:
        trainer_mod.run_schedule = real

    # Checkpoints: zbv stopped after step 1 and resumed; its checkpoint into 1F1B; 1F1B's back into zbv.
    import torch.distributed as dist
    zbv = _build(_cfg_pp("zbv"), run_dir=f"{root}/zbv")
    straight = [zbv.trainer.train_step(zbv.train_loader).loss]
    zbv.save()
    zbv.checkpointer.finalize()
    step1 = zbv.checkpointer.latest()
    straight += [zbv.trainer.train_step(zbv.train_loader).loss for _ in range(2)]
    resumed = _build(_cfg_pp("zbv"), run_dir=f"{root}/zbv")
    load_trainer(resumed.trainer, step1, group=resumed.mesh.world, loader=resumed.train_loader)
    again = resumed.trainer.train_step(resumed.train_loader).loss
    loop = _build(_cfg_pp("1f1b"), run_dir=f"{root}/loop")
    load_trainer(loop.trainer, step1, group=loop.mesh.world, loader=loop.train_loader)
    into_loop = loop.trainer.train_step(loop.train_loader).loss
    loop.save()
    loop.checkpointer.finalize()
    back = _build(_cfg_pp("zbv"), run_dir=f"{root}/back")
    load_trainer(back.trainer, loop.checkpointer.latest(), group=back.mesh.world, loader=back.train_loader)
    into_v = back.trainer.train_step(back.train_loader).loss
    out["checkpoint"] = {"straight": straight, "resumed": again, "into_loop": into_loop, "back_into_v": into_v}
    return out


def _reference():
    run = _build(_cfg(mbs=1, gbs=GBS, steps=STEPS + 1))
    grads = _grads(run)
    return grads, _steps_and_eval(run)


def test_v_schedules_in_the_trainer(tmp_path):
    from parallel.pipeline import build_schedule
    from parallel.pipeline.simulate import dataflow_times
    from parallel.pipeline.zero_bubble import analytic_bubble

    ref_grads, ref_losses = _reference()
    results = run_distributed(_worker, 2, str(tmp_path), timeout=300)
    for name in ("zbv", "dualpipev"):
        orders = []
        for rank, res in enumerate(results):
            r = res[name]
            assert r["info"] == {"stages": [rank, 3 - rank], "eval_placement": "v", "embedding_group": 1,
                                 "tied": 2 if rank == 0 else 0}, (name, rank, r["info"])
            assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < 1e-5, (name, r["losses"], ref_losses)
            for key, g in r["grads"].items():
                ref = ref_grads["embedding.word_embeddings.weight" if key == "output_layer.weight" else key]
                torch.testing.assert_close(g, ref, atol=1e-6, rtol=0, msg=lambda m: f"{name} {key}: {m}")
            orders.append(r["order"])
        covered = {k for res in results for k in res[name]["grads"]}
        assert covered >= set(ref_grads), (name, set(ref_grads) - covered)
        # The executed order is the schedule's, and at unit costs it idles exactly the analytic bubble.
        schedule = build_schedule(name, pp=2, vp=2, microbatches=GBS)
        assert orders == [[a.key for a in acts] for acts in schedule.ranks], name
        times = dataflow_times(orders, pp=2, num_stages=4, fwd=(1.0,) * 4, bwd=(1.0,) * 4, wgt=(1.0,) * 4,
                               placement="v")
        makespan, busy = max(ts[-1][1] for ts in times), 3 * 2 * GBS
        _, analytic = analytic_bubble(name, pp=2, vp=2, microbatches=GBS, fwd=1.0, bwd=1.0, wgrad=1.0)
        assert (makespan - busy) / busy == pytest.approx(analytic, abs=1e-12), name
    ck = results[0]["checkpoint"]
    assert all(res["checkpoint"] == ck for res in results)
    assert ck["resumed"] == ck["straight"][1]  # stop + resume under zbv: bitwise
    assert abs(ck["into_loop"] - ck["straight"][1]) < 1e-5, ck
    assert abs(ck["back_into_v"] - ck["straight"][2]) < 1e-5, ck


def test_v_library_and_config():
    from engine.config import load_config
    from parallel.mesh import ParallelDims, group_rank_lists
    from parallel.pipeline import forward_only, validate

    for p in (2, 3, 4, 8):
        for m in range(1, 4 * p + 1):
            s = forward_only(p, 2, m, placement="v")
            validate(s)
            assert [sorted({a.stage for a in acts}) for acts in s.ranks] == [sorted({r, 2 * p - 1 - r})
                                                                             for r in range(p)]
    with pytest.raises(ValueError, match="two chunks per rank"):
        forward_only(2, 3, 4, placement="v")
    dims = ParallelDims(dp=2, pp=4)
    assert group_rank_lists("embedding", dims) == [[0, 3], [4, 7]]
    assert group_rank_lists("embedding", dims, placement="v") == [[0], [4]]
    base = ["parallel.pp=2", "parallel.schedule=zbv"]
    with pytest.raises(ValueError, match="needs parallel.vp=2"):
        load_config("tiny_llama_cpu", base)
    assert load_config("tiny_llama_cpu", base + ["parallel.vp=2"]).parallel.schedule == "zbv"
    with pytest.raises(ValueError, match="dualpipev.*does not compose with ZeRO-3"):
        load_config("tiny_llama_cpu", ["parallel.pp=2", "parallel.vp=2", "parallel.schedule=dualpipev",
                                       "optim.distributed=true", "optim.zero_stage=3"])
