"""The calibration engine against plain full-model forwards with hooks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from salaquant.calibration.contract import EngineOptions, LayerResult
from salaquant.calibration.engine import CalibrationEngine
from salaquant.calibration.host_memory import process_memory
from salaquant.model.config import SalaConfig
from salaquant.model.layout import input_groups
from salaquant.model.loading import load_model
from salaquant.work_folder import ResumeError


def _hidden_names(work: Path) -> list[str]:
    """The saved hidden states of a work folder, one file per leaf of samples."""
    names = sorted(f"hidden/{p.name}" for p in (work / "hidden").glob("*.safetensors"))
    assert names, f"no hidden states in {work}"
    return names


def _hidden_sample(work: Path, index: int) -> torch.Tensor:
    """Sample ``index``'s saved hidden state, from whichever leaf's file holds it."""
    for name in _hidden_names(work):
        tensors = load_file(work / name)
        if f"s{index:06d}" in tensors:
            return tensors[f"s{index:06d}"]
    raise KeyError(index)


def _samples(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 264, (n,), generator=g) for n in lengths]


def _opts(**kw) -> EngineOptions:
    base = {"device": "cpu", "show_progress": False, "hessian_dtype": "fp64", "resume_every": 1}
    base.update(kw)
    return EngineOptions(**base)


def _hooked_full_forward(path: Path, samples: list[torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """X^T X of every input group from plain whole-model forwards (dense), accumulated in float64."""
    model = load_model(path)
    cfg = model.config
    acc: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for g in input_groups(cfg, cfg.mixer_types[i]):
            key = (i, g.name)

            def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], key=key) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                acc[key] = acc.get(key, 0) + x.T @ x

            handles.append(layer.get_submodule(g.members[0]).register_forward_pre_hook(hook))
    with torch.no_grad():
        for s in samples:
            model(s[None], attention_mode="dense")
    for h in handles:
        h.remove()
    return acc


def test_hessians_equal_full_forward_hooks(tiny_ckpt: Path, tmp_path: Path) -> None:
    samples = _samples([50, 300, 17])  # one sample longer than dense_len (256): forced dense
    expect = _hooked_full_forward(tiny_ckpt, samples)
    engine = CalibrationEngine(tiny_ckpt, samples, tmp_path / "w", _opts(propagate="float"))
    result = engine.run()
    cfg = SalaConfig.from_file(tiny_ckpt)
    for i in range(cfg.num_hidden_layers):
        t = result.layer_tensors(i)
        for g in input_groups(cfg, cfg.mixer_types[i]):
            got = t[f"{g.name}.xtx"]
            ref = expect[(i, g.name)]
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9 * ref.abs().max()), (i, g.name)
            assert int(t[f"{g.name}.counts"][0]) == 367 and int(t[f"{g.name}.counts"][1]) == 3


def test_chunked_equals_unchunked(tiny_ckpt_fp32: Path, tmp_path: Path) -> None:
    samples = _samples([300, 90])
    a = CalibrationEngine(tiny_ckpt_fp32, samples, tmp_path / "a", _opts(chunk_tokens=37, propagate="float"))
    b = CalibrationEngine(tiny_ckpt_fp32, samples, tmp_path / "b", _opts(chunk_tokens=4096, propagate="float"))
    ra, rb = a.run(), b.run()
    for i in range(4):
        ta, tb = ra.layer_tensors(i), rb.layer_tensors(i)
        for k in ta:
            assert torch.allclose(ta[k], tb[k], rtol=1e-5, atol=1e-5 * tb[k].abs().max().item()), (i, k)
    for ha, hb in zip(a.final_hidden, b.final_hidden, strict=True):
        assert torch.allclose(ha, hb, rtol=1e-5, atol=1e-5 * hb.abs().max().item())


def test_release_frees_both_hidden_state_sets(tiny_ckpt_fp32: Path, tmp_path: Path) -> None:
    import gc
    import weakref

    engine = CalibrationEngine(tiny_ckpt_fp32, _samples([70, 40]), tmp_path / "w", _opts(propagate="float"))
    result = engine.run()
    assert engine.final_hidden is not None and engine._spare is not None
    held = [weakref.ref(t) for t in (*engine.final_hidden, *engine._spare[0])]
    engine.release()
    gc.collect()
    assert engine.final_hidden is None and all(r() is None for r in held)
    # the results on disk stay readable: release only drops the in-memory hidden states
    assert result.layer_tensors(0)


def test_forced_dense_matches_dense_model_not_sparse(tiny_ckpt_fp32: Path, tmp_path: Path) -> None:
    samples = _samples([600])  # > dense_len 256, and long enough that sparse selection drops blocks
    opts = _opts(propagate="float", hessian=False, chunk_tokens=128)
    engine = CalibrationEngine(tiny_ckpt_fp32, samples, tmp_path / "w", opts)
    engine.run()
    model = load_model(tiny_ckpt_fp32)
    with torch.no_grad():
        dense = model.model(samples[0][None], attention_mode="dense")
        sparse = model.model(samples[0][None], attention_mode="sparse")
    ours = model.model.norm(engine.final_hidden[0])
    assert torch.allclose(ours, dense, rtol=1e-4, atol=1e-4 * dense.abs().max().item())
    assert (ours - sparse).abs().max() > 1e-2 * sparse.abs().max()


class _RoundToNearest:
    """A minimal quantizer: 4-bit symmetric per-row fake quantization of every linear."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.seen: list[int] = []

    def quantize_layer(self, index, layer, stats) -> LayerResult:
        if index == self.fail_at:
            raise KeyboardInterrupt("simulated interruption")
        self.seen.append(index)
        tensors = {}
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear):
                w = mod.weight.data.float()
                scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / 7
                q = (w / scale).round().clamp(-8, 7)
                mod.weight.data = (q * scale).to(mod.weight.dtype)
                tensors[f"{name}.scale"] = scale
        return LayerResult(layer=layer, tensors=tensors, report={"index": index, "groups": sorted(stats)})


def test_quantized_propagation_and_resume_bytes(tiny_ckpt: Path, tmp_path: Path) -> None:
    samples = _samples([120, 300])
    full = CalibrationEngine(tiny_ckpt, samples, tmp_path / "full", _opts())
    ref = full.run(_RoundToNearest())
    assert [r["index"] for r in ref.reports] == [0, 1, 2, 3]

    work = tmp_path / "resumed"
    interrupted = CalibrationEngine(tiny_ckpt, samples, work, _opts())
    with pytest.raises(KeyboardInterrupt):
        interrupted.run(_RoundToNearest(fail_at=2))
    again = CalibrationEngine(tiny_ckpt, samples, work, _opts())
    with pytest.raises(ResumeError, match="--resume"):
        again.run(_RoundToNearest())
    q = _RoundToNearest()
    again.run(q, resume=True)
    assert q.seen == [2, 3]  # layers 0 and 1 were not redone
    for i in range(4):
        assert (work / "layers" / f"{i:03d}.safetensors").read_bytes() == (
            tmp_path / "full" / "layers" / f"{i:03d}.safetensors"
        ).read_bytes()
    for name in _hidden_names(tmp_path / "full"):  # after layer 2: the last layer's outputs are not saved
        assert (work / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
    assert all(torch.equal(a, b) for a, b in zip(again.final_hidden, full.final_hidden, strict=True))
    # Resume points every other layer: interrupted in layer 1, a resumed run starts over at layer 0 (nothing saved
    # yet); interrupted in layer 3, it starts at layer 2; the bytes are those of the uninterrupted run.
    for fail_at, redone in ((1, [0, 1, 2, 3]), (3, [2, 3])):
        work2 = tmp_path / f"every2-{fail_at}"
        with pytest.raises(KeyboardInterrupt):
            CalibrationEngine(tiny_ckpt, samples, work2, _opts(resume_every=2)).run(_RoundToNearest(fail_at=fail_at))
        q2 = _RoundToNearest()
        resumed = CalibrationEngine(tiny_ckpt, samples, work2, _opts(resume_every=2))
        resumed.run(q2, resume=True)
        assert q2.seen == redone
        for name in [f"layers/{i:03d}.safetensors" for i in range(4)]:
            assert (work2 / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
        assert all(torch.equal(a, b) for a, b in zip(resumed.final_hidden, full.final_hidden, strict=True))
    # a run resumed after its last layer computes nothing and reads no hidden states (none were saved after it)
    done = _RoundToNearest()
    finished = CalibrationEngine(tiny_ckpt, samples, work2, _opts(resume_every=2))
    assert len(finished.run(done, resume=True).reports) == 4 and done.seen == [] and finished.final_hidden is None
    # quantized propagation differs from float propagation
    flt = CalibrationEngine(tiny_ckpt, samples, tmp_path / "flt", _opts(propagate="float"))
    flt.run(_RoundToNearest())
    assert not torch.equal(_hidden_sample(tmp_path / "flt", 0), _hidden_sample(work, 0))


def test_quantized_propagation_equals_quantized_model(tiny_ckpt_fp32: Path, tmp_path: Path) -> None:
    """Outputs written over their inputs chunk by chunk give what the whole fake-quantized model computes."""
    samples = _samples([300, 90])
    opts = _opts(chunk_tokens=37, hessian=False)  # several chunks per sample, a partial last one
    engine = CalibrationEngine(tiny_ckpt_fp32, samples, tmp_path / "w", opts)
    engine.run(_RoundToNearest())
    model = load_model(tiny_ckpt_fp32)
    quantizer = _RoundToNearest()
    for i, layer in enumerate(model.model.layers):
        quantizer.quantize_layer(i, layer, {})
    assert engine.final_hidden is not None
    with torch.no_grad():
        for index, hidden in zip(engine.own, engine.final_hidden, strict=True):
            sample = samples[index]
            want = model.model(sample[None], attention_mode="dense")
            got = model.model.norm(hidden)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_resume_point_is_saved_before_the_next_layer_overwrites_it(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow background write of the hidden states still saves the layer's outputs, not the next layer's (the
    next layer's propagation waits for the writer before writing over each leaf's buffers)."""
    import time

    import salaquant.calibration.engine as pipeline

    samples = _samples([120, 300, 40, 75])  # several leaves hold samples
    save = pipeline._atomic_save

    def slow_save(tensors: dict, path: Path) -> None:
        if path.parent.name == "hidden":
            time.sleep(0.5)  # the next layer's statistics pass finishes meanwhile
        save(tensors, path)

    monkeypatch.setattr(pipeline, "_atomic_save", slow_save)
    work = tmp_path / "slow"
    # resume points after 2 and 4 layers: the first is written while layer 2 (the third) runs
    with pytest.raises(KeyboardInterrupt):
        CalibrationEngine(tiny_ckpt, samples, work, _opts(resume_every=2)).run(_RoundToNearest(fail_at=3))
    want = CalibrationEngine(tiny_ckpt, samples, tmp_path / "two", _opts(background_writes=False, resume_every=2))
    with pytest.raises(KeyboardInterrupt):
        want.run(_RoundToNearest(fail_at=2))
    names = _hidden_names(tmp_path / "two")
    assert names and all((work / n).read_bytes() == (tmp_path / "two" / n).read_bytes() for n in names)


def test_propagation_overwrites_a_leaf_once_its_file_is_written(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a resume point the propagation starts on a leaf whose file is written while later leaves are still
    being written, and overwrites no leaf before its file is on disk. A writer drained before the pass would write
    every file first; one not waited for at all would let the pass overwrite a leaf it is still reading."""
    import threading
    import time

    import salaquant.calibration.engine as pipeline

    events: list[tuple[str, int]] = []  # ("layer", i), ("saved", leaf), ("propagate", sample buffer address)
    lock = threading.Lock()
    save = pipeline._atomic_save

    def slow_save(tensors: dict, path: Path) -> None:
        if path.parent.name == "hidden":
            time.sleep(0.1)
        save(tensors, path)
        if path.parent.name == "hidden":
            with lock:
                events.append(("saved", int(path.stem.removeprefix("leaf"))))

    run_sample, layer_pass = CalibrationEngine._run_sample, CalibrationEngine._layer

    def logged_sample(self, layer, h, out, chunks) -> None:
        if out is h:  # the propagation writing over its inputs
            with lock:
                events.append(("propagate", h.data_ptr()))
        run_sample(self, layer, h, out, chunks)

    def logged_layer(self, i, *args):
        with lock:
            events.append(("layer", i))
        return layer_pass(self, i, *args)

    monkeypatch.setattr(pipeline, "_atomic_save", slow_save)
    monkeypatch.setattr(CalibrationEngine, "_run_sample", logged_sample)
    monkeypatch.setattr(CalibrationEngine, "_layer", logged_layer)
    monkeypatch.setattr(pipeline.host_memory, "second_set_fits", lambda *_: False)  # one set: in place
    engine = CalibrationEngine(tiny_ckpt, _samples([120, 300, 40, 75, 60]), tmp_path / "w", _opts(resume_every=1))
    engine.run(_RoundToNearest())
    leaf_of = {
        engine.final_hidden[j].data_ptr(): v
        for v, rows in zip(engine.ranks.leaves(), engine._leaf_rows, strict=True)
        for j in rows
    }
    saved: dict[int, int] = {}
    layer, overlapped = -1, 0
    for what, value in events:
        if what == "layer":
            layer = value
        elif what == "saved":
            saved[value] = saved.get(value, 0) + 1
        else:
            leaf = leaf_of[value]
            # layers 0 .. layer - 1 were each a resume point: this leaf's file is written that many times
            assert saved.get(leaf, 0) >= layer, f"layer {layer} overwrote leaf {leaf} before its file was written"
            overlapped += any(saved.get(v, 0) < layer for v in engine.ranks.leaves())  # a file still to come
    assert layer == 3 and overlapped > 0, f"no propagation ran while a resume point was still being written: {events}"


def test_a_second_set_takes_the_outputs_while_a_resume_point_is_written(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a second set fits, the propagation after a resume point writes to it while the files are still being
    written (it waits for none of them) and the run ends with the same outputs and files as a run with one set."""
    import time

    import salaquant.calibration.engine as pipeline

    samples = _samples([120, 300, 40, 75, 60])

    def run(second: bool, work: Path) -> tuple[CalibrationEngine, list[tuple[bool, bool]]]:
        seen: list[tuple[bool, bool]] = []  # per propagation: (in place, a hidden-state file still being written)
        save = pipeline._atomic_save
        pending = {"n": 0}

        def slow_save(tensors: dict, path: Path) -> None:
            if path.parent.name == "hidden":
                time.sleep(0.05)
            save(tensors, path)

        run_sample = CalibrationEngine._run_sample

        def logged_sample(self, layer, h, out, chunks) -> None:
            if out is not None and self.opts.propagate == "quantized":
                seen.append((out is h, pending["n"] > 0))
            run_sample(self, layer, h, out, chunks)

        def counted_submit(self, writer, i, files, hs):
            jobs, last = submit(self, writer, i, files, hs)
            for job in jobs:
                pending["n"] += 1
                job.add_done_callback(lambda _j: pending.__setitem__("n", pending["n"] - 1))
            return jobs, last

        submit = CalibrationEngine._submit_persist
        with monkeypatch.context() as m:
            m.setattr(pipeline, "_atomic_save", slow_save)
            m.setattr(CalibrationEngine, "_run_sample", logged_sample)
            m.setattr(CalibrationEngine, "_submit_persist", counted_submit)
            m.setattr(pipeline.host_memory, "second_set_fits", lambda *_: second)
            engine = CalibrationEngine(tiny_ckpt, samples, work, _opts(resume_every=1))
            engine.run(_RoundToNearest())
        return engine, seen

    two, seen_two = run(True, tmp_path / "two")
    one, seen_one = run(False, tmp_path / "one")
    assert any(not in_place and busy for in_place, busy in seen_two), seen_two
    assert not any(in_place and busy for in_place, busy in seen_two), "wrote in place while a file was written"
    assert all(in_place for in_place, _ in seen_one)
    for a, b in zip(two.final_hidden, one.final_hidden, strict=True):
        assert torch.equal(a, b)
    for path in sorted((tmp_path / "one").rglob("*.safetensors")):
        other = tmp_path / "two" / path.relative_to(tmp_path / "one")
        assert other.read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize(("propagate", "second"), [("quantized", False), ("quantized", True), ("float", True)])
def test_no_buffer_changes_while_its_file_is_written(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, propagate: str, second: bool
) -> None:
    """Every resume point's hidden states, written slowly while the next layers run, hold the same values when their
    write ends as when it began: no propagation writes over them and no spare set is reused before they are on
    disk. The run ends with the same outputs as one whose writes block. With a second set (always so with float
    propagation) the first resume point's files are held back until layer 2 begins: the run waits for a layer's
    files two layers later, not one (a run waiting earlier would never reach layer 2, and the hold times out)."""
    import hashlib
    import threading
    import time

    import salaquant.calibration.engine as pipeline

    save = pipeline._atomic_save
    changed: list[str] = []
    layer_two = threading.Event()
    held = {"first": True, "timed_out": False}

    def digest(tensors: dict) -> str:
        h = hashlib.sha256()
        for k in sorted(tensors):
            h.update(tensors[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def slow_save(tensors: dict, path: Path) -> None:
        if path.parent.name == "hidden":
            before = digest(tensors)
            if second and held["first"]:  # the resume point after layer 0
                held["timed_out"] |= not layer_two.wait(timeout=10)
            time.sleep(0.05)
            if digest(tensors) != before:
                changed.append(path.name)
        save(tensors, path)

    layer_pass, submit = CalibrationEngine._layer, CalibrationEngine._submit_persist

    def logged_layer(self, i, *args):
        if i == 2:
            layer_two.set()
        return layer_pass(self, i, *args)

    def marked_submit(self, writer, i, *args):
        if i == 1:  # the first resume point's jobs are all queued before layer 1's
            writer.submit(held.__setitem__, "first", False)
        return submit(self, writer, i, *args)

    samples = _samples([120, 300, 40, 75, 60])
    monkeypatch.setattr(pipeline.host_memory, "second_set_fits", lambda *_: second)
    want = CalibrationEngine(tiny_ckpt, samples, tmp_path / "b", _opts(propagate=propagate, background_writes=False))
    want.run(_RoundToNearest())
    monkeypatch.setattr(pipeline, "_atomic_save", slow_save)
    monkeypatch.setattr(CalibrationEngine, "_layer", logged_layer)
    monkeypatch.setattr(CalibrationEngine, "_submit_persist", marked_submit)
    engine = CalibrationEngine(tiny_ckpt, samples, tmp_path / "a", _opts(propagate=propagate))
    engine.run(_RoundToNearest())
    assert not changed, f"buffers written over while their files were written: {changed}"
    assert not held["timed_out"], "the run waited for the first resume point's files before layer 2"
    for got, ref in zip(engine.final_hidden, want.final_hidden, strict=True):
        assert torch.equal(got, ref)


def test_resume_refuses_different_inputs(tiny_ckpt: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    with pytest.raises(KeyboardInterrupt):
        CalibrationEngine(tiny_ckpt, _samples([64]), work, _opts()).run(_RoundToNearest(fail_at=1))
    with pytest.raises(ResumeError, match="fingerprint"):
        CalibrationEngine(tiny_ckpt, _samples([64], seed=9), work, _opts()).run(_RoundToNearest(), resume=True)
    with pytest.raises(ResumeError, match="fingerprint"):
        CalibrationEngine(tiny_ckpt, _samples([64]), work, _opts(chunk_tokens=16)).run(_RoundToNearest(), resume=True)
    with pytest.raises(ResumeError, match="fingerprint"):
        CalibrationEngine(tiny_ckpt, _samples([64]), work, _opts(), settings={"bits": 8}).run(
            _RoundToNearest(), resume=True
        )


def test_stats_definitions(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Per-sample-normalised Hessian, mean x^2 and absmax against their definitions."""
    samples = _samples([40, 10])
    engine = CalibrationEngine(tiny_ckpt, samples, tmp_path / "w", _opts(propagate="float"))
    res = engine.run()
    model = load_model(tiny_ckpt)
    xs = []
    mod = model.model.layers[1].mlp.down_proj
    h = mod.register_forward_pre_hook(lambda _m, a: xs.append(a[0].reshape(-1, a[0].shape[-1]).double()))
    with torch.no_grad():
        for s in samples:
            model(s[None], attention_mode="dense")
    h.remove()
    t = res.layer_tensors(1)
    per_sample = sum(x.T @ x / x.shape[0] for x in xs) / 2
    stored = t["mlp_out.xtx_per_sample"] / int(t["mlp_out.counts"][1])  # stored as a sum over samples
    assert torch.allclose(stored, per_sample, rtol=1e-9, atol=1e-12)
    allx = torch.cat(xs)
    assert torch.allclose(t["mlp_out.sumsq"] / 50, (allx**2).mean(0), rtol=1e-9)
    assert torch.equal(t["mlp_out.absmax"], allx.abs().amax(0).float())


@pytest.mark.gpu
def test_gpu_pinned_asynchronous_copies_equal_synchronous(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Hidden states in pinned buffers (copies queued without waits, buffers reused across layers) give the same
    bytes as pageable buffers, whose copies complete before the call returns."""
    samples = _samples([120, 300, 65, 257])  # sizes just above powers of two, several chunks
    for name, pin in (("pinned", True), ("pageable", False)):
        opts = _opts(device="cuda", pin_memory=pin, chunk_tokens=64, resume_every=2)
        CalibrationEngine(tiny_ckpt, samples, tmp_path / name, opts).run(_RoundToNearest())
    for name in [f"layers/{i:03d}.safetensors" for i in range(4)] + _hidden_names(tmp_path / "pinned"):
        assert (tmp_path / "pinned" / name).read_bytes() == (tmp_path / "pageable" / name).read_bytes(), name


def _rss_file_bytes() -> int:
    value = process_memory("RssFile")
    assert value is not None, "no RssFile line"
    return value


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_checkpoint_pages_do_not_accumulate_in_resident_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shards are memory-mapped; pages a layer read must leave the resident set with the layer, or the whole
    checkpoint ends up resident over a run. Control: with the reader's handles kept open they do accumulate."""
    from salaquant.io.reader import CheckpointReader
    from salaquant.model.tiny import preset_config, write_random_checkpoint

    cfg = preset_config("tiny")
    cfg.update(hidden_size=1024, intermediate_size=4096)  # ~25 MB of MLP weights per layer
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    layer_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) - 2 * 264 * 1024 * 2  # minus embeddings
    samples = _samples([16])
    opts = _opts(propagate="float", hessian=False)
    CalibrationEngine(ckpt, samples, tmp_path / "warm", opts).run()  # imports and first-use mappings

    def grown(work: str) -> int:
        engine = CalibrationEngine(ckpt, samples, tmp_path / work, opts)
        before = _rss_file_bytes()
        engine.run()
        return _rss_file_bytes() - before

    assert grown("closed") < 0.25 * layer_bytes
    monkeypatch.setattr(CheckpointReader, "close", lambda self: None)
    assert grown("kept-open") > 0.5 * layer_bytes
