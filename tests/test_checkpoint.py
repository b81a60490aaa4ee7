"""Tests for salaquant.io: the checkpoint reader, writer and staging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from salaquant.io.files import SETTINGS_NAME, CheckpointError
from salaquant.io.reader import CheckpointReader
from salaquant.io.writer import CheckpointWriter, save_state_dict

CONFIG = {"model_type": "minicpm_sala", "hidden_size": 16, "num_hidden_layers": 2}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.rand(16, generator=g),
        "lm_head.weight": torch.randn(32, 16, generator=g).to(torch.float16),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = torch.randn(16, 16, generator=g).to(torch.bfloat16)
        state[p + "self_attn.k_proj.weight"] = torch.randn(8, 16, generator=g).to(torch.bfloat16)
        state[p + "mlp.down_proj.qweight"] = torch.randint(-(2**31), 2**31 - 1, (4, 16), dtype=torch.int32)
        state[p + "input_layernorm.weight"] = torch.rand(16, generator=g)
    state["model.layers.1.self_attn.o_proj.weight"] = torch.randn(16, 16, generator=g).t()  # non-contiguous
    return state


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())


def _write_ckpt(path: Path, state: dict[str, torch.Tensor], max_shard_bytes: int) -> Path:
    return save_state_dict(state, path, CONFIG, max_shard_bytes=max_shard_bytes)


def _salaquant_ckpt(path: Path, state: dict[str, torch.Tensor], max_shard_bytes: int = 10**9) -> Path:
    """A checkpoint as salaquant writes one (with its settings file): ``overwrite`` may replace it."""
    with CheckpointWriter(path, max_shard_bytes=max_shard_bytes) as w:
        w.write_json("config.json", CONFIG)
        w.write_json(SETTINGS_NAME, {"method": "test"})
        w.add_many(state)
    return path


def test_multi_shard_round_trip(tmp_path: Path) -> None:
    state = _state()
    out = _write_ckpt(tmp_path / "ckpt", state, max_shard_bytes=1200)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()

    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert sorted(weight_map) == sorted(state)
    assert set(weight_map.values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(_nbytes(t) for t in state.values())
    assert json.loads((out / "config.json").read_text()) == CONFIG

    seen: list[str] = []
    for shard in shards:
        loaded = load_file(str(out / shard))
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        for name, tensor in loaded.items():
            assert weight_map[name] == shard
            assert _bits_equal(tensor, state[name]), name
            seen.append(name)
    assert sorted(seen) == sorted(state)  # every tensor exactly once

    reader = CheckpointReader(out)
    assert reader.keys() == sorted(state)
    assert reader.total_bytes() == index["metadata"]["total_size"]
    assert reader.config() == CONFIG
    for name, tensor in state.items():
        assert name in reader
        assert _bits_equal(reader.get(name), tensor), name
    assert "missing.weight" not in reader


def test_single_shard_has_no_index(tmp_path: Path) -> None:
    state = _state()
    out = _write_ckpt(tmp_path / "ckpt", state, max_shard_bytes=10**9)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        assert _bits_equal(loaded[name], tensor)
    assert CheckpointReader(out).keys() == sorted(state)


def test_oversized_tensor_gets_its_own_shard(tmp_path: Path) -> None:
    state = {"a": torch.zeros(10), "big": torch.ones(100), "b": torch.zeros(10)}
    out = _write_ckpt(tmp_path / "ckpt", state, max_shard_bytes=100)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]
    assert len(set(shard_of.values())) == 3
    assert load_file(str(out / shard_of["big"])).keys() == {"big"}


def test_reader_lazy_get_and_headers(tmp_path: Path) -> None:
    state = _state()
    out = _write_ckpt(tmp_path / "ckpt", state, max_shard_bytes=1200)
    reader = CheckpointReader(out)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert reader.shape(name) == (8, 16)
    assert reader.dtype(name) == torch.bfloat16
    assert reader.dtype("model.layers.0.mlp.down_proj.qweight") == torch.int32
    assert reader._handles == {}  # header queries open no tensor data
    tensor = reader.get(name)
    assert _bits_equal(tensor, state[name])
    assert len(reader._handles) == 1  # only the shard holding the tensor was opened
    assert reader.get(name, dtype=torch.float32).dtype == torch.float32

    assert _bits_equal(reader.get_checked(name, (8, 16)), state[name])


def test_reader_without_index_reads_all_safetensors(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    save_file({"x": torch.arange(4.0)}, str(ckpt / "part-a.safetensors"))
    save_file({"y": torch.arange(3, dtype=torch.int64)}, str(ckpt / "part-b.safetensors"))
    reader = CheckpointReader(ckpt)
    assert reader.keys() == ["x", "y"]
    assert reader.get("y").tolist() == [0, 1, 2]


def test_missing_tensor_names_it_and_suggests(tmp_path: Path) -> None:
    reader = CheckpointReader(_write_ckpt(tmp_path / "ckpt", _state(), max_shard_bytes=1200))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_prj\.weight") as info:
        reader.get("model.layers.0.self_attn.q_prj.weight")
    assert "model.layers.0.self_attn.q_proj.weight" in str(info.value)
    with pytest.raises(CheckpointError, match="nope"):
        reader.shape("nope")


def test_get_checked_wrong_shape(tmp_path: Path) -> None:
    reader = CheckpointReader(_write_ckpt(tmp_path / "ckpt", _state(), max_shard_bytes=1200))
    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(CheckpointError) as info:
        reader.get_checked(name, (16, 16))
    msg = str(info.value)
    assert name in msg and "[8, 16]" in msg and "[16, 16]" in msg


def test_pickled_only_folder_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    (ckpt / "pytorch_model.bin").write_bytes(b"not a real pickle")
    with pytest.raises(CheckpointError, match="safetensors") as info:
        CheckpointReader(ckpt)
    assert "pytorch_model.bin" in str(info.value)
    assert "safe_serialization=True" in str(info.value)


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "absent")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"x": torch.zeros(2)}, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"config\.json"):
        CheckpointReader(ckpt)


def test_index_with_missing_shard(tmp_path: Path) -> None:
    out = _write_ckpt(tmp_path / "ckpt", _state(), max_shard_bytes=1200)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (out / victim).unlink()
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(out)
    msg = str(info.value)
    assert victim in msg and "model.safetensors.index.json" in msg


def test_existing_output_refused_and_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(CheckpointError, match="overwrite"):
        CheckpointWriter(out)
    with pytest.raises(CheckpointError, match="overwrite"):
        save_state_dict({"x": torch.zeros(2)}, out, CONFIG)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_exception_inside_writer_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), CheckpointWriter(out, max_shard_bytes=16) as w:
        w.add("a", torch.zeros(8))
        w.add("b", torch.zeros(8))  # forces a shard flush into the temporary folder
        assert any(w.tmp_dir.iterdir())
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_exception_keeps_previous_output(tmp_path: Path) -> None:
    out = _salaquant_ckpt(tmp_path / "out", {"x": torch.ones(3)})
    with pytest.raises(RuntimeError), CheckpointWriter(out, overwrite=True) as w:
        w.add("y", torch.zeros(3))
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert load_file(str(out / "model.safetensors"))["x"].tolist() == [1.0, 1.0, 1.0]


def test_overwrite_replaces(tmp_path: Path) -> None:
    out = _salaquant_ckpt(tmp_path / "out", _state(), max_shard_bytes=1200)
    assert (out / "model.safetensors.index.json").exists()
    save_state_dict({"x": torch.full((2,), 7.0)}, out, {"a": 1}, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(str(out / "model.safetensors"))["x"].tolist() == [7.0, 7.0]
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_duplicate_name_and_later_mutation(tmp_path: Path) -> None:
    src = torch.zeros(4)
    with pytest.raises(CheckpointError, match="'w'"), CheckpointWriter(tmp_path / "out") as w:
        w.add("w", src)
        w.add("w", src)
    assert not (tmp_path / "out").exists()
    with CheckpointWriter(tmp_path / "out2") as w:
        w.add("w", src)
        src.fill_(5.0)  # the writer holds its own copy
    assert load_file(str(tmp_path / "out2" / "model.safetensors"))["w"].tolist() == [0.0] * 4


def test_copy_aux(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {
        "config.json": "{}",
        "tokenizer.json": '{"t": 1}',
        "tokenizer_config.json": "{}",
        "generation_config.json": '{"g": 1}',
        "modeling_x.py": "raise SystemExit('must not run')\n",
        "README.md": "readme",
        "LICENSE": "licence",
        "chat_template.jinja": "{{ x }}",
        "heldout.jsonl": '{"text": "held-out"}',
        "train_summary.json": "{}",
        "eval.json": "{}",
        "sub/notes.txt": "x",
        "model.safetensors.index.json": "{}",
        "pytorch_model.bin": "x",
        "pytorch_model.bin.index.json": "{}",
        "extra.pt": "x",
        "extra.pth": "x",
        "sub/nested.safetensors": "x",
    }
    for name, text in files.items():
        (src / name).write_text(text)
    save_file({"x": torch.zeros(1)}, str(src / "model.safetensors"))

    out = tmp_path / "out"
    with CheckpointWriter(out) as w:
        w.write_json("generation_config.json", {"g": 2})
        copied = w.copy_aux(src)
        w.write_json("config.json", {"c": 1})
        w.add("x", torch.zeros(1))
    assert copied == [
        "LICENSE",
        "README.md",
        "chat_template.jinja",
        "modeling_x.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == [
        "LICENSE",
        "README.md",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "modeling_x.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.json").read_text() == '{"t": 1}'
    assert (out / "modeling_x.py").read_text() == files["modeling_x.py"]
    assert json.loads((out / "generation_config.json").read_text()) == {"g": 2}
    assert json.loads((out / "config.json").read_text()) == {"c": 1}
    assert load_file(str(out / "model.safetensors"))["x"].tolist() == [0.0]


def test_write_json_layout(tmp_path: Path) -> None:
    with CheckpointWriter(tmp_path / "out") as w:
        w.write_json("config.json", {"b": 1, "a": [1, 2]})
        w.add("x", torch.zeros(1))
    assert (tmp_path / "out" / "config.json").read_text() == json.dumps({"b": 1, "a": [1, 2]}, indent=2) + "\n"
