"""A corpus of 100+ JSON schemas for the grammar tests, written for this project.

Hand-written schemas cover one feature each (nested objects, arrays with min/max items, enums,
const, patterns, string formats, numeric bounds, required vs optional, `$ref`/`$defs`,
`anyOf`/`oneOf`, `additionalProperties: false`, `allOf` extension), and a seeded generator
combines the same features into larger random objects. `CORPUS` is a list of (name, schema).
"""

from __future__ import annotations

import random
from typing import Any

S: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer"}
N: dict[str, Any] = {"type": "number"}
B: dict[str, Any] = {"type": "boolean"}


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    schema = {"type": "object", "properties": props, **extra}
    if required is not None:
        schema["required"] = required
    return schema


def arr(items: dict[str, Any], **extra: Any) -> dict:
    return {"type": "array", "items": items, **extra}


_POINT = obj({"x": N, "y": N}, ["x", "y"], additionalProperties=False)
_ADDRESS = obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
               ["street", "city"])

HAND_WRITTEN: list[tuple[str, dict[str, Any]]] = [
    ("string", S), ("integer", INT), ("number", N), ("boolean", B), ("null", {"type": "null"}),
    ("any_object", {"type": "object"}), ("any_array", {"type": "array"}),
    ("nullable_string", {"type": ["string", "null"]}),
    ("flat_required", obj({"name": S, "age": INT}, ["name", "age"])),
    ("flat_optional", obj({"name": S, "age": INT, "email": S}, ["name"])),
    ("all_optional", obj({"a": S, "b": INT, "c": B})),
    ("closed", obj({"id": INT, "label": S}, ["id"], additionalProperties=False)),
    ("nested_2", obj({"user": obj({"name": S, "active": B}, ["name", "active"])}, ["user"])),
    ("nested_3", obj({"a": obj({"b": obj({"c": INT}, ["c"])}, ["b"])}, ["a"])),
    ("nested_optional", obj({"meta": obj({"source": S, "version": INT})})),
    ("address", obj({"home": _ADDRESS, "work": _ADDRESS}, ["home"])),
    ("array_strings", arr(S)),
    ("array_ints_min", arr(INT, minItems=2)),
    ("array_ints_max", arr(INT, maxItems=3)),
    ("array_min_max", arr(S, minItems=1, maxItems=4)),
    ("array_exact", arr(B, minItems=3, maxItems=3)),
    ("array_of_objects", arr(obj({"k": S, "v": INT}, ["k", "v"]), maxItems=3)),
    ("array_of_arrays", arr(arr(INT, maxItems=3), maxItems=3)),
    ("object_with_array", obj({"tags": arr(S, maxItems=5), "n": INT}, ["tags", "n"])),
    ("tuple", {"type": "array", "prefixItems": [S, INT, B], "minItems": 3}),
    ("enum_strings", {"enum": ["red", "green", "blue"]}),
    ("enum_mixed", {"enum": ["a", 1, True, None, 2.5]}),
    ("enum_in_object", obj({"color": {"enum": ["red", "green"]}, "size": {
        "type": "string", "enum": ["S", "M", "L", "XL"]}}, ["color", "size"])),
    ("enum_ints", obj({"level": {"type": "integer", "enum": [1, 2, 3, 5, 8]}}, ["level"])),
    ("const_string", {"const": "fixed"}),
    ("const_object", {"const": {"a": [1, 2], "b": None}}),
    ("const_in_object", obj({"version": {"const": 2}, "kind": {"const": "event"}, "body": S},
                            ["version", "kind", "body"])),
    ("pattern_digits", {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}),
    ("pattern_word", {"type": "string", "pattern": "^[a-z]+(_[a-z]+)*$"}),
    ("pattern_hex", obj({"color": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}},
                        ["color"])),
    ("pattern_code", obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
                          "note": S}, ["code"])),
    ("pattern_alt", {"type": "string", "pattern": "^(yes|no|maybe)$"}),
    ("format_date", {"type": "string", "format": "date"}),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_time", {"type": "string", "format": "time"}),
    ("format_email", {"type": "string", "format": "email"}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("format_uri", {"type": "string", "format": "uri"}),
    ("format_ipv4", {"type": "string", "format": "ipv4"}),
    ("format_ipv6", {"type": "string", "format": "ipv6"}),
    ("format_hostname", {"type": "string", "format": "hostname"}),
    ("formats_in_object", obj({"id": {"type": "string", "format": "uuid"},
                               "at": {"type": "string", "format": "date-time"},
                               "contact": {"type": "string", "format": "email"}},
                              ["id", "at"])),
    ("string_lengths", obj({"short": {"type": "string", "maxLength": 5},
                            "long": {"type": "string", "minLength": 3, "maxLength": 20}},
                           ["short", "long"])),
    ("int_range", {"type": "integer", "minimum": 1, "maximum": 100}),
    ("int_negative", {"type": "integer", "minimum": -50, "maximum": -10}),
    ("int_exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("number_range", {"type": "number", "minimum": 0.5, "maximum": 99.5}),
    ("int_multiple", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("bounded_fields", obj({"age": {"type": "integer", "minimum": 0, "maximum": 150},
                            "score": {"type": "number", "minimum": 0, "maximum": 1}},
                           ["age", "score"])),
    ("min_max_properties", {"type": "object", "additionalProperties": INT, "minProperties": 1,
                            "maxProperties": 3}),
    ("additional_schema", obj({"name": S}, ["name"], additionalProperties=INT)),
    ("additional_true", obj({"name": S}, ["name"], additionalProperties=True)),
    ("pattern_properties", {"type": "object", "patternProperties": {"^x_[a-z]+$": INT},
                            "additionalProperties": False}),
    ("ref_defs", {"$defs": {"point": _POINT}, "type": "object",
                  "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                  "required": ["a", "b"]}),
    ("ref_definitions", {"definitions": {"tag": {"type": "string", "enum": ["x", "y"]}},
                         "type": "array", "items": {"$ref": "#/definitions/tag"},
                         "maxItems": 4}),
    ("ref_root_def", {"$defs": {"item": obj({"sku": S, "qty": INT}, ["sku", "qty"])},
                      "$ref": "#/$defs/item"}),
    ("ref_nested_defs", {"$defs": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                   "person": obj({"first": {"$ref": "#/$defs/name"},
                                                  "last": {"$ref": "#/$defs/name"}},
                                                 ["first", "last"])},
                         "type": "object", "properties": {"people": arr(
                             {"$ref": "#/$defs/person"}, minItems=1, maxItems=2)},
                         "required": ["people"]}),
    ("recursive_tree", {"$defs": {"node": obj({"value": INT, "children": arr(
        {"$ref": "#/$defs/node"}, maxItems=2)}, ["value"])}, "$ref": "#/$defs/node"}),
    ("anyof_scalars", {"anyOf": [S, INT, {"type": "null"}]}),
    ("anyof_objects", {"anyOf": [obj({"cat": S}, ["cat"]), obj({"dog": INT}, ["dog"])]}),
    ("anyof_in_field", obj({"id": {"anyOf": [INT, {"type": "string", "pattern": "^id[0-9]+$"}]}},
                           ["id"])),
    ("oneof_types", {"oneOf": [S, B, {"type": "null"}]}),
    ("oneof_discriminator", {"oneOf": [
        obj({"kind": {"const": "circle"}, "r": N}, ["kind", "r"]),
        obj({"kind": {"const": "square"}, "side": N}, ["kind", "side"])]}),
    ("oneof_required", {"oneOf": [obj({"email": S}, ["email"], additionalProperties=False),
                                  obj({"phone": S}, ["phone"], additionalProperties=False)]}),
    ("oneof_refs", {"$defs": {"a": obj({"t": {"const": "a"}, "x": INT}, ["t", "x"]),
                              "b": obj({"t": {"const": "b"}, "y": S}, ["t", "y"])},
                    "type": "array", "items": {"oneOf": [{"$ref": "#/$defs/a"},
                                                         {"$ref": "#/$defs/b"}]},
                    "maxItems": 3}),
    ("allof_extend", {"$defs": {"base": obj({"id": INT}, ["id"])},
                      "allOf": [{"$ref": "#/$defs/base"}, obj({"name": S}, ["name"])]}),
    ("allof_bounds", {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 9}]}),
    ("closed_nested", obj({"inner": obj({"a": INT, "b": S}, ["a"], additionalProperties=False)},
                          ["inner"], additionalProperties=False)),
    ("empty_object", obj({}, additionalProperties=False)),
    ("unicode_keys", obj({"naïve": S, "日本": INT, "emoji 😀": B}, ["naïve", "日本"])),
    ("escaped_keys", obj({'quote"key': S, "back\\slash": INT, "new\nline": B},
                         ['quote"key'])),
    ("unicode_enum", {"enum": ["café", "naïve", "日本語", "a\"b", "tab\tch"]}),
    ("boolean_flags", obj({f"flag_{i}": B for i in range(8)}, [f"flag_{i}" for i in range(8)])),
    ("many_optional", obj({f"f{i}": S for i in range(10)})),
    ("tool_call", obj({"name": {"const": "get_weather"}, "arguments": obj(
        {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])},
        ["name", "arguments"])),
    ("annotations", {"title": "Thing", "description": "A thing", "type": "object",
                     "properties": {"x": {"type": "integer", "description": "x", "default": 1,
                                          "examples": [1, 2]}}, "required": ["x"]}),
    ("uniqueitems_single", arr(INT, maxItems=1, uniqueItems=True)),
    ("mixed_array", arr({"type": ["integer", "string", "boolean"]}, maxItems=5)),
    ("matrix", arr(arr(N, minItems=2, maxItems=2), minItems=2, maxItems=2)),
    ("geo", obj({"type": {"const": "Point"}, "coordinates": arr(N, minItems=2, maxItems=2)},
                ["type", "coordinates"])),
    ("event_log", obj({"events": arr(obj({"ts": {"type": "string", "format": "date-time"},
                                          "level": {"enum": ["info", "warn", "error"]},
                                          "msg": S}, ["ts", "level", "msg"]), maxItems=2)},
                      ["events"])),
]

_LEAVES: list[dict[str, Any]] = [
    S, INT, N, B, {"type": "null"}, {"enum": ["alpha", "beta", "gamma"]}, {"const": 7},
    {"type": "string", "pattern": "^[a-z]{2,6}$"}, {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"}, {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "number", "minimum": -1, "maximum": 1}, {"type": "string", "maxLength": 8},
    {"type": ["integer", "null"]}, {"anyOf": [S, INT]},
]


def _random_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth >= 3 or roll < 0.45:
        return rng.choice(_LEAVES)
    if roll < 0.75:
        names = rng.sample(["id", "name", "kind", "value", "items", "meta", "when", "count",
                            "tags", "ok"], rng.randint(1, 4))
        props = {name: _random_schema(rng, depth + 1) for name in names}
        required = [n for n in names if rng.random() < 0.6]
        extra = {"additionalProperties": False} if rng.random() < 0.3 else {}
        return obj(props, required, **extra)
    lo = rng.randint(0, 2)
    return arr(_random_schema(rng, depth + 1), minItems=lo, maxItems=lo + rng.randint(0, 3))


def generated(count: int, seed: int = 1234) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        schema = _random_schema(rng, 0)
        if schema.get("type") != "object":
            schema = obj({"root": schema}, ["root"])
        out.append((f"generated_{i:02d}", schema))
    return out


CORPUS: list[tuple[str, dict[str, Any]]] = HAND_WRITTEN + generated(120 - len(HAND_WRITTEN))
