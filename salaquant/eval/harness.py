"""An lm-evaluation-harness model backend on the runtime: ``--model salaquant --model_args pretrained=EXPORT,...``.

Importing this module registers ``salaquant`` in lm-eval's model registry; the ``salaquant-lm-eval`` command
(``eval.lm_eval_command``, which names the extra when lm-eval is missing) runs `main`: lm-eval's own command line
with it registered (``lm-eval`` is the optional extra ``salaquant[lm-eval]``).
The three request types run on the model ``salaquant.runtime.load`` builds (bf16, GPTQ or NVFP4, on the same
kernels as ``salaquant eval``):

* ``loglikelihood``: each context + continuation (at most ``max_length`` tokens, cut from the left) in one forward,
  right-padded batches of ``batch_size`` sorted by length (causal layers never see the padding); logits only at
  the continuation's positions, log-softmax in fp32; greedy when every continuation token is the argmax;
* ``loglikelihood_rolling``: lm-eval's rolling windows of ``max_length`` tokens (each token predicted once, the
  first from ``prefix_token_id``), each window scored as a loglikelihood request, summed per document;
* ``generate_until``: requests with the same generation settings decoded together by the runtime's ``Decoder``
  (static cache, CUDA graphs on a GPU), greedy unless ``do_sample`` / ``temperature`` ask otherwise, up to
  ``max_gen_toks`` tokens or EOS, the text cut at the first of ``until``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..devices import resolve_device
from ..io.reader import CheckpointReader
from ..model.kv_cache_dtype import use_kv_cache_dtype
from ..model.modeling import lm_logits
from ..model.sampling import Sampling
from ..runtime.decode import Decoder
from ..runtime.load import checkpoint_format, load, resolve_activations
from ..workflow import load_tokenizer

__all__ = ["SalaquantLM"]

DEFAULT_MAX_GEN_TOKS = 256


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


@register_model("salaquant")
class SalaquantLM(TemplateLM):
    """``pretrained``: a bf16, GPTQ or NVFP4 checkpoint folder (its tokenizer, else ``tokenizer``'s folder);
    ``device`` (``auto``: CUDA if present), ``dtype``, ``backend`` (quantized linears: ``auto|triton|reference``),
    ``activations`` (``auto``: W4A4 for NVFP4 exports, as ``salaquant eval``), ``kv_cache`` (``bf16|fp8_e5m2|
    fp8_e4m3``), ``attention`` (``auto|dense|sparse``), ``batch_size``, ``max_length`` (default: the config's
    ``max_position_embeddings``), ``max_gen_toks``, ``compile`` (the Decoder's compiled step)."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        device: str = "auto",
        dtype: str = "bf16",
        backend: str = "auto",
        activations: str = "auto",
        kv_cache: str = "bf16",
        attention: str = "auto",
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        path = Path(pretrained)
        with CheckpointReader(path) as reader:
            fmt = checkpoint_format(reader)
        self._device = resolve_device(str(device))
        self.model = load(
            path, device=self._device, dtype=dtype, backend=backend, activations=resolve_activations(activations, fmt)
        )
        use_kv_cache_dtype(self.model, kv_cache)
        self.attention = attention
        self.tokenizer = load_tokenizer(Path(tokenizer) if tokenizer else path)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 1
        self._max_length = int(max_length) if max_length else int(self.model.config.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self.decoder = Decoder(self.model, compile=_flag(compile), attention_mode=attention)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> SalaquantLM:
        """``--model_args`` first; lm-eval's own ``--device`` / ``--batch_size`` fill in what they leave out."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> SalaquantLM:
        """Unknown ``--model_args`` keys fail naming the key; lm-eval's other settings (``max_batch_size`` ...)
        that this backend does not take are left out."""
        known = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(arg_dict) - known)
        if unknown:
            raise ValueError(
                f"--model_args: unknown key(s) {', '.join(unknown)}; salaquant takes {', '.join(sorted(known))}"
            )
        extra = {
            k: v for k, v in (additional_config or {}).items() if v is not None and k in known and k not in arg_dict
        }
        return cls(**arg_dict, **extra)

    # -- tokens ---------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else self.model.config.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    # -- scoring --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), all greedy)`` of token pairs, in their order."""
        inputs = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("a loglikelihood request needs at least one continuation token")
            whole = (context + continuation)[-(self.max_length + 1) :]
            inputs.append((whole[:-1], whole[-len(continuation) :]))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(inputs)
        for start in range(0, len(order), self.batch_size):
            members = order[start : start + self.batch_size]
            width = len(inputs[members[0]][0])
            ids = torch.full((len(members), width), self.eot_token_id, dtype=torch.long)
            for row, i in enumerate(members):
                ids[row, : len(inputs[i][0])] = torch.tensor(inputs[i][0])
            hidden = self.model.model(ids.to(self._device), attention_mode=self.attention)
            for row, i in enumerate(members):
                n, target = len(inputs[i][0]), torch.tensor(inputs[i][1], device=self._device)
                at = hidden[row, n - len(target) : n]
                logp = F.log_softmax(lm_logits(self.model.config, self.model.lm_head, at).float(), dim=-1)
                total = float(logp.gather(-1, target[:, None]).sum())
                out[i] = (total, bool((logp.argmax(-1) == target).all()))
        return out

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self._score([(context, continuation) for _, context, continuation in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(score for score, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # -- generation -----------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out = [""] * len(requests)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if _flag(kwargs.get("do_sample", False)) else 0.0
            sampling = Sampling(temperature, int(kwargs.get("top_k", 0) or 0), float(kwargs.get("top_p", 1.0)))
            prompts = []
            for i in members:
                ids = self.tok_encode(requests[i].args[0]) or [self.prefix_token_id]
                prompts.append(torch.tensor(ids[-max(1, self.max_length - max_new) :], dtype=torch.long))
            tokens = self.decoder.generate_in_batches(
                prompts, max_new, sampling, batch_size=self.batch_size, eos_token_id=self.eot_token_id
            )
            for i, new in zip(members, tokens, strict=True):
                text = self.tok_decode(new.tolist())
                for stop in until:
                    if stop and stop in text:
                        text = text[: text.index(stop)]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def main() -> None:
    """lm-eval's command line with the ``salaquant`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
