"""The calibration engine: the model runs layer by layer over the calibration set in bounded memory.

For every decoder layer i: load layer i alone onto the compute device, run every sample through it
(minicpm4 layers in forced-dense attention, long samples in token chunks with the layer's KV cache or
GLA state carried between chunks), collect the statistics of each input group, hand the layer and its
statistics to the quantizer, then propagate the samples through the layer the quantizer returns (or
through the float layer). Hidden states stay in CPU memory between layers. Each finished layer is
recorded in a work folder with a fingerprint of model, data and settings, and the hidden states after it are
saved at each resume point (every layer on a CPU, every ``GPU_RESUME_EVERY``-th on a GPU; the last layer is
recorded without them, since no layer reads them), so an interrupted run resumes after the last resume point
and produces the same bytes as an uninterrupted one.

With several processes (``torchrun``, ``salaquant.calibration.distributed``) each holds the samples of its leaves of the
statistics tree (``.shards``), the processes' statistics are added in that fixed tree before each layer
is quantized, and every process quantizes the layer from the same sums: the exported bytes do not depend on the
number of processes. Rank 0 writes the layer files and the resume state; the hidden states are saved per leaf
(``hidden/leafN.safetensors``, by the process owning it), so a run resumes with any number of processes.

The hidden states live in pinned CPU memory, one set of buffers: the propagation pass writes each sample's
outputs over its inputs, chunk by chunk, with the copies on side streams beside the compute (``transfers``) and
one wait per pass, not per sample. A resume point's files are written one leaf at a time in the background, and
the next propagation overwrites a leaf's buffers as soon as that leaf's file is written, not after the whole set;
where memory allows a second set (``host_memory.second_set_fits``), that propagation writes to it instead and
waits for no file. (Float propagation, where the statistics pass also produces the outputs, always uses a second
set, and the two swap roles from layer to layer.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from .. import __version__
from ..devices import resolve_device
from ..io.atomic import atomic_json, atomic_write
from ..io.background import BackgroundWriter
from ..io.reader import CheckpointReader
from ..io.safetensors_stream import write_safetensors
from ..model.cache import LightningLayerCache, SparseLayerCache
from ..model.config import LIGHTNING, SalaConfig
from ..model.layout import global_parameter_shapes, input_groups
from ..model.loading import CheckpointParts
from ..model.modeling import DecoderLayer, layer_rope
from ..runtime.load import use_layer_kernels
from . import host_memory
from .calib_data import samples_fingerprint
from .collector import GroupCollector, last_product_skipped
from .contract import EngineOptions, EngineResult, LayerQuantizer, LayerResult, Observer
from .distributed import (
    SINGLE,
    Ranks,
    barrier,
    combine,
    device_for,
    gather_object,
    same_everywhere,
    shard_tokens,
)
from .fingerprint import model_fingerprint
from .host_memory import empty_pinned_cache
from .resume_state import ResumeState
from .shards import LEAVES, TreeSum, split_leaves
from .stats import LayerStats
from .transfers import ChunkStream

log = logging.getLogger("salaquant.calibration.engine")


GPU_RESUME_EVERY = 4
"""Layers between two resume points on a GPU (on a CPU every layer is one). A resume point writes the hidden states
of every calibration sample: 3.76 GB for the 458,792-token pipeline set at the full shape, which took 3.6-4.3 s
on the H200 machine (about 0.95 GB/s once the page cache is full), while the work it overlaps before the next
layer's propagation must wait for it (load, statistics, solve) is about 2.8 s a layer: one per layer would add
about 26 s to the 139 s run, against at most 3 layers (about 13 s) computed again after an interruption. On a
CPU a layer takes far longer than writing its hidden states (the shipped model: seconds a layer for 64 KB)."""


WRITE_LAG = 2
"""After layer i the run waits for the files of layer i - WRITE_LAG and earlier, so a resume point's hidden states
(3.76 GB, about 4-5 s to write at the H100 machine's disk rate) may take the next two layers to be written rather
than one (a layer takes about 3.6 s at the full shape); a failed write stops the run that much later. The buffers
they are written from are not reused before they are written."""


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    atomic_write(path, lambda tmp: write_safetensors(tensors, tmp))


def _merge_by_name(left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    """Adds each of ``right``'s sums (GroupStats, observers) into ``left``'s of the same name."""
    for name in sorted(left):
        left[name].merge(right[name])
    return left


def _tensors_by_name(sums: dict[str, Any]) -> list[torch.Tensor]:
    return [t for name in sorted(sums) for t in sums[name].tensors()]


class CalibrationEngine:
    def __init__(
        self,
        model_path: str | Path,
        samples: Sequence[torch.Tensor],
        work_dir: str | Path,
        options: EngineOptions | None = None,
        settings: dict[str, Any] | None = None,
        ranks: Ranks = SINGLE,
    ) -> None:
        """``samples``: 1-D token-id tensors (all of them, in every process). ``settings``: the quantizer's own
        settings (fingerprinted). ``ranks``: this process's place in a data-parallel run."""
        self.reader = CheckpointReader(model_path)
        self.config = SalaConfig.from_dict(self.reader.config())
        self.samples = [s.reshape(-1).to(torch.int64) for s in samples]
        if not self.samples:
            raise ValueError("no calibration samples")
        self.work_dir = Path(work_dir)
        self.opts = options or EngineOptions()
        if self.opts.propagate not in ("quantized", "float"):
            raise ValueError(f"propagate must be 'quantized' or 'float', got {self.opts.propagate!r}")
        if self.opts.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        if self.opts.resume_every is not None and self.opts.resume_every < 1:
            raise ValueError("resume_every must be >= 1")
        self.ranks = ranks
        self.device = device_for(ranks, resolve_device(self.opts.device))
        self.parts = CheckpointParts(self.reader, self.config, self.device)
        self.resume_every = self.opts.resume_every or (1 if self.device.type == "cpu" else GPU_RESUME_EVERY)
        lengths = [s.numel() for s in self.samples]
        self.leaves = split_leaves(lengths)
        self.rank_tokens = shard_tokens(lengths, self.leaves, ranks.world)
        self.own_leaves = [self.leaves[v] for v in ranks.leaves()]
        self.own = [i for leaf in self.own_leaves for i in leaf]  # global sample indices, in leaf order
        ends = itertools.accumulate(len(leaf) for leaf in self.own_leaves)
        self._leaf_rows = [range(e - len(leaf), e) for leaf, e in zip(self.own_leaves, ends, strict=True)]  # in own
        self.settings = settings or {}
        # what a resumed run must share with the run it continues (recorded in state.json, to name what differs)
        inputs = {
            "model": model_fingerprint(self.reader),
            "data": samples_fingerprint(self.samples),
            "engine": self.opts.fingerprint_fields(),
            "leaves": LEAVES,
            "settings": self.settings,
            "salaquant": __version__,
        }
        self.state = ResumeState(self.work_dir, self.reader, inputs, self.config.num_hidden_layers, self.resume_every)
        self.fingerprint = self.state.fingerprint
        self.dtype = self.reader.dtype("model.embed_tokens.weight")
        same_everywhere(self.fingerprint, ranks, "the model, calibration data or settings")
        # CPU buffers for the next layer's outputs, and a wait for the writer to be done reading them
        self._spare: tuple[list[torch.Tensor], Callable[[], None]] | None = None
        self._second_set = False  # a propagation may write to a second set while a resume point is being written
        self.final_hidden: list[torch.Tensor] | None = None  # the last layer's outputs of ``own``, after run()

    def release(self) -> None:
        """Free the hidden-state buffers (``final_hidden`` and any spare set) and hand the pinned memory back.

        Call it once the run's results are taken: the commands do before they export, so the export does not
        add its shard buffer on top of hidden states nobody reads any more. PyTorch keeps
        freed pinned blocks for reuse; emptying that cache returns them to the system.
        """
        self.final_hidden = None
        self._spare = None
        if self.device.type == "cuda":
            empty_pinned_cache()

    def _largest_layer_bytes(self) -> int:
        """Bytes of the largest decoder layer as stored (headers only: no tensor data is read)."""
        sizes: dict[str, int] = {}
        for name in self.reader:
            parts = name.split(".")
            if len(parts) > 3 and parts[:2] == ["model", "layers"]:
                nbytes = math.prod(self.reader.shape(name)) * self.reader.dtype(name).itemsize
                sizes[parts[2]] = sizes.get(parts[2], 0) + nbytes
        self.reader.close()
        return max(sizes.values(), default=0)

    def _check_host_memory(self, quantizer: LayerQuantizer | None) -> None:
        """Refuse a run whose hidden states and layer cannot fit in this machine's memory; warn when they exceed
        what is available now."""
        float_sets = self.opts.propagate == "float" or quantizer is None
        plan = host_memory.plan_host_memory(
            [self.samples[i].numel() for i in self.own],
            self.config.hidden_size,
            self.dtype.itemsize,
            sets=2 if float_sets else 1,
            pinned=self.opts.pin_memory and self.device.type == "cuda",
            layer_bytes=self._largest_layer_bytes(),
        )
        advice = (
            "use fewer or shorter calibration samples (--max-samples, --max-len; in a recipe calibration.max_samples, "
            "calibration.max_len)"
        )
        if float_sets and quantizer is not None:
            advice += ", or quantized propagation (--propagate quantized; half the hidden-state memory)"
        message = host_memory.check_host_memory(plan, host_memory.meminfo, advice=advice)
        resume_points_save = self.resume_every < self.config.num_hidden_layers  # one before the last layer
        if not float_sets and resume_points_save and host_memory.second_set_fits(plan, host_memory.meminfo):
            self._second_set = True
            plan = replace(plan, sets=2)
        log.info("host memory: %s", plan.describe())
        if message is not None:
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ compute
    def _chunk_spans(self, t: int) -> list[tuple[int, int]]:
        """The (start, length) of each token chunk of a sample of ``t`` tokens."""
        step = self.opts.chunk_tokens
        return [(start, min(step, t - start)) for start in range(0, t, step)]

    def _pass_chunks(self, hs: list[torch.Tensor]) -> ChunkStream:
        """The chunks of every sample of ``hs`` this process owns, in the order a pass takes them (leaf order)."""
        order = (
            hs[j][:, s : s + n] for rows in self._leaf_rows for j in rows for s, n in self._chunk_spans(hs[j].shape[1])
        )
        return ChunkStream(self.device, order)

    @torch.no_grad()
    def _run_sample(self, layer: DecoderLayer, h: torch.Tensor, out: torch.Tensor | None, chunks: ChunkStream) -> None:
        """One sample [1, T, hidden] through one layer in token chunks, into ``out`` (None: outputs dropped).

        ``chunks`` holds the pass's inputs, copied one ahead; the copies back are queued without waiting, and
        `_sync` ends a pass.
        """
        cache = LightningLayerCache() if layer.kind == LIGHTNING else SparseLayerCache()
        for start, n in self._chunk_spans(h.shape[1]):
            x = chunks.take()
            y = layer(x, layer_rope(self.config, layer.kind, start, n, self.device), cache, self.opts.attention_mode)
            if out is not None:
                chunks.put(y, out[:, start : start + n])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _alloc_set(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> list[torch.Tensor]:
        """One buffer per sample, all views of a single (pinned) allocation: the pinned-memory allocator rounds
        every request up to a power of two, so per-sample requests just above one (a sample of 2^k + 1 tokens)
        would cost nearly twice their size; one request rounds once."""
        pin = self.opts.pin_memory and self.device.type == "cuda"
        sizes = [shape.numel() for shape in shapes]
        slab = torch.empty(sum(sizes), dtype=dtype, pin_memory=pin)
        return [v.view(shape) for v, shape in zip(slab.split(sizes), shapes, strict=True)]

    def _outputs(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Buffers for one layer's outputs: the spare CPU set (the inputs of the layer before) when there is one,
        once the writer no longer reads it."""
        spare, self._spare = self._spare, None
        if spare is not None and [s.shape for s in spare[0]] == [h.shape for h in hs]:
            spare[1]()
            return spare[0]
        return self._alloc_set([h.shape for h in hs], hs[0].dtype)

    def _embed(self) -> list[torch.Tensor]:
        weight = self.parts.tensor("model.embed_tokens.weight")
        own = [self.samples[i] for i in self.own]
        shapes = [torch.Size((1, ids.numel(), weight.shape[1])) for ids in own]
        hs = self._alloc_set(shapes, weight.dtype)
        for ids, buf in zip(own, hs, strict=True):
            buf.copy_((nn.functional.embedding(ids.to(self.device), weight) * self.config.scale_emb)[None])
        del weight
        self._sync()
        return hs

    def _hidden_path(self, leaf: int) -> Path:
        return self.work_dir / "hidden" / f"leaf{leaf}.safetensors"

    def _save_hidden_leaf(self, leaf: int, rows: range, hs: list[torch.Tensor]) -> None:
        """The hidden states of one leaf this process owns (keys: global sample indices)."""
        tensors = {f"s{self.own[j]:06d}": hs[j] for j in rows}
        _atomic_save(tensors or {"_empty": torch.zeros(0)}, self._hidden_path(leaf))

    def _load_hidden(self) -> list[torch.Tensor]:
        ts: list[torch.Tensor] = []
        for v, leaf in zip(self.ranks.leaves(), self.own_leaves, strict=True):
            loaded = load_file(self._hidden_path(v))
            ts += [loaded[f"s{i:06d}"] for i in leaf]
        hs = self._alloc_set([t.shape for t in ts], ts[0].dtype if ts else self.dtype)
        for buf, t in zip(hs, ts, strict=True):
            buf.copy_(t)
        return hs

    def run(self, quantizer: LayerQuantizer | None = None, resume: bool = False) -> EngineResult:
        """Run (or resume) the whole model; returns the per-layer reports and where the tensors are."""
        from ..progress import EngineProgress

        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "layers").mkdir(exist_ok=True)
        name = "log.txt" if self.ranks.main else f"log-rank{self.ranks.rank}.txt"
        handler = logging.FileHandler(self.work_dir / name)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        try:
            return self._run(quantizer, resume, EngineProgress(self.opts.show_progress and self.ranks.main))
        finally:
            log.removeHandler(handler)
            handler.close()

    def _run(self, quantizer: LayerQuantizer | None, resume: bool, progress) -> EngineResult:
        cfg = self.config
        n_layers = cfg.num_hidden_layers
        total_tokens = sum(s.numel() for s in self.samples)
        own_tokens = self.rank_tokens[self.ranks.rank]
        finished = self.state.resume_point(resume, self.ranks)
        timings = {"embed": 0.0, "load": 0.0, "stats_forward": 0.0, "quantize": 0.0, "propagate": 0.0, "save": 0.0}
        if self.ranks.parallel:
            timings["communicate"] = 0.0
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.opts.tf32
        log.info(
            "calibration: %d samples, %d tokens, %d layers, device %s, start at layer %d; process %d of %d holds %d "
            "samples, %d tokens",
            len(self.samples),
            total_tokens,
            n_layers,
            self.device,
            finished,
            self.ranks.rank,
            self.ranks.world,
            len(self.own),
            own_tokens,
        )
        self._check_host_memory(quantizer)
        t0 = time.perf_counter()
        if finished == 0:
            hs = self._embed()
            if self.ranks.main:
                self.state.write(0)
        elif finished < n_layers:
            hs = self._load_hidden()
        else:  # every layer is done: nothing to compute, and the last layer's outputs were not saved
            hs = []
        timings["embed"] += time.perf_counter() - t0
        progress.start(n_layers, len(self.own), own_tokens, finished)
        layer_seconds: list[tuple[int, str, float]] = []
        # Layer i's files (statistics or quantized tensors, report, hidden states, then the resume state) are
        # written while layer i + 1 computes; the state names layer i finished only once all of them are on disk.
        writer = BackgroundWriter(enabled=self.opts.background_writes)
        leaf_saved: list[Future[Any] | None] = []  # the writer's job for each own leaf's hidden-state file
        last_job: dict[int, Future[Any] | None] = {}  # each recent layer's last job

        def wait_for(job: Future[Any] | None) -> None:
            t0 = time.perf_counter()
            writer.wait(job)
            timings["save"] += time.perf_counter() - t0

        def wait_for_leaf(k: int) -> None:  # before the buffers of leaf k, which it may be reading, are overwritten
            if k < len(leaf_saved):
                wait_for(leaf_saved[k])

        def saving() -> bool:  # a resume point's hidden states are still being written
            return any(job is not None and not job.done() for job in leaf_saved)

        try:
            for i in range(finished, n_layers):
                t_layer = time.perf_counter()
                inputs = hs
                hs, files = self._layer(i, hs, quantizer, progress, timings, wait_for_leaf, saving)
                layer_seconds.append((i, cfg.mixer_types[i], time.perf_counter() - t_layer))
                t0 = time.perf_counter()
                writer.wait(last_job.pop(i - WRITE_LAG, None))  # and every job before it
                if hs is not inputs:  # the writer reads them until layer i - 1's jobs end
                    self._spare = (inputs, functools.partial(wait_for, last_job.get(i - 1)))
                del inputs
                leaf_saved[:], last_job[i] = self._submit_persist(writer, i, files, hs)
                if self.ranks.parallel and self._resume_point_after(i):
                    writer.drain()  # every process's hidden states on disk before rank 0 records the layer
                    t1 = time.perf_counter()
                    barrier(self.ranks)
                    timings["communicate"] += time.perf_counter() - t1
                    if self.ranks.main:
                        self.state.write(i + 1)
                timings["save"] += time.perf_counter() - t0
                progress.layer_done(
                    i, ", a resume point" if self.resume_every > 1 and self._resume_point_after(i) else ""
                )
            t0 = time.perf_counter()
            writer.drain()
            timings["save"] += time.perf_counter() - t0
        finally:
            progress.stop()
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
            writer.close()
        reports = []
        for i in range(n_layers):
            path = self.work_dir / "layers" / f"{i:03d}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else {})
        self.final_hidden = hs if finished < n_layers else None
        peaks = gather_object(self._peaks(), self.ranks)
        return EngineResult(
            self.work_dir,
            n_layers,
            reports,
            timings,
            total_tokens,
            layer_seconds,
            list(self.rank_tokens),
            peaks,
            torch.get_num_threads(),
        )

    def _peaks(self) -> dict[str, float | None]:
        """This process's peak GPU memory (allocated by torch on the run's device) and peak RSS so far, GiB."""
        gpu = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        rss = host_memory.process_memory("VmHWM")
        return {
            "gpu_gib": None if gpu is None else round(gpu, 2),
            "rss_gib": None if rss is None else round(rss / 2**30, 2),
        }

    def _layer(
        self,
        i: int,
        hs: list[torch.Tensor],
        quantizer: LayerQuantizer | None,
        progress,
        timings: dict[str, float],
        wait_for_leaf: Callable[[int], None],
        saving: Callable[[], bool],
    ) -> tuple[list[torch.Tensor], tuple[dict[str, torch.Tensor], dict[str, Any]] | None]:
        """Layer ``i`` over every sample: its outputs, and the files to write for it (written by the caller).

        The propagation pass with the quantized layer writes each sample's outputs over its inputs, chunk by chunk
        (a chunk's copy back is queued after its copy in), so the run holds one set of hidden states, not two;
        before each leaf ``wait_for_leaf`` lets the background writer finish with that leaf's buffers (the resume
        point it may be saving). Where memory allows a second set (``host_memory.second_set_fits``) and the
        writer is still ``saving`` them, it writes to the second set instead and waits for nothing. The float
        propagation (statistics and outputs in one pass) always writes to a second set."""
        cfg = self.config
        t0 = time.perf_counter()
        layer = self.parts.layer(i)
        if self.opts.attention_kernels:
            use_layer_kernels(layer)
        timings["load"] += time.perf_counter() - t0
        groups = input_groups(cfg, layer.kind)
        need_stats = quantizer is not None or self.opts.hessian

        t0 = time.perf_counter()
        collector = GroupCollector(layer, groups, self.device, self.opts) if need_stats else None
        keep_float = self.opts.propagate == "float" or quantizer is None
        progress.phase(i, layer.kind, "statistics")
        float_out = self._outputs(hs) if keep_float else None
        tree: TreeSum[LayerStats] = TreeSum(_merge_by_name)
        # the outputs are dropped when there is no float copy to keep: the layer's last product is then not needed
        with last_product_skipped(layer) if float_out is None else contextlib.nullcontext():
            chunks = self._pass_chunks(hs)
            for rows in self._leaf_rows:  # each leaf's sums apart, added in the fixed tree (calibration.shards)
                for j in rows:
                    self._run_sample(layer, hs[j], float_out[j] if float_out is not None else None, chunks)
                    if collector is not None:
                        collector.end_sample()
                    progress.sample_done(j, hs[j].shape[1])
                if collector is not None:
                    tree.push(collector.next_leaf())
            chunks.done()
        self._sync()
        stats: LayerStats = {}
        if collector is not None:
            collector.remove()
            t1 = time.perf_counter()
            stats = combine(tree.root(), self.ranks, _tensors_by_name, collector.empty, _merge_by_name)
            if self.ranks.parallel:
                timings["communicate"] += time.perf_counter() - t1
        timings["stats_forward"] += time.perf_counter() - t0

        result = LayerResult(layer=None)
        if quantizer is not None:
            t0 = time.perf_counter()
            progress.phase(i, layer.kind, "quantize")
            result = quantizer.quantize_layer(i, layer, stats)
            timings["quantize"] += time.perf_counter() - t0
        files: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        if quantizer is None and collector is not None:
            tensors = {
                f"{g}.{k}": v
                for g, st in stats.items()
                for k, v in st.to_tensors().items()
                if self.opts.save_hessians or not k.startswith("xtx")
            }
            files = (tensors, {"kind": layer.kind})

        qlayer = result.layer if result.layer is not None else layer
        if self.opts.attention_kernels and qlayer is not layer:
            use_layer_kernels(qlayer)
        current: dict[str, Observer] = {}  # the observers of the leaf being propagated
        hooks = [
            qlayer.get_submodule(name).register_forward_pre_hook(lambda _m, args, n=name: current[n].update(args[0]))
            for name in result.observe
        ]
        observed: TreeSum[dict[str, Observer]] = TreeSum(_merge_by_name)

        def propagate(through: DecoderLayer, observe: dict[str, Observer], out: list[torch.Tensor] | None) -> None:
            # the copy ahead may read leaf k while the writer still reads it; only the outputs, queued after
            # wait_for_leaf(k), write to it
            chunks = self._pass_chunks(hs)
            for k, rows in enumerate(self._leaf_rows):
                if out is hs:
                    wait_for_leaf(k)
                current.clear()
                current.update({name: obs.fresh() for name, obs in observe.items()})
                for j in rows:
                    self._run_sample(through, hs[j], out[j] if out is not None else None, chunks)
                    progress.sample_done(j, hs[j].shape[1])
                if hooks:
                    observed.push(dict(current))
            chunks.done()
            self._sync()

        try:
            if float_out is not None:
                out = float_out
                if hooks:  # the observers' own pass through the quantized layer
                    t0 = time.perf_counter()
                    progress.phase(i, layer.kind, "observe")
                    propagate(qlayer, result.observe, None)
                    timings["propagate"] += time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                progress.phase(i, layer.kind, "propagate")
                out = self._outputs(hs) if self._second_set and saving() else hs  # else in place
                propagate(qlayer, result.observe, out)
                timings["propagate"] += time.perf_counter() - t0
        finally:
            for handle in hooks:
                handle.remove()
        if quantizer is not None:
            if result.finish is not None:
                totals: dict[str, Observer] = {}
                if hooks:
                    t1 = time.perf_counter()
                    prototypes = result.observe
                    totals = combine(
                        observed.root(),
                        self.ranks,
                        _tensors_by_name,
                        lambda: {name: obs.fresh() for name, obs in prototypes.items()},
                        _merge_by_name,
                    )
                    if self.ranks.parallel:
                        timings["communicate"] += time.perf_counter() - t1
                result.finish(totals)
            tensors = {k: v.detach().cpu() for k, v in (result.tensors or {"_empty": torch.zeros(0)}).items()}
            files = (tensors, result.report)
        del layer, result, qlayer, stats
        log.info("layer %d (%s) done", i, cfg.mixer_types[i])
        return out, files

    def _submit_persist(
        self,
        writer: BackgroundWriter,
        i: int,
        files: tuple[dict[str, torch.Tensor], dict[str, Any]] | None,
        hs: list[torch.Tensor],
    ) -> tuple[list[Future[Any] | None], Future[Any] | None]:
        """Queue layer ``i``'s files; at a resume point (every ``resume_every`` layers, and the last) also the state
        that marks layers up to ``i`` finished, after the hidden states it resumes from, one job per leaf (none
        after the last layer: no layer is left to read them). Returns the leaves' jobs, which the next propagation
        waits for one at a time, and the last job queued. Layers after the last resume point are computed again by
        a resumed run (same bytes: the computation is deterministic). The digests of the tensors the layer read
        (and, with the first layer, of the non-layer tensors) go into the state too."""
        last = writer.submit(self._persist_layer_files, i, files)
        if not self._resume_point_after(i):
            return [], last
        saved: list[Future[Any] | None] = []
        if i + 1 < self.config.num_hidden_layers:
            (self.work_dir / "hidden").mkdir(exist_ok=True)
            saved = [
                writer.submit(self._save_hidden_leaf, v, rows, hs)
                for v, rows in zip(self.ranks.leaves(), self._leaf_rows, strict=True)
            ]
            last = saved[-1] if saved else last
        if not self.ranks.parallel:  # several processes: rank 0 records it once all have saved (run loop)
            last = writer.submit(self.state.write, i + 1)
        return saved, last

    def _persist_layer_files(self, i: int, files: tuple[dict[str, torch.Tensor], dict[str, Any]] | None) -> None:
        if self.ranks.main:
            for prefix in (*global_parameter_shapes(self.config), f"model.layers.{i}."):
                self.state.record_digests(prefix)
            if files is not None:
                _atomic_save(files[0], self.work_dir / "layers" / f"{i:03d}.safetensors")
                atomic_json(files[1], self.work_dir / "layers" / f"{i:03d}.json")

    def _resume_point_after(self, i: int) -> bool:
        return (i + 1) % self.resume_every == 0 or i + 1 == self.config.num_hidden_layers
