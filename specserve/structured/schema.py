"""JSON schemas as users write them: local references re-rooted where a schema is embedded in a larger one,
whether any finite JSON value satisfies a schema at all, and a constraint's size before anything compiles.

Every walk here is iterative: a request's JSON may nest as deep as the JSON parser allows."""

from __future__ import annotations

from collections import deque
from urllib.parse import unquote

_DATA_KEYWORDS = {"enum", "const", "default", "examples"}  # their values are JSON data, not schemas


def embed(schema: dict, pointer: str) -> dict:
    """A copy of `schema` to place at JSON pointer `pointer` ("/anyOf/0/properties/arguments") of another
    schema: its local references ("#", "#/$defs/Addr") point to the same places, now under `pointer`."""

    def rerooted(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            copy = {key: value for key, value in node.items()}
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                copy["$ref"] = "#" + pointer + ref[1:]
            return copy
        if isinstance(node, list):
            return list(node)
        return node

    root = rerooted(schema)
    pending = [root]
    while pending:
        node = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(value, dict | list) and key not in _DATA_KEYWORDS:
                node[key] = rerooted(value)
                pending.append(node[key])
    return root


def _resolve(root: dict, ref: str):
    """The subschema a local reference names, or None (not local, or not there)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _requirements(schema, root: dict) -> list[list]:
    """What a value of `schema` needs, as clauses of subschemas: each clause needs a value of one of its
    members (an empty clause cannot be met). Only what surely holds is listed: a keyword not understood
    here needs nothing, so the check never refuses a schema that has values."""
    if schema is False:
        return [[]]
    if not isinstance(schema, dict) or "enum" in schema or "const" in schema:
        return []
    clauses = []
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if isinstance(target, dict | bool):
            clauses.append([target])
    for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        clauses.append([sub])
    for keyword in ("anyOf", "oneOf"):
        if isinstance(schema.get(keyword), list):
            clauses.append(list(schema[keyword]))
    kind = schema.get("type")
    if kind in ("object", ["object"]):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        for name in required:
            if name in properties:
                clauses.append([properties[name]])
    elif kind in ("array", ["array"]):
        min_items = schema.get("minItems", 0)
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items", True)
        if isinstance(min_items, int) and min_items > 0:
            clauses += [[sub] for sub in prefix[:min_items]]
            if min_items > len(prefix):
                clauses.append([items])
    return [[sub for sub in clause if isinstance(sub, dict | bool)] for clause in clauses]


def admits_a_value(root: dict) -> bool:
    """Whether some finite JSON value can satisfy `root`. False for a bare self-reference ({"$ref": "#"}),
    for a property that must hold an object of its own kind, and the like: a value would have to contain
    itself forever. Least fixpoint over the reachable subschemas (linear in their number)."""
    nodes: dict[int, tuple[object, list[list]]] = {}
    pending = [root]
    while pending:
        node = pending.pop()
        if id(node) in nodes:
            continue
        clauses = _requirements(node, root)
        nodes[id(node)] = (node, clauses)
        pending += [sub for clause in clauses for sub in clause if id(sub) not in nodes]
    # unmet[n]: clauses of n not yet met; watchers[m]: the (node, clause) pairs that m's value would meet.
    unmet = {key: len(clauses) for key, (_, clauses) in nodes.items()}
    watchers: dict[int, list[tuple[int, int]]] = {}
    for key, (_, clauses) in nodes.items():
        for index, clause in enumerate(clauses):
            for sub in clause:
                watchers.setdefault(id(sub), []).append((key, index))
    met: set[tuple[int, int]] = set()
    ready = deque(key for key, count in unmet.items() if count == 0)
    has_value: set[int] = set()
    while ready:
        key = ready.popleft()
        if key in has_value:
            continue
        has_value.add(key)
        for owner, index in watchers.get(key, []):
            if (owner, index) not in met:
                met.add((owner, index))
                unmet[owner] -= 1
                if unmet[owner] == 0:
                    ready.append(owner)
    return id(root) in has_value


def json_size(value, limit: int) -> int:
    """The size in bytes of `value` as compact JSON, counted up to just past `limit` (then it stops)."""
    size = 0
    pending = [value]
    while pending and size <= limit:
        node = pending.pop()
        if isinstance(node, dict):
            size += 1 + len(node)  # braces and separators
            for key, item in node.items():
                size += text_size(str(key)) + 3
                pending.append(item)
        elif isinstance(node, list):
            size += 1 + len(node)
            pending += node
        elif isinstance(node, str):
            size += text_size(node) + 2
        else:
            size += len(repr(node))
    return size


def text_size(text: str) -> int:
    """UTF-8 bytes of `text` (a lone surrogate counts as the 3 bytes it would take)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
