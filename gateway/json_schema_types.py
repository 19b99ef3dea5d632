"""What a tool's parameters JSON schema says about each parameter's type: one reading, shared by the XML tool-call
grammar (gateway.grammar's `_XmlCall`) and the parser that types the XML form's values (gateway.output_parser), so
that the text the grammar lets a model write is read back as the type the grammar meant.

In the XML form (Qwen3-Coder, Qwen3.5) a parameter's value is bare text: `<parameter=K>\\nVALUE\\n</parameter>`.
Whether `42` is the number or the text depends on the schema, and the grammar and the parser must agree: the grammar
lets a parameter that admits strings be any text, the parser then must keep that text a string, not read `42` or
`true` out of it. Both ask `ParamSchemas`:

* `shape()`: the parameters (the root's `properties` and those of its `allOf` members, the root followed through a
  local `$ref`), the required names, and the schema of parameters the root does not declare;
* `kinds(schema)`: the JSON types a (sub)schema admits, through `type`, `enum` / `const`, local `$ref`
  (`#/$defs/X`, `#/definitions/X`), `anyOf` / `oneOf` (union), `allOf` (intersection); None where it does not say;
* `admits(schema, value)` for the scalars `True` / `False` / `None`: whether the schema admits that value (None where
  it cannot tell), which the grammar needs to offer the templates' `True` / `False` / `None` spellings exactly.

Pure functions of JSON data; nothing here raises on a malformed schema (the parser reads schemas no grammar
checked): what cannot be read says nothing (None)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["JSON_TYPES", "ParamSchemas", "admitted", "def_ref", "json_type", "pointer_refs_as_defs"]

JSON_TYPES = frozenset(("null", "boolean", "integer", "number", "string", "array", "object"))
_MAX_DEPTH = 32


def json_type(value: Any) -> str:
    """The JSON Schema type of a Python JSON value ("integer" for an int, "number" for a float)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", tuple: "array", dict: "object"}.get(type(value), "string")


def admitted(value: Any, kinds: frozenset[str]) -> bool:
    """Whether a JSON value's type is among `kinds` (an integer is a number; a float with no fraction an integer, as
    JSON Schema counts them)."""
    t = json_type(value)
    if t in kinds:
        return True
    if t == "integer":
        return "number" in kinds
    return t == "number" and "integer" in kinds and float(value).is_integer()


def _meet(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    """The types both admit (None: says nothing)."""
    if a is None:
        return b
    if b is None:
        return a
    both = a & b
    if ("integer" in a and "number" in b) or ("number" in a and "integer" in b):
        both |= {"integer"}
    return frozenset(both)


_DEF_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")
_VALUE_KEYS = ("const", "enum", "default", "examples")      # JSON values, not schemas: never rewritten


def def_ref(ref: str) -> tuple[str, str] | None:
    """(`$defs` or `definitions`, the entry's name with JSON pointer escapes undone) of a local reference to a
    definition (`#/$defs/X`, `#/definitions/X`); None for any other reference."""
    m = _DEF_REF.fullmatch(ref)
    return (m.group(1), m.group(2).replace("~1", "/").replace("~0", "~")) if m else None


def pointer_refs_as_defs(root: Mapping) -> dict:
    """`root` with every local `$ref` that is no `#/$defs/X` / `#/definitions/X` (zod-to-json-schema's
    `#/properties/a`, `#` for the root itself, a pointer into a definition) pointed at a `$defs` entry holding its
    target instead (rewritten the same way, so a recursive one ends at its own entry). Why: the XML form's values
    are compiled one parameter at a time with the root's `$defs` beside them, where a pointer into the root
    resolves against the value; and `ref_target` follows only `$defs` / `definitions`, so such a parameter was
    untyped free text (the hermes form hands llguidance the whole root, which follows any pointer). A pointer
    that names nothing stays as it is. The client's schema is not changed."""
    names: dict[str, str] = {}
    added: dict[str, Any] = {}
    taken = set(root.get("$defs") or ()) if isinstance(root.get("$defs"), Mapping) else set()

    def target(pointer: str) -> Any:
        """What `pointer` ("#" or "#/a/b") names in the client's root, None if nothing."""
        node: Any = root
        for part in [] if pointer == "#" else pointer[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def rewrite(node: Any, depth: int) -> Any:
        if depth > 64:
            return node
        if isinstance(node, list):
            return [rewrite(x, depth + 1) for x in node]
        if not isinstance(node, Mapping):
            return node
        out = {k: v if k in _VALUE_KEYS else rewrite(v, depth + 1) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and def_ref(ref) is None:
            if ref not in names:
                found = target(ref)
                if not isinstance(found, (Mapping, bool)):
                    return out
                name = next(n for n in (f"ref_{i}" for i in itertools.count(len(names))) if n not in taken)
                taken.add(name)
                names[ref] = name
                added[name] = rewrite(found, depth + 1)
            out["$ref"] = f"#/$defs/{names[ref]}"
        return out

    new = rewrite(root, 0)
    if added and isinstance(new, dict):
        defs = new.get("$defs")
        new["$defs"] = {**(defs if isinstance(defs, Mapping) else {}), **added}
    return new if isinstance(new, dict) else {}


class ParamSchemas:
    """A tool's parameters schema (the root), read for its parameters' types. `root` may be anything: what is no
    JSON object reads as a schema that says nothing."""

    def __init__(self, root: Any) -> None:
        self.root = pointer_refs_as_defs(root) if isinstance(root, Mapping) else {}
        self.defs = {k: self.root[k] for k in ("$defs", "definitions") if isinstance(self.root.get(k), Mapping)}

    # ---- references ---------------------------------------------------------------------------------------------

    def ref_target(self, ref: str) -> Any:
        """The schema a local `$ref` (#/$defs/X, #/definitions/X) names, None for any other."""
        found = def_ref(ref)
        return None if found is None else self.defs.get(found[0], {}).get(found[1])

    def resolve(self, schema: Any) -> Any:
        """A local `$ref` followed (its sibling keywords kept over the target's: the types this admits are a superset
        of the intersection's); other schemas, and a `$ref` that goes elsewhere, as they are."""
        depth = 0
        while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and depth < _MAX_DEPTH:
            target = self.ref_target(schema["$ref"])
            if target is None:
                return schema
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if isinstance(target, Mapping) else target
            depth += 1
        return schema

    # ---- the parameters -----------------------------------------------------------------------------------------

    def shape(self) -> tuple[dict[str, Any], list[str], Any]:
        """(parameter name -> its schema, in schema order; the required names (a `required` that is no list names
        none); the schema of parameters the root does not declare, None where none may be written).

        A parameter declared by several of the root and its `allOf` members must match each (`{"allOf": [...]}`);
        the `{}` that gateway.grammar's `_closed_objects` puts on the root for a member's parameter adds nothing."""
        root = self.resolve(self.root)
        root = root if isinstance(root, Mapping) else {}
        members = [root] + [m for m in (self.resolve(x) for x in _list(root.get("allOf"))) if isinstance(m, Mapping)]
        props: dict[str, list[Any]] = {}
        required: list[str] = []
        for m in members:
            declared = m.get("properties")
            for key, schema in declared.items() if isinstance(declared, Mapping) else ():
                props.setdefault(key, []).append(schema)
            required += [r for r in _list(m.get("required")) if isinstance(r, str)]
        merged = {k: [s for s in v if s != {}] or [{}] for k, v in props.items()}
        out = {k: v[0] if len(v) == 1 else {"allOf": v} for k, v in merged.items()}
        extra = root.get("additionalProperties", True)
        if extra is True:
            extra = {}
        elif not isinstance(extra, Mapping):
            extra = {} if isinstance(root.get("patternProperties"), Mapping) and root["patternProperties"] else None
        required = list(dict.fromkeys(required))
        for key in required:
            if key not in out:                      # required but not declared: as its undeclared values go
                out[key] = extra if extra is not None else {}
        return out, required, extra

    # ---- types ------------------------------------------------------------------------------------------------

    def kinds(self, schema: Any, depth: int = 0) -> frozenset[str] | None:
        """The JSON types `schema` admits (a subset of JSON_TYPES), None when it does not say (`{}`, `true`, a
        `$ref` that is not local, a malformed `type`). Every keyword that limits types counts: `type`, `const`,
        `enum`, `anyOf` / `oneOf` (the union of their members', None if one says nothing), `allOf` (the
        intersection of those that say)."""
        schema = self.resolve(schema)
        if schema is False:
            return frozenset()
        if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
            return None
        found: frozenset[str] | None = None
        if "type" in schema:
            t = schema["type"]
            listed = [t] if isinstance(t, str) else t if isinstance(t, list) else None
            if listed is None or not all(isinstance(x, str) and x in JSON_TYPES for x in listed):
                return None                         # a malformed type: the schema is refused where it is checked
            found = frozenset(listed)
        if "const" in schema:
            found = _meet(found, frozenset((json_type(schema["const"]),)))
        if isinstance(schema.get("enum"), list):
            found = _meet(found, frozenset(json_type(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            members = schema.get(key)
            if isinstance(members, list) and members:
                each = [self.kinds(m, depth + 1) for m in members]
                if all(k is not None for k in each):
                    found = _meet(found, frozenset().union(*each))
        for member in _list(schema.get("allOf")):
            found = _meet(found, self.kinds(member, depth + 1))
        return found

    def admits(self, schema: Any, value: None | bool, depth: int = 0) -> bool | None:
        """Whether `schema` admits `value` (True, False or None), None when that cannot be told here (`not`,
        `if`, a `$ref` that is not local)."""
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
            return None
        if "$ref" in schema:                        # the target and the sibling keywords, both
            target = self.ref_target(schema["$ref"]) if isinstance(schema["$ref"], str) else None
            if target is None:
                return None
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return _both(self.admits(target, value, depth + 1), self.admits(rest, value, depth + 1))
        if any(k in schema for k in ("not", "if", "$dynamicRef")):
            return None
        if "type" in schema:
            t = schema["type"]
            listed = [t] if isinstance(t, str) else t if isinstance(t, list) else None
            if listed is None or not all(isinstance(x, str) for x in listed):
                return None
            if json_type(value) not in listed:
                return False
        same = lambda x: x is value     # noqa: E731 (True is not 1, None only None)
        if "const" in schema and not same(schema["const"]):
            return False
        if "enum" in schema:
            if not isinstance(schema["enum"], list):
                return None
            if not any(same(x) for x in schema["enum"]):
                return False
        verdict: bool | None = True
        for key in ("anyOf", "oneOf", "allOf"):
            members = schema.get(key)
            if members is None:
                continue
            if not isinstance(members, list) or not members:
                return None
            each = [self.admits(m, value, depth + 1) for m in members]
            if key == "allOf":
                if any(v is False for v in each):
                    return False
                ok = None if any(v is None for v in each) else True
            elif any(v is None for v in each):
                ok = None
            else:
                n = sum(each)
                ok = n >= 1 if key == "anyOf" else n == 1
            if ok is False:
                return False
            if ok is None:
                verdict = None
        return verdict


def _both(a: bool | None, b: bool | None) -> bool | None:
    return False if a is False or b is False else None if a is None or b is None else True


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
