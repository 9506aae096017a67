"""Every user-facing checkpoint error, each with the message that names the problem and the fix."""
import json
import os
import re
import shutil

import pytest
import torch

from engine.checkpoint import (CheckpointError, CheckpointWarning, ShardedTensor, find_latest_checkpoint,
                               load_checkpoint, resolve_checkpoint, save_checkpoint, to_json_state)
from engine.checkpoint.format import read_metadata


@pytest.fixture()
def ckpt(tmp_path):
    w = torch.arange(48, dtype=torch.float32).view(8, 6)
    b = torch.ones(6, dtype=torch.bfloat16)
    save_checkpoint(tmp_path, step=3, tensors=[ShardedTensor.replicated("w", w), ShardedTensor.replicated("b", b)],
                    model_config={"hidden": 6, "layers": 1})
    return tmp_path, tmp_path / "step_00000003"


def test_shape_mismatch_names_tensor_and_both_shapes(ckpt):
    root, _ = ckpt
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, tensors=[ShardedTensor.replicated("w", torch.zeros(4, 6)),
                                       ShardedTensor.replicated("b", torch.zeros(6, dtype=torch.bfloat16))])
    msg = str(e.value)
    assert "tensor 'w': checkpoint has global shape (8, 6), the model expects (4, 6)" in msg
    assert msg.startswith(f"checkpoint {root / 'step_00000003'} was saved from a different model configuration")
    assert '"hidden": 6' in msg


def test_a_different_model_is_said_first_and_briefly(tmp_path):
    # Resuming with another hidden size: every tensor mismatches, the message stays short, cause first.
    tensors = {f"layers.{i}.w": torch.zeros(8, 6) for i in range(200)}
    save_checkpoint(tmp_path, step=1, tensors=[ShardedTensor.replicated(k, v) for k, v in tensors.items()],
                    model_config={"hidden": 6})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, tensors=[ShardedTensor.replicated(k, torch.zeros(8, 12)) for k in tensors])
    msg = str(e.value)
    assert "200 tensor(s) do not match this model" in msg.split(", e.g.")[0]
    assert "and 197 more" in msg and len(msg) < 1500


def test_missing_tensors_are_listed_and_strict_false_reports_them(ckpt):
    root, _ = ckpt
    targets = [ShardedTensor.replicated("w", torch.zeros(8, 6)), ShardedTensor.replicated("lm_head", torch.zeros(2)),
               ShardedTensor.replicated("final_norm", torch.zeros(2))]
    with pytest.raises(CheckpointError, match=r"lacks 2 tensor\(s\) the model expects: 'lm_head', 'final_norm'"):
        load_checkpoint(root, tensors=targets)
    res = load_checkpoint(root, tensors=targets, strict=False)
    assert res.missing == ["lm_head", "final_norm"]
    assert torch.equal(targets[0].data, torch.arange(48.0).view(8, 6))


def test_dtype_mismatch_and_explicit_cast(ckpt):
    root, _ = ckpt
    b = torch.zeros(6)
    with pytest.raises(CheckpointError, match="tensor 'b': checkpoint has dtype bfloat16, the model expects float32"):
        load_checkpoint(root, tensors=[ShardedTensor.replicated("b", b)])
    load_checkpoint(root, tensors=[ShardedTensor.replicated("b", b)], allow_dtype_cast=True)
    assert torch.equal(b, torch.ones(6))


def test_checksum_mismatch_names_the_file(ckpt):
    root, step_dir = ckpt
    f = step_dir / "rank_00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # flip bits in tensor data; size and header unchanged
    f.write_bytes(bytes(raw))
    target = [ShardedTensor.replicated("w", torch.zeros(8, 6))]
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*rank_00000\.safetensors.*Checkpoint "
                                              r"step_00000003 is damaged: there is no complete checkpoint before") as e:
        load_checkpoint(root, tensors=target)
    assert e.value.on_every_rank  # a launcher says it once
    load_checkpoint(root, tensors=target, verify=False)  # the check is what caught it
    save_checkpoint(root, step=1, tensors=[ShardedTensor.replicated("w", torch.zeros(8, 6))])
    with pytest.warns(CheckpointWarning, match="latest names 'step_00000001'"), pytest.raises(CheckpointError, match=r"is damaged: move .*step_00000003 aside \(keep it to inspect\) to fall "
                                              r"back to step_00000001, the newest complete checkpoint before it"):
        load_checkpoint(root, tensors=target)


def test_missing_shard_file(ckpt):
    root, step_dir = ckpt
    (step_dir / "rank_00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is missing"):
        load_checkpoint(step_dir, tensors=[ShardedTensor.replicated("w", torch.zeros(8, 6))])
    # ...and auto-resume does not consider it complete.
    with pytest.warns(CheckpointWarning, match="listed in metadata.json is missing"):
        assert find_latest_checkpoint(root) is None


def test_incomplete_checkpoint_is_rejected_and_skipped_by_auto_resume(ckpt, tmp_path):
    root, step_dir = ckpt
    newer = root / "step_00000007"
    shutil.copytree(step_dir, newer)
    (newer / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="is not a complete Tessel checkpoint: metadata.json is missing"):
        load_checkpoint(newer)
    with pytest.warns(CheckpointWarning, match="ignoring incomplete checkpoint .*step_00000007"):
        assert resolve_checkpoint(root) == step_dir


def test_foreign_checkpoints(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is not a Tessel checkpoint: it holds neither metadata.json"):
        load_checkpoint(tmp_path / "hf")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metadata.json").write_text(json.dumps({"format": "megatron"}))
    with pytest.raises(CheckpointError, match="is not Tessel checkpoint metadata .*format='megatron'"):
        load_checkpoint(tmp_path / "other")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_checkpoint(tmp_path / "broken")


def test_newer_format_version(ckpt):
    _, step_dir = ckpt
    meta = json.loads((step_dir / "metadata.json").read_text())
    meta["version"] = 99
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format version 99; .* upgrade Tessel"):
        read_metadata(step_dir)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint path .*nowhere does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="checkpoint root .*nowhere does not exist"):
        find_latest_checkpoint(tmp_path / "nowhere")


def test_empty_root_has_no_checkpoint(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="is not a Tessel checkpoint"):
        load_checkpoint(tmp_path)



def test_a_run_directory_given_for_a_checkpoint_points_at_its_checkpoints(tmp_path):
    from engine.checkpoint import resolve_checkpoint

    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match=r"^--ckpt: .* is not a Tessel checkpoint.*a run directory keeps them "
                                              r"in .*checkpoints$"):
        resolve_checkpoint(tmp_path, what="--ckpt")
    with pytest.raises(CheckpointError, match=r"^--base: checkpoint path .*nowhere does not exist$"):
        resolve_checkpoint(tmp_path / "nowhere", what="--base")


def test_save_argument_errors(tmp_path):
    t = [ShardedTensor.replicated("w", torch.zeros(2))]
    with pytest.raises(ValueError, match="step=-1 must be an int >= 0"):
        save_checkpoint(tmp_path, step=-1, tensors=t)
    with pytest.raises(ValueError, match="keep_last=0 must be an int >= 1"):
        save_checkpoint(tmp_path, step=1, tensors=t, keep_last=0)
    with pytest.raises(ValueError, match=r"trainer_state.sched: value of type object is not JSON-able"):
        save_checkpoint(tmp_path, step=1, tensors=t, trainer_state={"sched": object()})
    with pytest.raises(ValueError, match="tensors must be ShardedTensor, got Tensor"):
        save_checkpoint(tmp_path, step=1, tensors=[torch.zeros(2)])
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        save_checkpoint(tmp_path / "file", step=1, tensors=t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing half-created


def test_incomplete_tiling_is_refused_at_save(tmp_path):
    half = ShardedTensor.chunked("w", torch.zeros(4, 6), dim=0, rank=0, size=2)
    with pytest.raises(CheckpointError, match=r"tensor 'w' of global shape \(8, 6\): .* cover 24 of 48 elements"):
        save_checkpoint(tmp_path, step=1, tensors=[half])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(key="", data=torch.zeros(2), global_shape=(2,)), "key='' must be a non-empty string"),
    (dict(key="a", data=[1.0], global_shape=(1,)), "data must be a torch.Tensor"),
    (dict(key="a", data=torch.zeros(2, dtype=torch.complex64), global_shape=(2,)), "cannot be checkpointed"),
    (dict(key="a", data=torch.zeros(3), global_shape=(4,), global_offset=(2,)), r"slice \[2, 5\) lies outside"),
    (dict(key="a", data=torch.zeros(3), global_shape=(4, 1)), "same number of dims"),
    (dict(key="a", data=torch.zeros(3), global_shape=(4,), local_shape=(2,)), "differs from local_shape"),
    (dict(key="a", data=torch.zeros(3), global_shape=(9,), flat_range=(0, 3)), "needs local_shape"),
    (dict(key="a", data=torch.zeros(3), global_shape=(4,), local_shape=(4,), flat_range=(2, 6)), "flat_range=.*<= 4"),
    (dict(key="a", data=torch.zeros(2, 1), global_shape=(4,), local_shape=(4,), flat_range=(0, 2)), "1-D data"),
    (dict(key="a", data=torch.zeros(0), global_shape=(4,)), "empty piece"),
    (dict(key="a", data=torch.zeros(4), global_shape=(4,), replica_id=-1), "replica_id=-1"),
    (dict(key="a", data=torch.zeros(4), global_shape=(-4,)), "negative"),
])
def test_sharded_tensor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedTensor(**kwargs)


def test_json_state_rejects_objects_and_round_trips_tensors():
    with pytest.raises(ValueError, match=r"state.a\[1\]: value of type set"):
        to_json_state({"a": [1, {2}]})
    with pytest.raises(ValueError, match="key 3 is not a string"):
        to_json_state({3: 1})


def test_leftover_temp_dir_is_ignored_with_a_warning(ckpt):
    root, step_dir = ckpt
    (root / ".tmp_step_00000009_deadbeef").mkdir()
    with pytest.warns(CheckpointWarning, match="tmp_step_00000009_deadbeef: the temporary directory"):
        assert find_latest_checkpoint(root) == step_dir
    assert os.path.isdir(root / ".tmp_step_00000009_deadbeef")


@pytest.mark.parametrize("raw,why", [
    (b"\x01", "shorter than the 8-byte header length"),
    ((2 ** 64 - 1).to_bytes(8, "little") + b"{}", "header length 18446744073709551615 does not fit"),
    ((2 ** 62).to_bytes(8, "little") + b"{}", "header length 4611686018427387904 does not fit"),
    ((4).to_bytes(8, "little") + b"[1] ", "the header is not a JSON object"),
    ((6).to_bytes(8, "little") + b"{nope}", "the header is not JSON"),
])
def test_safetensors_header_garbage_is_named(tmp_path, raw, why):
    from engine.checkpoint.safetensors_io import read_safetensors_header

    p = tmp_path / "x.safetensors"
    p.write_bytes(raw)
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match=re.escape(f"{p} is not a safetensors file ({why}")):
            read_safetensors_header(fd, p)
    finally:
        os.close(fd)


def test_safetensors_entry_without_offsets_is_named(tmp_path):
    from engine.checkpoint.safetensors_io import read_safetensors_header

    header = json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="entry 'w' lacks a dtype, a shape or data_offsets"):
            read_safetensors_header(fd, p)
    finally:
        os.close(fd)
