"""Caps on what ONE request may ask for, in one place (imports nothing: any layer may use it).

Each bounds something a single request multiplies: requests submitted on the api server's
event loop (prompts), samples queued in the scheduler (prompts x n), per-token work of the
stop checker (stop strings), logprob rows on the wire. Past a cap the request is a 400 that
names the field. How much the server holds at once is configured instead, in `EngineConfig`
(`--max-running-requests`, `--max-queued-requests`, `--max-queued-tokens`,
`--max-connections`); past those a request is a 503 with Retry-After.
"""

from __future__ import annotations

MAX_PROMPTS = 1024  # prompts in one request (a list of text / input_ids / prompt)
MAX_N = 256  # samples per prompt
MAX_SAMPLES = 1024  # prompts x n of one request
MAX_STOP_STRINGS = 64  # entries of `stop`
MAX_STOP_BYTES = 256  # UTF-8 bytes of one stop string (each token decodes its window)
MAX_STOP_TOTAL_BYTES = 2048  # UTF-8 bytes of all of a request's stop strings
MAX_TOP_LOGPROBS = 20  # top_logprobs_num (native), logprobs / top_logprobs (OpenAI)
MAX_MESSAGES = 1024  # messages of one chat request
MAX_TEMPLATE_KWARGS = 16  # entries of `chat_template_kwargs`
MAX_TEMPLATE_VALUE_CHARS = 4096  # length of one string value in `chat_template_kwargs`
MAX_STOP_TOKEN_IDS = 1024  # entries of `stop_token_ids`
MAX_RID_CHARS = 256  # a client-chosen request id
MAX_CACHE_SALT_CHARS = 256  # a request's `cache_salt` (its part of the prefix cache)
MAX_PATTERN_CHARS = 65536  # length of a `regex` / `json_schema` / `ebnf` text
MAX_LOGIT_BIAS = 1024  # entries of `logit_bias`
MAX_JSON_DEPTH = 16  # nesting of a request body (the deepest valid one has 6 levels)
MAX_JSON_ITEMS = 1 << 18  # entries of any one list or object in a request body
MIN_TEMPERATURE = 1e-6  # below it sampling is greedy (SGLang's rule): T -> 0 overflows logits
MAX_TEMPERATURE = 100.0  # above it float32 logits / T lose every difference
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # outside it penalised logits overflow float32
MAX_SCHEMAS = 64  # prompt-module schemas registered at once
MAX_SCHEMA_SHARE = 0.5  # of the KV pool that registered schemas may pin
