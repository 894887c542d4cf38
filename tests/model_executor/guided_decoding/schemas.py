"""Twenty JSON schemas for structured-output tests: nested objects, arrays, enums, bounded numbers, required fields.

Strings and arrays are bounded so that a small model finishes each object within a modest token budget.
"""

from __future__ import annotations

_NAME = {"type": "string", "maxLength": 12}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    }),
    ("a color choice", {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
    }),
    ("a point in 2D", {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                       "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"],
    }),
    ("a book", {
        "type": "object",
        "properties": {"title": _NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
                       "author": {"type": "object", "properties": {"first": _NAME, "last": _NAME},
                                  "required": ["first", "last"]}},
        "required": ["title", "year", "author"],
    }),
    ("a list of small numbers", {
        "type": "object",
        "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "minItems": 1, "maxItems": 4}},
        "required": ["numbers"],
    }),
    ("a yes/no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("a product", {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                       "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                       "in_stock": {"type": "boolean"}},
        "required": ["sku", "price", "in_stock"],
    }),
    ("a weekday", {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("a pair of tags", {"type": "array", "items": {"type": "string", "enum": ["news", "sport", "tech", "art"]},
                        "minItems": 2, "maxItems": 2}),
    ("a city with coordinates", {
        "type": "object",
        "properties": {"city": _NAME,
                       "location": {"type": "object",
                                    "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                   "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                                    "required": ["lat", "lon"]}},
        "required": ["city", "location"],
    }),
    ("a team of up to three people", {
        "type": "object",
        "properties": {"team": _NAME,
                       "members": {"type": "array", "maxItems": 3,
                                   "items": {"type": "object", "properties": {"name": _NAME,
                                                                             "role": {"enum": ["dev", "ops", "pm"]}},
                                             "required": ["name", "role"]}}},
        "required": ["team", "members"],
    }),
    ("an HTTP response", {
        "type": "object",
        "properties": {"status": {"type": "integer", "enum": [200, 404, 500]}, "ok": {"type": "boolean"}},
        "required": ["status", "ok"],
    }),
    ("a temperature reading", {
        "type": "object",
        "properties": {"value": {"type": "number", "minimum": -50, "maximum": 60},
                       "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["value", "unit"],
    }),
    ("an optional nickname", {
        "type": "object",
        "properties": {"name": _NAME, "nickname": {"anyOf": [_NAME, {"type": "null"}]}},
        "required": ["name", "nickname"],
    }),
    ("a matrix of two rows", {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    }),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]}),
    ("an inventory", {
        "type": "object",
        "properties": {"apples": {"type": "integer", "minimum": 0, "maximum": 99},
                       "pears": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["apples", "pears"],
    }),
    ("a settings object", {
        "type": "object",
        "properties": {"theme": {"enum": ["dark", "light"]}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
                       "beta": {"type": "boolean"}},
        "required": ["theme", "font_size", "beta"],
    }),
    ("an email contact", {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                       "priority": {"enum": ["low", "high"]}},
        "required": ["email", "priority"],
    }),
]
