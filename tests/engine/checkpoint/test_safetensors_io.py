"""engine/checkpoint/safetensors_io.py: the one writer, reader and checksum verifier of safetensors files.

The writer's files load with the safetensors library and its sha256 is the file's, also when tensors are
cut into many chunks (the chunk size forced small); the plan is enforced; the verifier names missing,
truncated and corrupt files.
"""
import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

import engine.checkpoint.safetensors_io as sio
from engine.checkpoint.format import CheckpointError


def test_writer_checks_its_plan(tmp_path):
    plan = [("x", torch.float32, (2, 3)), ("y", torch.bfloat16, (4,))]
    w = sio.SafetensorsWriter(tmp_path / "w.safetensors", plan, metadata={"k": "v"})
    with pytest.raises(ValueError, match="expected tensor"):
        w.write("y", torch.zeros(4, dtype=torch.bfloat16))
    w.write("x", torch.arange(6.0).reshape(2, 3).t().t())
    with pytest.raises(ValueError, match="never written"):
        w.close()
    with pytest.raises(ValueError, match="planned twice"):
        sio.SafetensorsWriter(tmp_path / "z.safetensors", plan + plan[:1])


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_written_files_load_and_hash(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sio, "CHUNK_BYTES", chunk)
    x = torch.arange(6.0).reshape(3, 2).t()  # non-contiguous input
    entries = [("x", x), ("y", torch.ones(5, dtype=torch.bfloat16)), ("empty", torch.zeros(0, 3))]
    res = sio.write_safetensors(tmp_path / "w.safetensors", entries, metadata={"format": "pt"})
    raw = (tmp_path / "w.safetensors").read_bytes()
    assert res.sha256 == hashlib.sha256(raw).hexdigest() and res.bytes == len(raw) and res.file == "w.safetensors"
    got = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(got["x"], x) and torch.equal(got["y"], entries[1][1]) and got["empty"].shape == (0, 3)
    fd = os.open(tmp_path / "w.safetensors", os.O_RDONLY)
    try:
        base, header = sio.read_safetensors_header(fd, tmp_path / "w.safetensors")
        buf = bytearray(4 * 6)
        sio.pread_exact(fd, memoryview(buf), base + header["x"]["data_offsets"][0], what="x")
        with pytest.raises(CheckpointError, match="the file ends early"):
            sio.pread_exact(fd, memoryview(bytearray(10)), len(raw) - 4, what="tail")
    finally:
        os.close(fd)
    assert torch.equal(torch.frombuffer(buf, dtype=torch.float32).view(2, 3), x)


def test_verify_files_names_each_problem(tmp_path):
    good = sio.write_safetensors(tmp_path / "a.safetensors", [("t", torch.ones(4))])
    bad = sio.write_safetensors(tmp_path / "b.safetensors", [("t", torch.ones(4))])
    short = sio.write_safetensors(tmp_path / "c.safetensors", [("t", torch.ones(4))])
    files = {r.file: {"sha256": r.sha256, "bytes": r.bytes} for r in (good, bad, short)}
    files["gone.safetensors"] = {"sha256": "0" * 64, "bytes": 1}
    assert sio.verify_files(tmp_path, files, ["a.safetensors"]) == []
    raw = bytearray((tmp_path / "b.safetensors").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "b.safetensors").write_bytes(bytes(raw))
    (tmp_path / "c.safetensors").write_bytes((tmp_path / "c.safetensors").read_bytes()[:-2])
    problems = sio.verify_files(tmp_path, files)
    assert len(problems) == 3
    assert any("checksum mismatch in" in p and "b.safetensors" in p for p in problems)
    assert any("c.safetensors" in p and "truncated" in p for p in problems)
    assert any("gone.safetensors is missing" in p for p in problems)
    assert "not listed in the metadata" in sio.verify_files(tmp_path, files, ["zzz.safetensors"])[0]
