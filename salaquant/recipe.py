"""YAML recipes: a whole quantization run as data (the schema is ``salaquant.settings``, also behind the flags).

A recipe is validated before any model work; errors name the file, the line and the key, and suggest the
closest valid key for a misspelt one. ``--set key.sub=value`` overrides any key (values parsed as YAML).
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .serving import LM_HEAD_REFUSAL
from .settings import SMOOTH_GROUPS, Recipe, ignored_settings

__all__ = ["Recipe", "RecipeError", "apply_overrides", "load_recipe", "recipe_from_dict", "shipped_recipes"]


class RecipeError(ValueError):
    """A recipe that cannot run; the message names file, line and key."""


# ----------------------------------------------------------------------------- loading with positions


def _node_at(node: yaml.Node | None, loc: tuple[Any, ...]) -> yaml.Node | None:
    """The YAML node at ``loc`` (mapping keys / sequence indices), or the deepest one found."""
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == part), None)
            if match is None:
                return node
            node = match[1] if part != loc[-1] else match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return node
    return node


def _model_at(loc: tuple[Any, ...]) -> Any:
    """The section model reached by ``loc`` from `Recipe` (None past a plain field)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        inner = getattr(field.annotation, "__args__", (field.annotation,))
        model = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    model = _model_at(loc)
    return list(model.model_fields) if model is not None else []


def _allowed(loc: tuple[Any, ...]) -> str | None:
    """The range a numeric key takes, from its field's bounds (e.g. ``a number in (0, 1]``)."""
    model = _model_at(loc[:-1]) if loc else None
    field = model.model_fields.get(loc[-1]) if model is not None else None
    if field is None:
        return None
    lo = hi = None
    for m in field.metadata:
        for attr, side in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            if getattr(m, attr, None) is not None:
                if attr in ("ge", "gt"):
                    lo = (side, getattr(m, attr))
                else:
                    hi = (side, getattr(m, attr))
    if lo and hi:
        return f"a number in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"a number {'>=' if lo[0] == '[' else '>'} {lo[1]}"
    if hi:
        return f"a number {'<=' if hi[0] == ']' else '<'} {hi[1]}"
    return None


def flag_name(key: str) -> str:
    """The ``gptq`` / ``nvfp4`` flag that sets recipe key ``key`` (``gptq.damp`` -> ``--damp``)."""
    special = {"calibration.sources": "--calib", "smoothing.alpha": "--smooth-alpha", "smoothing.enabled": "--smooth"}
    return special.get(key, "--" + key.rsplit(".", 1)[-1].replace("_", "-"))


def _describe(
    errors: list[dict[str, Any]],
    root: yaml.Node | None,
    where: str,
    overrides: dict[tuple[str, ...], str] | None = None,
) -> str:
    """One line per error: ``FILE:LINE: key: problem`` for a recipe file, ``--set KEY=VALUE: ...`` for an error in
    an override, ``--flag VALUE: expected ...`` for the command's flags (``where == "flags"``)."""
    lines = []
    for e in errors:
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        key = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        allowed = (
            _allowed(loc)
            if e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
            else None
        )
        if allowed is not None:
            msg = f"expected {allowed}"
        item = next((v for k, v in (overrides or {}).items() if loc[: len(k)] == k), None)
        if where == "flags" and e["type"] != "extra_forbidden":
            value = e.get("input")
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            lines.append(f"{flag_name(key.split('[')[0])} {shown}: {msg}")
            continue
        if item is not None:
            lines.append(f"--set {item}: {key}: {msg}")
            continue
        node = _node_at(root, loc) if loc else root
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), _fields_at(loc[:-1]), n=1)
            hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?)" if close else ""
            lines.append(f"{where}{line}: unknown key '{key}'{hint}")
        else:
            lines.append(f"{where}{line}: {key or 'recipe'}: {msg}")
    return "\n".join(lines)


def _consistency(recipe: Recipe) -> list[dict[str, Any]]:
    """Errors between sections (as pydantic reports errors, so they are described the same way)."""
    errors = []
    allowed = SMOOTH_GROUPS[recipe.method]
    for i, g in enumerate(recipe.smoothing.groups or []):
        if g not in allowed:
            errors.append(
                {
                    "loc": ("smoothing", "groups", i),
                    "type": "value_error",
                    "input": g,
                    "msg": f"{g!r} is not a {recipe.method} smoothing group {list(allowed)}",
                }
            )
    if recipe.gptq.quantize_lm_head:
        errors.append(
            {
                "loc": ("gptq", "quantize_lm_head"),
                "type": "value_error",
                "input": True,
                "msg": LM_HEAD_REFUSAL,
            }
        )
    fmt = recipe.export.checkpoint_format
    if fmt is not None and fmt != ("modelopt" if recipe.method == "nvfp4" else "gptq"):
        errors.append(
            {
                "loc": ("export", "checkpoint_format"),
                "type": "value_error",
                "input": fmt,
                "msg": f"{fmt!r} does not match method {recipe.method!r}",
            }
        )
    c = recipe.calibration
    if c.min_len > c.max_len:
        errors.append(
            {
                "loc": ("calibration", "min_len"),
                "type": "value_error",
                "input": c.min_len,
                "msg": f"above max_len ({c.max_len}): every sample would be dropped",
            }
        )
    for section, name in ignored_settings(recipe):
        if section == "eval":
            why = "without eval.data there is no eval gate to read it: set eval.data (held-out text) or remove it"
        else:
            why = f"method {recipe.method} does not read it, so it would change nothing: remove it"
        value = getattr(getattr(recipe, section), name)
        errors.append({"loc": (section, name), "type": "value_error", "input": value, "msg": why})
    return errors


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[tuple[str, ...], str]:
    """Apply ``["gptq.damp=0.05", "calibration.sources=[a.jsonl]"]`` to a recipe dict, in place; returns which
    key each override set (so that an error in its value blames the ``--set`` argument)."""
    applied: dict[tuple[str, ...], str] = {}
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. gptq.damp=0.05")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        target = data
        for p in parts[:-1]:
            if not isinstance(target.setdefault(p, {}), dict):
                raise RecipeError(f"--set {item!r}: {p} is not a section")
            target = target[p]
        target[parts[-1]] = _parse_value(value)
        applied[tuple(parts)] = item
    return applied


def shipped_recipes() -> dict[str, Path]:
    """The recipes shipped with salaquant, by name."""
    folder = resources.files("salaquant.recipes")
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith((".yaml", ".yml"))}


def resolve_recipe_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = shipped_recipes()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    close = difflib.get_close_matches(str(name_or_path), list(shipped), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f"; shipped recipes: {', '.join(sorted(shipped))}"
    raise RecipeError(f"recipe {str(name_or_path)!r}: no such file and no shipped recipe of that name{hint}")


def _recipe_text(path: Path) -> str:
    """The text of recipe file ``path``; `RecipeError` for a folder, an unreadable file or one that is not UTF-8
    text (a binary given by mistake), before YAML sees it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            f"{path}: not a recipe (not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from exc
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc.strerror or exc})") from exc


def load_recipe(name_or_path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; every problem is reported with file and line."""
    path = resolve_recipe_path(name_or_path)
    text = _recipe_text(path)
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections (method, calibration, ...)")
    duplicates = _duplicate_keys(root)
    if duplicates:
        raise RecipeError("\n".join(f"{path}:{line}" for line in duplicates))
    applied = apply_overrides(data, overrides or [])
    return recipe_from_dict(data, str(path), root, applied)


def _duplicate_keys(node: yaml.Node | None) -> list[str]:
    """``LINE: key 'a.b' given twice ...`` for every key a mapping repeats (YAML keeps the last one without a
    word). Each node is visited once, so aliases cannot make the walk grow."""
    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node | None, str]] = [(node, "")]
    while stack:
        current, where = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, yaml.MappingNode):
            first: dict[str, yaml.Node] = {}
            for key, value in current.value:
                name = f"{where}.{key.value}" if where else str(key.value)
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    if key.value in first:
                        line = first[key.value].start_mark.line + 1
                        found.append(
                            f"{key.start_mark.line + 1}: key '{name}' is given twice (first at line {line}); YAML "
                            "would keep the last one without a word: remove one"
                        )
                    first.setdefault(key.value, key)
                stack.append((value, name))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(current.value))
    return sorted(found, key=lambda text: int(text.split(":", 1)[0]))


def recipe_from_dict(
    data: dict[str, Any],
    where: str = "recipe",
    root: yaml.Node | None = None,
    overrides: dict[tuple[str, ...], str] | None = None,
) -> Recipe:
    """Validate a recipe dict; ``where`` names its origin in errors (a file, or ``"flags"`` for the command's
    flags, whose errors then name the flag)."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_describe(exc.errors(), root, where, overrides)) from exc
    errors = _consistency(recipe)
    if errors:
        raise RecipeError(_describe(errors, root, where, overrides))
    return recipe


def check_flags(sections: dict[str, dict[str, Any]]) -> None:
    """Validate the flags of a command that takes some of a recipe's sections without running a recipe
    (``calibrate``: ``{"calibration": {...}, "engine": {...}}``) as a recipe's are; errors name the flags."""
    recipe_from_dict({"method": "gptq", **sections}, "flags")


def key_line(recipe_path: str | Path, key: tuple[str | int, ...]) -> str:
    """``file:line`` of ``key`` (e.g. ``("quantization", "rules", 2)``) in a recipe, for errors found against the
    model's config once the recipe has been validated."""
    try:
        path = resolve_recipe_path(recipe_path)
        node = _node_at(yaml.compose(path.read_text()), key)
        return f"{path}:{node.start_mark.line + 1}" if node is not None else str(path)
    except (RecipeError, yaml.YAMLError, OSError):
        return str(recipe_path)
