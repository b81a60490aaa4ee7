"""Block-scale search cost vs the calibration forward of the same layer, at the real 9.48B shapes.

For one minicpm4 and one lightning layer with random bf16 weights: (a) the calibration forward of the layer
over a token mix (chunks of 8192 with the KV cache / GLA state carried, input statistics collected) and
(b) NVFP4 quantization of all its linears with the 80-step block-scale search. Prints both and writes JSON.

  python benchmarks/studies/nvfp4_search.py --out OUT [--tokens 196608]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from salaquant.calibration.stats import GroupStats
from salaquant.formats.modelopt_nvfp4.numerics import global_scale, quantize_nvfp4
from salaquant.model.cache import LightningLayerCache, SparseLayerCache
from salaquant.model.config import LIGHTNING, SalaConfig
from salaquant.model.layout import input_groups, layer_linears
from salaquant.model.modeling import DecoderLayer, init_weights, layer_rope
from salaquant.model.tiny import preset_config
from salaquant.nvfp4.search import search_block_scales


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.no_grad()
def measure(cfg: SalaConfig, index: int, tokens: int, chunk: int, iters: int) -> dict[str, float]:
    layer = DecoderLayer(cfg, index).to("cuda", torch.bfloat16)
    init_weights(layer, 0.02)
    kind = layer.kind
    stats = {}
    handles = []
    for g in input_groups(cfg, kind):
        mod = layer.get_submodule(g.members[0])
        st = GroupStats(mod.in_features, device="cuda")
        stats[g.name] = st
        handles.append(mod.register_forward_pre_hook(lambda _m, a, st=st: st.update(a[0])))
    x = torch.randn(1, chunk, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)

    def forward() -> None:
        for start in range(0, tokens, 65536):  # samples of up to 64K tokens
            cache = LightningLayerCache() if kind == LIGHTNING else SparseLayerCache()
            for pos in range(start, min(tokens, start + 65536), chunk):
                layer(x, layer_rope(cfg, kind, pos - start, chunk, "cuda"), cache, "dense")
            for st in stats.values():
                st.end_sample()

    forward_s = timed(forward)
    for h in handles:
        h.remove()
    importance = {g.name: stats[g.name].mean_sq() for g in input_groups(cfg, kind)}
    group_of = {m: g.name for g in input_groups(cfg, kind) for m in g.members}

    def quantize() -> None:
        for spec in layer_linears(cfg, kind):
            w = layer.get_submodule(spec.name).weight.float()
            s2 = global_scale(w.abs().amax())
            found = search_block_scales(w, s2, importance[group_of[spec.name]], iters=iters)
            quantize_nvfp4(w, weight_scale_2=s2, block_scale=found.scales)

    quantize()  # warm-up
    search_s = timed(quantize)
    return {
        "calibration_forward_s": round(forward_s, 3),
        "nvfp4_search_s": round(search_s, 3),
        "search_over_forward": round(search_s / forward_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=196608)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=80)
    args = ap.parse_args()
    cfg = SalaConfig.from_dict(preset_config("full"))
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "iters": args.iters}
    for index in (0, 1):  # minicpm4, lightning
        res[cfg.mixer_types[index]] = measure(cfg, index, args.tokens, args.chunk, args.iters)
        print(cfg.mixer_types[index], res[cfg.mixer_types[index]], flush=True)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nvfp4_search.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
