"""JSON extraction: pull structured fields out of free text, for a batch of documents.

The runtime does not enforce JSON schemas yet, so by default this relies on the prompt and
parses the reply (taking the first {...} block); a reply that does not parse is reported,
not hidden. Once the runtime supports constrained decoding, `use_schema=True` passes
SCHEMA as the gen's json_schema and every reply parses.

    python examples/json_extraction.py              # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import radixserve.frontend as rs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
}
DOCUMENTS = [
    "Maria Lopez is 34 years old and lives in Madrid, where she works as an architect.",
    "Born 52 years ago, Kenji Watanabe now runs a ramen shop in Osaka.",
    "Our new intern, Tom Becker (21), just moved to Berlin.",
]
INSTRUCTION = (
    "Extract the person's name, age and city from the text. Reply with one JSON object only, "
    'with the keys "name" (a string), "age" (an integer) and "city" (a string).'
)

DEMO_TEXT = "Last spring, 67-year-old Ingrid Olsen retired to a cottage outside Bergen."
DEMO_JSON = '{"name": "Ingrid Olsen", "age": 67, "city": "Bergen"}'


@rs.function
def extract(s, document, use_schema=False, max_tokens=64):  # noqa: ANN001, ANN201
    s += rs.system(INSTRUCTION)
    s += rs.user(DEMO_TEXT)  # one worked example: small models follow a format they saw
    s += rs.assistant(DEMO_JSON)
    s += rs.user(document)
    schema = SCHEMA if use_schema else None
    s += rs.assistant(rs.gen("json", max_tokens=max_tokens, temperature=0, json_schema=schema))


@dataclass
class Extraction:
    document: str
    raw: str  # the model's reply
    data: dict[str, Any] | None  # the parsed object, None if the reply held none
    error: str | None  # why parsing failed


def parse_reply(raw: str) -> tuple[dict[str, Any] | None, str | None]:
    """The first {...} block of the reply as a dict, or (None, reason)."""
    start, end = raw.find("{"), raw.rfind("}")
    if start < 0 or end <= start:
        return None, "no JSON object in the reply"
    try:
        data = json.loads(raw[start : end + 1])
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e}"
    if not isinstance(data, dict):
        return None, f"expected an object, got {type(data).__name__}"
    return data, None


def extract_all(
    documents: list[str], backend: Any = None, use_schema: bool = False, max_tokens: int = 64
) -> list[Extraction]:
    batch = [{"document": d, "use_schema": use_schema, "max_tokens": max_tokens} for d in documents]
    states = extract.run_batch(batch, backend=backend)
    out = []
    for doc, state in zip(documents, states):
        raw = state["json"]
        data, error = parse_reply(raw)
        out.append(Extraction(doc, raw, data, error))
    return out


def main(backend: Any = None) -> list[Extraction]:
    backend = backend or rs.EngineBackend()
    results = extract_all(DOCUMENTS, backend)
    for r in results:
        shown = r.data if r.data is not None else f"({r.error}) {r.raw!r}"
        print(f"{r.document}\n    -> {shown}")
    return results


if __name__ == "__main__":
    main()
