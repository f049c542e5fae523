"""JSON-constrained decoding with xgrammar, which both engines use (vLLM inside its scheduler, HF through
`JsonGrammars` in our own sampling loop), so a schema the API accepts is one that either engine can enforce.

JSON is compact (xgrammar 0.2.8 still allows one space after a comma): with free whitespace a small model can emit
newlines until max_tokens and never close the object. vLLM is started with the same setting.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING

from jsonschema import SchemaError, validators

if TYPE_CHECKING:
    import xgrammar

ANY_WHITESPACE, SEPARATORS = False, (",", ":")


# Keywords that xgrammar 0.2.8 compiles but does not enforce (measured), or that vLLM's xgrammar backend refuses
# (multipleOf, uniqueItems, contains): output could break them, so a schema using them is refused up front.
REFUSED = {"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "uniqueItems", "contains",
           "minContains", "maxContains", "multipleOf"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}  # name -> subschema
SUBSCHEMAS = {"items", "prefixItems", "additionalItems", "additionalProperties", "propertyNames", "allOf", "anyOf",
              "oneOf"}  # a subschema or a list of them


def check_json_schema(schema: dict) -> None:
    """Raise ValueError unless `schema` is a valid JSON schema (per its metaschema) that constrained decoding
    enforces whole: xgrammar compiles it and no keyword would be left unchecked. Compiling can take long, so each
    distinct schema is checked once (an agent sends the same one on every call) and callers serving requests run
    this off their event loop."""
    if error := schema_error(json.dumps(schema, sort_keys=True)):  # key order does not change validity
        raise ValueError(error)


@lru_cache(maxsize=256)
def schema_error(text: str) -> str | None:
    """Why the schema, given as canonical JSON text, cannot be enforced; None if it can."""
    schema = json.loads(text)
    draft = schema.get("$schema")  # validator_for fails on a $schema that is not a string
    cls = validators.validator_for(schema, default=validators.Draft202012Validator) if isinstance(draft, str) \
        else validators.Draft202012Validator
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"invalid JSON schema{f' at {where}' if where else ''}: {e.message}"
    if where := _unenforced(schema, ""):
        return f"JSON schema keyword {where} cannot be enforced by constrained decoding"
    try:
        _xgrammar().Grammar.from_json_schema(text, any_whitespace=ANY_WHITESPACE, separators=SEPARATORS)
    except RuntimeError as e:
        reason = re.sub(r"^\[.*?\] \S+: ", "", str(e)).strip()  # drop xgrammar's "[time] file.cc:line: "
        return f"JSON schema not supported for constrained decoding: {reason}"
    return None


def _unenforced(schema, path: str) -> str | None:
    """The path of the first keyword in `schema` or its subschemas that decoding would not enforce."""
    if not isinstance(schema, dict):
        return None
    if found := sorted(REFUSED & schema.keys()):
        return f"{path}/{found[0]}"
    if len(schema.get("allOf") or []) > 1:  # xgrammar keeps only one branch
        return f"{path}/allOf"
    if "pattern" in schema and {"minLength", "maxLength"} & schema.keys():  # xgrammar drops the lengths
        return f"{path}/pattern"
    subs = []
    for k, v in schema.items():
        if k in SCHEMA_MAPS and isinstance(v, dict):
            subs += [(f"{path}/{k}/{name}", sub) for name, sub in v.items()]
        elif k in SUBSCHEMAS and isinstance(v, list):
            subs += [(f"{path}/{k}/{i}", sub) for i, sub in enumerate(v)]
        elif k in SUBSCHEMAS:
            subs.append((f"{path}/{k}", v))
    return next((found for p, sub in subs if (found := _unenforced(sub, p))), None)


class JsonGrammars:
    """Compiles JSON schemas for one tokenizer, keeping the most recent ones, and makes per-request matchers."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64):
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # our LRU is the cache
        self._compile = lru_cache(maxsize=cache_size)(
            lambda text: compiler.compile_json_schema(text, any_whitespace=ANY_WHITESPACE, separators=SEPARATORS))

    def matcher(self, schema: dict, stop_token_ids: set[int]) -> xgrammar.GrammarMatcher:
        # The key keeps the schema's key order: properties are generated in the order they are declared.
        return _xgrammar().GrammarMatcher(self._compile(json.dumps(schema)), override_stop_tokens=sorted(stop_token_ids))

    def bitmask(self):
        return _xgrammar().allocate_token_bitmask(1, self.info.vocab_size)


def apply_bitmask(logits, bitmask) -> None:
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask)


def _xgrammar():
    """xgrammar, imported on first use: it imports transformers (~2 s), and a run's driver imports this module (the
    API's request schemas check JSON schemas) without compiling any."""
    import xgrammar

    return xgrammar
