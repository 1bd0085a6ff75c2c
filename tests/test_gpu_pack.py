"""scripts/gpu_pack.py: the pieces a GPU run with real weights travels in, packed and unpacked on the CPU (fake model
files, drafters, clips and wheel): byte-for-byte model parts, float16 drafters, the wheel installed, a missing piece
refused."""

import hashlib
import importlib.util
import json
import os
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from rayspec.models.registry import sha256

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_pack", os.path.join(ROOT, "scripts", "gpu_pack.py"))
gpu_pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_pack)


def test_byte_shuffle_round_trips():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 1000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        shuffled = gpu_pack.shuffle16(data)
        assert len(shuffled) == n and gpu_pack.unshuffle16(shuffled) == data
    assert gpu_pack.shuffle16(bytes([1, 2, 3, 4, 5])) == bytes([1, 3, 2, 4, 5])


def _fake_inputs(tmp):
    rng = np.random.default_rng(1)
    site = tmp / "site"
    parts = {}
    for k, pkg in enumerate(gpu_pack.BASE, 1):
        data = site / pkg / "data"
        data.mkdir(parents=True)
        weights = rng.standard_normal(1_200_000 + k).astype(np.float16).tobytes() + b"\x07"  # an odd length too
        (data / f"model.bin.part{k}").write_bytes(weights)
        parts[f"{pkg}/data/model.bin.part{k}"] = hashlib.sha256(weights).hexdigest()
    (site / gpu_pack.BASE[1] / "data" / "config.json").write_text("{}")
    zoo = tmp / "zoo"
    drafters = {}
    for name in gpu_pack.DRAFTERS:
        (zoo / name).mkdir(parents=True)
        drafters[name] = {"w": torch.randn(8, 4), "vocab": torch.arange(5)}
        save_file(drafters[name], str(zoo / name / "model.safetensors"))
        (zoo / name / "config.json").write_text("{}")
    (tmp / "lj" / "wavs").mkdir(parents=True)
    for i in range(3):
        (tmp / "lj" / "wavs" / f"{i}.wav").write_bytes(bytes([i]) * 100)
    (tmp / "lj" / "clips.jsonl").write_text("".join(json.dumps({"audio": f"wavs/{i}.wav"}) + "\n" for i in range(3)))
    (tmp / "whl").mkdir()
    info = "fakepkg-1.0.dist-info"
    files = {"fakepkg/__init__.py": "X = 1\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(tmp / "whl" / "fakepkg-1.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return site, zoo, parts, drafters


def test_pack_and_unpack_round_trip(tmp_path, capsys):
    site, zoo, parts, drafters = _fake_inputs(tmp_path)
    out, dest = tmp_path / "pieces", tmp_path / "device"
    budget = -(-gpu_pack.tree_bytes() // gpu_pack.MIB) + 2  # a piece of 1.75-2.75 MiB: the fake weights take ~4 (xz)
    assert gpu_pack.main(["pack", "-o", str(out), "--budget-mib", str(budget), "--wheels-dir", str(tmp_path / "whl"),
                          "--site", str(site),
                          "--zoo", str(zoo), "--clips-manifest", str(tmp_path / "lj" / "clips.jsonl"),
                          "--clips", "2"]) == 0
    pieces = sorted(os.listdir(out), key=int)
    assert len(pieces) >= 2 and "python3 scripts/gpu_pack.py unpack" in capsys.readouterr().out
    limit = budget * gpu_pack.MIB - gpu_pack.tree_bytes() - 256 * 1024
    assert all(os.path.getsize(out / p / "piece") <= limit for p in pieces)
    # the last piece alone is refused: a machine given back in between lost the others
    assert gpu_pack.main(["unpack", str(out / pieces[-1]), "--dest", str(tmp_path / "lost")]) == 1
    for p in pieces:
        assert gpu_pack.main(["unpack", str(out / p), "--dest", str(dest)]) == 0
    for rel, digest in parts.items():  # byte for byte: rayspec's SHA-256 check at load passes
        assert sha256(str(dest / "site" / rel)) == digest
    for pkg in gpu_pack.BASE:
        assert (dest / "site" / f"{pkg}-1.0.0.dist-info" / "METADATA").read_text().splitlines()[2] == "Version: 1.0.0"
    for name, want in drafters.items():
        got = load_file(str(dest / "zoo" / name / "model.safetensors"))
        assert got["w"].dtype == torch.float16 and torch.equal(got["w"], want["w"].half())
        assert torch.equal(got["vocab"], want["vocab"])
    assert len((dest / "lj" / "clips.jsonl").read_text().splitlines()) == 2
    assert (dest / "lj" / "wavs" / "1.wav").exists() and not (dest / "lj" / "wavs" / "2.wav").exists()
    env = (dest / "env.sh").read_text()
    assert f"{dest}/site" in env and "RAYSPEC_CACHE" in env and "rayspec/zoo" in env
    assert not (dest / "pieces").exists()
    assert (dest / "site" / "fakepkg" / "__init__.py").read_text() == "X = 1\n"  # the wheel, re-zipped, installed


def test_a_budget_the_tree_fills_is_refused(tmp_path):
    with pytest.raises(ValueError, match="leaves no room"):
        gpu_pack.cut(b"x" * 10, str(tmp_path / "p"), 100)
