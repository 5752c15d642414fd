"""A client's JSON schema, checked before any backend compiles it: valid JSON, an object
(or a boolean), and satisfiable by a finite document.

The last is the one a backend cannot be trusted with: a `$ref` cycle that every instance
must follow (a required property, the items of a non-empty array, every branch of an
anyOf) has no finite instance, and a grammar built from it never lets generation end, or
fails mid-request. It is found here as the least fixpoint of "has a finite instance" over
the schema's local `$ref` targets.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.core.params import InvalidRequest

Schema = dict[str, Any] | bool


def parse_schema(text: str) -> Schema:
    """The schema in `text`; InvalidRequest naming json_schema if it is not valid JSON, not a
    schema, or has no finite instance."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"json_schema: not valid JSON ({e})") from e
    except RecursionError as e:
        raise InvalidRequest("json_schema: the schema is nested too deeply") from e
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("json_schema: a schema must be a JSON object")
    if not _FiniteCheck(schema).root_ok():
        raise InvalidRequest(
            "json_schema: no finite document matches it: a $ref cycle runs through required "
            "properties (or non-empty arrays, or every anyOf branch); make a link optional"
        )
    return schema


class _FiniteCheck:
    def __init__(self, root: Schema) -> None:
        self.root = root
        self.finite: dict[str, bool] = {}  # local $ref -> has a finite instance (so far)

    def root_ok(self) -> bool:
        refs: set[str] = set()
        self._collect(self.root, refs)
        targets = {ref: self._resolve(ref) for ref in refs}
        self.finite = dict.fromkeys(refs, False)
        changed = True
        while changed:  # least fixpoint: each round turns at least one on, or ends
            changed = False
            for ref, target in targets.items():
                if not self.finite[ref] and (target is None or self._ok(target)):
                    self.finite[ref] = changed = True
        return self._ok(self.root)

    def _collect(self, node: Any, refs: set[str]) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.add(ref)
            for value in node.values():
                self._collect(value, refs)
        elif isinstance(node, list):
            for value in node:
                self._collect(value, refs)

    def _resolve(self, ref: str) -> Any:
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None  # unresolvable: the backend reports it
        return node

    def _ok(self, node: Any) -> bool:
        """Whether `node` has a finite instance, given what is known of the $ref targets."""
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not self.finite.get(ref, True):
            return False
        if any(not self._ok(s) for s in _list(node, "allOf")):
            return False
        for key in ("anyOf", "oneOf"):
            branches = _list(node, key)
            if branches and not any(self._ok(s) for s in branches):
                return False
        given = node.get("properties")
        props: dict[str, Any] = given if isinstance(given, dict) else {}
        extra = node.get("additionalProperties", True)
        for name in _list(node, "required"):
            if not self._ok(props.get(name, extra) if isinstance(name, str) else True):
                return False
        min_items = node.get("minItems", 0)
        if isinstance(min_items, int) and min_items > 0:
            prefix = _list(node, "prefixItems")
            if any(not self._ok(s) for s in prefix[:min_items]):
                return False
            if len(prefix) < min_items and not self._ok(node.get("items", True)):
                return False
        return True


def _list(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []
