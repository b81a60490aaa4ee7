"""GPU smoke test of the model definition: a tiny random checkpoint on CUDA, every attention mode,
cached decode == full forward, and transformers AutoModelForCausalLM + generate().

  python benchmarks/gpu_smoke.py --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from salaquant.model.loading import load_model
from salaquant.model.tiny import preset_config, write_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = "cuda"
    ckpt = write_random_checkpoint(Path("/tmp/gpu-smoke-tiny"), preset_config("tiny"), seed=1, std=0.05, overwrite=True)
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    torch.manual_seed(0)
    ids = torch.randint(0, 264, (2, 600), device=dev)
    m32 = load_model(ckpt, device=dev, dtype="fp32")
    c32 = load_model(ckpt, device="cpu", dtype="fp32")
    with torch.no_grad():
        for mode in ("dense", "sparse"):
            g = m32(ids, attention_mode=mode).logits
            c = c32(ids.cpu(), attention_mode=mode).logits
            res[f"gpu_vs_cpu_fp32_maxdiff_{mode}"] = float((g.cpu() - c).abs().max())
            cache = m32.new_cache()
            parts = [m32(ids[:, :500], cache=cache, attention_mode=mode).logits]
            for t in range(500, 600):
                parts.append(m32(ids[:, t : t + 1], cache=cache, attention_mode=mode).logits)
            res[f"decode_vs_full_maxdiff_{mode}"] = float((torch.cat(parts, 1) - g).abs().max())
        m16 = load_model(ckpt, device=dev)
        b = m16(ids, attention_mode="auto").logits
        res["bf16_vs_fp32_rel"] = float((b - m32(ids).logits).abs().max() / m32(ids).logits.abs().max())

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import salaquant.model.hf  # noqa: F401

    res["transformers"] = transformers.__version__
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(dev)
    tok = AutoTokenizer.from_pretrained(ckpt)
    enc = tok("The quick brown fox", return_tensors="pt").to(dev)
    with torch.no_grad():
        gen = hf.generate(**enc, max_new_tokens=16, do_sample=False)
        ours = m32.greedy(enc.input_ids, 16)
    res["hf_generate_equals_greedy"] = bool(torch.equal(gen, ours))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_smoke.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
