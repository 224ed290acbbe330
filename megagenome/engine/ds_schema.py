"""The DeepSpeed JSON sections that DeepSpeed validates with pydantic, checked without deepspeed (layer L2).

zero_optimization (with its offload blocks), bf16 and fp16 are checked against ds_sections.json: every key (name
or alias), type, nullability and numeric bound as the pydantic models of DeepSpeed 0.19.8 declare them, read lax
as pydantic reads them ("true" is a boolean, 2.0 an integer; "auto" keeps DeepSpeed's default). engine/engine.py
`section_schema` writes the file from the installed DeepSpeed's models; after a DeepSpeed upgrade regenerate it
with `python -c "from megagenome.engine import engine; engine.write_section_schema()"`.

What the copy cannot hold are the models' cross-field validators (e.g. partial optimizer offload only at ZeRO-3,
compute_grad_norm false only at stages 1-2). So `pretrain --dry_run` and `megagenome plan` check against the copy,
and a real launch, whose ranks import deepspeed anyway, checks with DeepSpeed's own models (engine.py
`section_problems`). tests/test_ds_config.py compares the copy with the installed models and checks, on sample
values, that the copy refuses whatever DeepSpeed refuses field by field and accepts whatever DeepSpeed accepts.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os

SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_sections.json")


def unknown_key_problems(key: str, allowed, where: str, path: str) -> list[str]:
    """[] when `key` is allowed, else the message naming it (with the closest allowed key, if any)."""
    if key in allowed:
        return []
    near = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f" (did you mean {(where + near[0])!r}?)" if near else ""
    return [f"{path}: unknown DeepSpeed key {(where + key)!r}{hint}"]


@functools.lru_cache(maxsize=1)
def section_schema() -> dict:
    """ds_sections.json: for each checked section, its fields as DeepSpeed 0.19.8 declares them."""
    with open(SCHEMA_FILE, encoding="utf-8") as fh:
        return json.load(fh)


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _number(value, integer: bool = False) -> float | None:
    """value as a number the way pydantic's lax mode reads it (booleans, ints, floats, numeric strings; for an
    integer field only strings that spell an integer), else None."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(int(value.strip()) if integer else float(value.strip()))
        except ValueError:
            return None
    return None


def _type_problem(spec: dict, value) -> str | None:
    """Why `value` does not fit the field `spec` (ds_sections.json), or None. Lax like pydantic: "true" is a
    boolean, 2.0 an integer."""
    kind = spec["type"]
    if value is None:
        return None if spec.get("nullable") else "must not be null"
    if isinstance(kind, list):  # a union: any member type will do
        problems = [_type_problem({**spec, "type": k}, value) for k in kind]
        return None if None in problems else f"must be one of the types {', '.join(kind)}"
    if kind == "enum":
        allowed = spec["values"]
        number = _number(value, integer=True) if all(isinstance(v, int) for v in allowed) else None
        ok = value in allowed or (number is not None and number in allowed)
        return None if ok else f"{value!r} is not one of {', '.join(map(repr, allowed))}"
    if kind == "boolean":
        ok = isinstance(value, bool) or value in (0, 1) or (isinstance(value, str) and value.lower() in _TRUE | _FALSE)
        return None if ok else f"{value!r} is not a boolean (true or false)"
    if kind in ("integer", "number"):
        number = _number(value, integer=kind == "integer")
        if number is None or math.isnan(number) or (kind == "integer" and not number.is_integer()):
            return f"{value!r} is not {'an integer' if kind == 'integer' else 'a number'}"
        return _bound_problem(spec, number)
    if kind == "string":
        return None if isinstance(value, str) else f"{value!r} is not a string"
    if kind == "array":
        if not isinstance(value, list):
            return f"{value!r} is not a list"
        return next((p for p in (_type_problem(spec["items"], v) for v in value) if p), None)
    return None  # "any"


def _bound_problem(spec: dict, number: float) -> str | None:
    for key, ok, words in [
        ("minimum", lambda b: number >= b, "at least"),
        ("exclusive_minimum", lambda b: number > b, "greater than"),
        ("maximum", lambda b: number <= b, "at most"),
        ("exclusive_maximum", lambda b: number < b, "less than"),
    ]:
        if key in spec and not ok(spec[key]):
            return f"{number:g} must be {words} {spec[key]:g}"
    return None


def section_problems(fields: dict, value, where: str, path: str) -> list[str]:
    """Every problem of one section (or nested block) `value` against its schema `fields`."""
    if not isinstance(value, dict):
        return [f"{path}: {where!r} must be an object"]
    problems = []
    given: dict[str, str] = {}  # field name -> the key (name or alias) that set it
    for key, item in value.items():
        dotted = f"{where}.{key}"
        spec = fields.get(key)
        field = spec.get("alias_of", key) if spec else key
        if spec is not None and field in given:
            problems.append(f"{path}: {dotted}: set twice, as {given[field]!r} and as {key!r} (one field, two names)")
            continue
        given[field] = key
        if spec is None:
            problems += unknown_key_problems(key, fields, f"{where}.", path)
        elif item == "auto":  # DeepSpeed drops "auto" values and keeps its default (config_utils.py)
            continue
        elif spec["type"] == "object":
            if item is not None or not spec.get("nullable"):
                problems += section_problems(spec["fields"], item, dotted, path)
        else:
            why = _type_problem(spec, item)
            if why:
                problems.append(f"{path}: {dotted}: {why}")
    return problems
