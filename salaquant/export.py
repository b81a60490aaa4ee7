"""Write a quantized SALA checkpoint (source globals + the engine's per-layer tensors + configs and reports), check
it where it was written, and only then move it to the output."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .calibration.contract import EngineResult
from .formats.check import CheckError, CheckReport, check_checkpoint
from .io.files import SETTINGS_NAME
from .io.reader import CheckpointReader
from .io.staging import replace_folder
from .io.writer import CheckpointWriter
from .model.config import SalaConfig
from .model.layout import global_parameter_shapes
from .outputs import ExportRejected, failed_dir_for
from .serving import PLAIN_DTYPE, SGLANG_VERSION, serving_lines

CARD_NAME = "README.md"
LOG_NAME = "quantize.log"
GATE_NAME = "eval_gate.json"  # the eval gate's result, written by a gated recipe into the export it judged
# Every file an export holds beside its weights, config.json and the serving files copied from the source: the
# names `export_checkpoint` takes in ``extra_files`` (it refuses any other), its model card and log, the gate's
# result. `salaquant.ownership` reads this to know an export when ``--overwrite`` would replace it.
EXPORT_FILES = (
    SETTINGS_NAME,
    "quant_report.json",
    "quantize_config.json",
    "hf_quant_config.json",
    "recipe.yaml",
    CARD_NAME,
    LOG_NAME,
    GATE_NAME,
)


def model_card(quant_method: str, source_card: str) -> str:
    """The export's README: how to serve it and on which GPUs, then the source model's card (its YAML front
    matter, which model hubs read, stays first). Nothing in it depends on where the export is written, so the
    same settings give the same bytes."""
    front = ""
    if source_card.startswith("---\n") and "\n---\n" in source_card[4:]:
        end = source_card.index("\n---\n", 4) + 5
        front, source_card = source_card[:end], source_card[end:]
    lines = [
        f"# MiniCPM-SALA, {quant_method} (salaquant)",
        "",
        f"A `{quant_method}` quantization of a MiniCPM-SALA checkpoint, written by salaquant "
        f"for SGLang {SGLANG_VERSION}; lm_head and embeddings are bf16.",
        "",
        *[f"- {line}" for line in serving_lines("THIS_FOLDER", quant_method)],
        "",
    ]
    if source_card.strip():
        lines += ["## The source model", "", source_card.strip(), ""]
    return front + "\n".join(lines)


@contextlib.contextmanager
def export_checkpoint(
    source: Path,
    output: Path,
    result: EngineResult,
    qconfig: dict[str, Any],
    extra_files: dict[str, Any],
    *,
    max_shard_bytes: int = 4 * 10**9,
    overwrite: bool = False,
) -> Iterator[Path]:
    """Write the export complete into a staging folder beside ``output`` and give that folder to the ``with``
    block, which checks it there (`check_export`, a recipe's gate); leaving the block moves it to ``output``.

    So nothing that fails a check ever stands at ``output``: an `ExportRejected` from the block moves the export
    to ``OUTPUT.<check>-failed`` (replacing an older one; the message says where), any other exception removes it.

    The export holds embeddings, final norm and lm_head from the source; every decoder layer from the engine's
    work folder; every unquantized tensor in `PLAIN_DTYPE` (whatever the source's dtype), ``config.json`` with
    every architecture key stated (so an engine's defaults cannot differ from the values the model was quantized
    with), that dtype as ``torch_dtype`` and ``quantization_config``; tokenizer and remote-code files; the model
    card with how to serve the export; ``extra_files`` (format configs, reports, resolved settings) as JSON, or as
    text when given a string."""
    writer = CheckpointWriter(output, max_shard_bytes=max_shard_bytes, overwrite=overwrite, place=False)
    with writer:
        _write_export(writer, source, result, qconfig, extra_files)
    try:
        yield writer.staged
    except ExportRejected as exc:
        failed = failed_dir_for(output, exc.check)
        replace_folder(writer.staged, failed)
        exc.kept_at(failed, output)
        raise
    except BaseException:
        writer.discard()
        raise
    writer.move_into_place()


def _write_export(
    writer: CheckpointWriter, source: Path, result: EngineResult, qconfig: dict[str, Any], extra_files: dict[str, Any]
) -> None:
    reader = CheckpointReader(source)
    config = SalaConfig.from_dict(reader.config())
    shapes = global_parameter_shapes(config)

    def plain(name: str) -> torch.Tensor:
        return reader.get_checked(name, shapes[name], dtype=PLAIN_DTYPE)

    writer.add("model.embed_tokens.weight", plain("model.embed_tokens.weight"))
    for i in range(config.num_hidden_layers):
        for name, tensor in result.layer_tensors(i).items():
            writer.add(f"model.layers.{i}.{name}", tensor)
    writer.add("model.norm.weight", plain("model.norm.weight"))
    if "lm_head.weight" in shapes:
        writer.add("lm_head.weight", plain("lm_head.weight"))
    raw = config.to_dict()
    raw["quantization_config"] = qconfig
    raw["torch_dtype"] = str(PLAIN_DTYPE).removeprefix("torch.")
    writer.write_json("config.json", raw)
    for name, obj in extra_files.items():
        if isinstance(obj, str):
            writer.write_text(name, obj)
        else:
            writer.write_json(name, obj)
    writer.copy_aux(source)
    card = writer.tmp_dir / CARD_NAME
    source_card = card.read_text(encoding="utf-8") if card.is_file() else ""
    writer.write_text(CARD_NAME, model_card(qconfig["quant_method"], source_card))
    log = result.work_dir / "log.txt"
    if log.exists():
        writer.write_text(LOG_NAME, log.read_text())


def check_export(staged: Path, output: Path, tp: int = 1) -> CheckReport:
    """The format check (`check_checkpoint`) of a complete export still in its staging folder, its serving lines
    naming ``output``, where the export goes; a failure is an `ExportRejected` listing every problem."""
    try:
        return check_checkpoint(staged, tp=tp, served_as=output)
    except CheckError as exc:
        problems = "\n".join(f"  - {e}" for e in exc.errors)
        head = f"the export fails the format check ({len(exc.errors)} problem(s))"
        raise ExportRejected(f"{head}:\n{problems}", "check") from exc
