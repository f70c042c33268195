"""server.py - specdec's OpenAI-compatible HTTP server (vLLM's wire format), standard library only.

    python server.py MODEL [vllm serve's flags: --speculative-config JSON --reasoning-parser qwen3
                            --enable-auto-tool-choice --tool-call-parser qwen3_coder ...]
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

Endpoints: GET /health, /ping, /version, /v1/models, POST /v1/completions, /v1/chat/completions, /v1/responses
(stateless, section "The Responses API"), /tokenize, /detokenize, GET /metrics (Prometheus text). Request fields,
response and SSE shapes, errors and metric names follow vLLM's server. Chat answers go through the checkpoint's chat template (specdec.ChatTemplate), then the
reasoning parser (qwen3: <think>...</think> -> reasoning_content) and a tool-call parser (qwen3_coder, hermes:
<tool_call>...</tool_call> -> tool_calls), streamed as they settle (section "Chat output").

Threads. The engine is not thread-safe, so one engine thread alone calls add_request / abort / step. Handler
threads (one per connection) parse, validate and tokenize a request, put ("add", job) on the engine thread's
inbox and wait on the job's own queue: first "accepted" (or an error, e.g. the context-length 400), then one
update per engine step that gave the request tokens, pushed by Request.on_update on the engine thread. The
engine thread sleeps on its inbox only when it has no work and never waits on a client. A client that goes
away (a broken connection: a failed write, or a probe the peer resets) puts ("abort", job) on the inbox: its
slot is free by the next step. A client that only half-closes (shuts its sending side) still gets its answer.

Faults. Every field is bounded here, with vLLM's messages, so nothing out of range reaches the engine. If a
step raises anyway, the requests it was serving end with a 500 and the others go on; a device fault (a CUDA
error: the context is lost) makes the process say so in one line and exit non-zero, for a supervisor to
restart it. HTTP/1.1 framing is checked before a body is read (405, 411, 413, 415, 401, 400 for a bad or
doubled Content-Length), a request's head and its body must each arrive within --request-timeout, and at most
--max-connections connections are open (one more gets a 503 at once).
"""
import argparse
import ast
import copy
import dataclasses
import hmac
import io
import json
import math
import os
import queue
import re
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import namedtuple
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import torch

from specdec import (BYTE_OF_CHAR, REQUEST_BUCKETS, TTFT_BUCKETS, ChatTemplate, ConfigError, SamplingParams,
                     SpecStats, StructuredOutputsParams, add_engine_args, llm_from_args, truncate_prompt,
                     vllm_argv, xgrammar_reason)

VERSION = "0.1.0"  # GET /version
MAX_N = 16384      # vLLM's VLLM_MAX_N_SEQUENCES: the most samples a request may ask for (n, best_of)
MAX_BODY = 1 << 26  # bytes of one request body
INT64 = 1 << 63  # seeds are signed 64-bit, as in vLLM's protocol
BYTE_CHARS = {b: c for c, b in BYTE_OF_CHAR.items()}  # a byte -> its character in byte-level BPE vocabularies


# ==============================================================================================
# Errors and request fields
# ==============================================================================================

class ApiError(Exception):
    """Answered as {"error": {"message", "type", "param", "code"}} with HTTP status `status`. The API's
    errors are typed as vLLM's serving code types them; errors of HTTP itself (no such route, a wrong method,
    bad framing) by their status phrase, as vLLM's HTTPException handler does. `headers` go out with it."""
    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status, message, param=None, http=False, headers=None):
        super().__init__(message)
        kind = HTTPStatus(status).phrase if http else self.TYPES[status]
        self.status, self.headers = status, headers or {}
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad(message, param=None):
    return ApiError(400, message, param)


def http_error(status, message, **headers):
    return ApiError(status, message, http=True, headers=headers)


JSON_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
              "string": lambda v: isinstance(v, str)}


def short(v):
    """A value for an error message: a 10**400 sent as `top_k` is not echoed whole."""
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


TRUE, FALSE = ("1", "on", "t", "true", "y", "yes"), ("0", "off", "f", "false", "n", "no")


def lax(v, kind):
    """What pydantic's lax mode (vLLM's request models) makes of a JSON value of another type, else v: an integer
    from a float without a fraction, a string of an integer or a boolean; a number from a numeric string or a
    boolean; a boolean from 0 / 1 or pydantic's true / false words. (A string never from a number.)"""
    if kind == "integer" and not isinstance(v, str):
        return int(v) if isinstance(v, bool) or (isinstance(v, float) and v.is_integer()) else v
    if kind == "integer":
        return int(v) if re.fullmatch(r"\s*[-+]?\d{1,4300}\s*", v) else v
    if kind == "number" and isinstance(v, (str, bool)):
        try:
            return float(v) if isinstance(v, bool) or re.fullmatch(r"\s*[-+]?[\d.eE+-]+\s*", v) else v
        except ValueError:
            return v
    if kind == "boolean" and isinstance(v, str) and v.strip().lower() in TRUE + FALSE:
        return v.strip().lower() in TRUE
    if kind == "boolean" and isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    return v


def get(body, name, kind, default=None, within=None):
    """body[name] checked against a JSON type (after pydantic's lax conversions, as vLLM reads it); absent or
    null gives `default`. within: the field whose value body is; an error names a nested field by its path, as
    OpenAI's errors do ("stream_options.include_usage"), not by its own name alone, which no request field has."""
    v = body.get(name)
    if v is None:
        return default
    v = v if JSON_TYPES[kind](v) else lax(v, kind)
    field = name if within is None else f"{within}.{name}"
    if not JSON_TYPES[kind](v):
        raise bad(f"'{field}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {short(body[name])}", field)
    return v


FINITE = (lambda v: abs(v) < math.inf, "must be a finite number")  # JSON's 1e999 parses to inf


def checked(body, name, kind, default, *rules):
    """get(), then each (test, "must be ...") rule in order, failing as vLLM's SamplingParams does:
    "<name> must be ..., got <value>." """
    v = get(body, name, kind, default)
    for test, rule in rules if v is not None else ():
        if not test(v):
            raise bad(f"{name} {rule}, got {short(v)}.", name)
    return v


# How deep a request body may nest: far beyond any real schema or message, and far below Python's recursion
# limit, which what reads the body later (error messages, the chat template's tojson, schemas) recurses into
MAX_DEPTH = 256


def depth_and_unencodable(v):
    """How deeply a parsed JSON value nests (a scalar: 0), and its first string (a key or a value) that UTF-8
    cannot encode, else None; one walk, without recursion. JSON's \\u escapes can spell a lone UTF-16 surrogate
    ("\\ud800"), which Python's json reads into a str that no answer echoing it (an error naming the model, echo,
    the Responses API's fields) could send."""
    most, bad_text, todo = 0, None, [(v, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            most = max(most, d + 1)
            todo.extend((x, d + 1) for x in ([*v, *v.values()] if isinstance(v, dict) else v))
        elif bad_text is None and isinstance(v, str) and not v.isascii():
            try:
                v.encode()
            except UnicodeEncodeError:
                bad_text = v
    return most, bad_text


def parse_json(raw):
    def no_nan(c):
        raise ValueError(f"{c} is not valid JSON")
    try:
        body = json.loads(raw, parse_constant=no_nan)
    except (ValueError, RecursionError) as e:  # also bytes that are not UTF-8, integers of over 4300 digits
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    most, text = depth_and_unencodable(body)
    if most > MAX_DEPTH:
        raise bad(f"the request body nests more than {MAX_DEPTH} levels deep")
    if text is not None:
        raise bad(f"the request body is not valid JSON text: the string {ascii(text)[:80]} holds a lone UTF-16 "
                  "surrogate (a \\u escape of D800-DFFF without its pair)")
    return body


# OpenAI / vLLM fields specdec does not implement: accepted only at their no-op value (others: ignored)
UNSUPPORTED = {"suffix": "", "prompt_embeds": None, "use_beam_search": False}
# The sampling fields' JSON types and vLLM's range checks (before SamplingParams, so that a value JSON allows
# and Python would choke on - an integer of 400 digits - gets vLLM's message)
PENALTY = (lambda v: -2 <= v <= 2, "must be in [-2, 2]")
AT_MOST_N = (lambda v: v <= MAX_N, f"must be at most {MAX_N}")
RANGES = {
    "presence_penalty": ("number", PENALTY), "frequency_penalty": ("number", PENALTY),
    "repetition_penalty": ("number", FINITE, (lambda v: v > 0, "must be greater than zero")),
    "min_p": ("number", (lambda v: 0 <= v <= 1, "must be in [0, 1]")),
    "min_tokens": ("integer", (lambda v: v >= 0, "must be greater than or equal to 0")),
    "best_of": ("integer", (lambda v: v >= 1, "must be at least 1"), AT_MOST_N),
    "n": ("integer", (lambda v: v >= 1, "must be at least 1"), AT_MOST_N)}
FLAGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "ignore_eos")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # vLLM's older spelling of structured_outputs


def structured_outputs(body):
    """The request's structured-output constraint (SamplingParams.structured_outputs as a dict) or None:
    `structured_outputs`, the older `guided_*` fields, or OpenAI's response_format (json_object,
    json_schema)."""
    so = get(body, "structured_outputs", "object")
    given = {kind: body[name] for name, kind in GUIDED.items() if body.get(name) is not None}
    fmt = get(body, "response_format", "object")
    kind = None if fmt is None else fmt.get("type")
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise bad(f"response_format type {short(kind)} is not supported (text, json_object, json_schema)",
                  "response_format")
    if kind == "json_object":
        given["json_object"] = True
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if not (isinstance(schema, dict) and isinstance(schema.get("schema", {}), dict)):
            raise bad("response_format json_schema must be {\"name\": ..., \"schema\": {...}}",
                      "response_format")
        given["json"] = schema.get("schema", {})
    if so is not None and given:
        raise bad("give structured_outputs, or the guided_* fields / response_format, not both",
                  "structured_outputs")
    so = so if so is not None else (given or None)
    choice = so.get("choice") if so is not None else None
    if choice is not None and not (isinstance(choice, list) and all(isinstance(c, str) for c in choice)):
        raise bad(f"the choice constraint must be a list of strings, got {short(choice)}",
                  "guided_choice" if "choice" in given else "structured_outputs")
    if so is None:
        return None
    so = {k: v for k, v in so.items() if k != "disable_fallback"}  # vLLM's choice among backends: one here
    known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
    unknown = [k for k in so if k not in known]
    if unknown:
        raise bad(f"structured_outputs: {short(unknown[0])} is not supported (specdec takes {', '.join(known)} "
                  "and disable_fallback)", "structured_outputs")
    try:
        return StructuredOutputsParams(**so)
    except ConfigError as e:  # not one constraint
        raise bad(f"structured_outputs: {e}", "structured_outputs") from None


def max_tokens_field(body, name, default):
    return checked(body, name, "integer", default, (lambda v: v >= 1, "must be at least 1"))


def logprobs_count(body, name, app, kind="sample"):
    """`logprobs` (completions), `top_logprobs` (chat) or `prompt_logprobs` (kind "prompt") as vLLM reads
    it: -1 asks for the whole vocabulary, and no more than --max-logprobs (and the vocabulary) may be asked
    for."""
    vocab = app.vocab
    cap = vocab if app.llm.max_logprobs == -1 else app.llm.max_logprobs  # (-1: the whole vocabulary)
    v = get(body, name, "integer")
    if v is None:
        return None
    if v < -1:
        raise bad(f"`{name}` must be a positive value or -1.", name)
    n, most = vocab if v == -1 else v, min(cap, vocab)
    if n > most:
        raise bad(f"Requested {kind} logprobs of {short(n)}, which is greater than max allowed: {most}", name)
    return n


def id_list(body, name, kind="integer"):
    """body[name]: a list of token ids (kind integer) or of strings (kind string), or None."""
    v = body.get(name)
    test = JSON_TYPES["integer"] if kind == "integer" else (lambda x: isinstance(x, str))
    if v is not None and not (isinstance(v, list) and all(test(x) for x in v)):
        raise bad(f"'{name}' must be a list of {'integers' if kind == 'integer' else 'strings'}", name)
    return v


# At most this many bad_words a request: each step checks each of them. (The handler thread tokenizes them: once the
# engine did, as it admitted the request, in the loop that runs every request's steps: 2.5 million stalled the others
# 45 s, and 100 words of 100 KB 1.8 s)
MAX_BAD_WORDS = 4096
# At most this many stop strings a request (OpenAI takes 4; vLLM sets no bound): the engine looks for each in the
# new text of every step, in that same loop (500,000 made the others' small requests 0.03 -> 0.4-0.8 s)
MAX_STOP = 4096


def bad_words(body):
    words = id_list(body, "bad_words", "string")
    if words is not None and len(words) > MAX_BAD_WORDS:
        raise bad(f"'bad_words' has {len(words)} entries; at most {MAX_BAD_WORDS} are accepted", "bad_words")
    return words


def sampling_params(body, max_tokens, logprobs, vocab, defaults):
    """The sampling fields, each bounded as vLLM bounds it (sampling_params.py and the OpenAI protocol), so
    nothing out of range reaches the engine: a bad value is a 400 here, never a failure inside a step. A
    field left unset gets the model's generation-config default (`defaults`), else vLLM's."""
    for name, ok in UNSUPPORTED.items():
        if body.get(name) not in (None, ok):
            raise bad(f"'{name}' is not supported by this server (only {json.dumps(ok)} is accepted)", name)
    priority = get(body, "priority", "integer", 0)
    if priority != 0:  # vLLM's answer without --scheduling-policy priority (specdec schedules first come first served)
        raise bad(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
    fields = {name: checked(body, name, kind, None, *rules) for name, (kind, *rules) in RANGES.items()}
    fields = {name: v for name, v in fields.items() if v is not None}
    for name in ("repetition_penalty", "min_p"):  # the generation config's, when the request has none
        if name not in fields and name in defaults:
            fields[name] = defaults[name]
    temperature = checked(body, "temperature", "number", defaults.get("temperature", 1.0), FINITE,
                          (lambda v: v >= 0, "must be non-negative"), (lambda v: v <= 2, "must be in [0, 2]"))
    top_p = checked(body, "top_p", "number", defaults.get("top_p", 1.0),
                    (lambda v: 0 < v <= 1, "must be in (0, 1]"))
    top_k = checked(body, "top_k", "integer", defaults.get("top_k", 0),
                    (lambda v: v >= -1, "must be 0 (disable), or at least 1"))
    if "max_tokens" in defaults:  # the generation config's max_new_tokens caps every request (vLLM)
        max_tokens = min(max_tokens or math.inf, defaults["max_tokens"])
    top_k = 0 if top_k >= vocab else top_k  # any k >= the vocabulary keeps every token
    seed = get(body, "seed", "integer")
    if seed is not None and not -INT64 <= seed < INT64:  # vLLM: a pydantic bound, with pydantic's message
        raise bad(f"seed: Input should be less than or equal to {INT64 - 1}" if seed > 0 else
                  f"seed: Input should be greater than or equal to {-INT64}", "seed")
    stop = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if stop is not None and len(stop) > MAX_STOP:
        raise bad(f"'stop' has {len(stop)} entries; at most {MAX_STOP} are accepted", "stop")
    ids = id_list(body, "stop_token_ids")
    if ids and not all(0 <= t < vocab for t in ids):
        wrong = short([t for t in ids if not 0 <= t < vocab])
        raise bad(f"token_id(s) {wrong} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: "
                  f"{vocab}", "stop_token_ids")
    allowed = id_list(body, "allowed_token_ids")
    if allowed and not all(0 <= t < vocab for t in allowed):
        raise bad("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
    # each id once (the same set of tokens): the engine builds the request's mask from the list at every step, and
    # 800,000 repeated ids made every other request's steps 0.01 -> 0.16-0.33 s for that request's life
    allowed = sorted(set(allowed)) if allowed else allowed
    bias = get(body, "logit_bias", "object")
    if bias is not None and not all(JSON_TYPES["number"](v) and abs(v) < math.inf for v in bias.values()):
        raise bad("'logit_bias' must map token ids to finite numbers", "logit_bias")
    for name in FLAGS:
        if body.get(name) is not None:
            fields[name] = get(body, name, "boolean")
    try:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, top_p=top_p, top_k=top_k,
                                stop=stop or [], stop_token_ids=ids, logprobs=logprobs,
                                seed=None if seed == -1 else seed,  # vLLM: seed -1 means none
                                logit_bias=bias, allowed_token_ids=allowed,
                                bad_words=bad_words(body),
                                structured_outputs=structured_outputs(body), **fields)
    except ConfigError as e:  # "temperature must be ...": the first word names the field
        raise bad(str(e), str(e).split()[0]) from None
    wrong = [t for t in params.logit_bias or {} if not 0 <= t < vocab]  # (its keys are ints now)
    if wrong:  # vLLM's message, naming the field (its VLLMValidationError's parameter), as stop_token_ids' above
        raise bad(f"token_id(s) {short(wrong)} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                  f"{vocab}", "logit_bias")
    return params


def parse_completion(app, body):
    """A /v1/completions body -> ([(prompt ids, echo text), ...], SamplingParams, None: no chat). `prompt` is a
    string or a list of token ids, or a batch: a list of those (vLLM's; each prompt gets n choices, prompt i's at
    indices i * n .. i * n + n - 1)."""
    tok, vocab = app.tokenizer, app.vocab
    prompt = body.get("prompt")
    batch = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt
    logprobs, echo = logprobs_count(body, "logprobs", app), get(body, "echo", "boolean", False)
    max_tokens = 1 if echo_only(body) else max_tokens_field(body, "max_tokens", 16)  # vLLM: null is the default too
    # vLLM: with return_token_ids the ids stand for the echoed prompt (prompt_token_ids), its text is left out
    echo_text = echo and not get(body, "return_token_ids", "boolean", False)
    params = sampling_params(body, max_tokens, logprobs, vocab, app.llm.default_sampling)
    prompts, with_fields = [], params
    for p in batch:
        if isinstance(p, str):
            ids = tok.encode(p)
        elif isinstance(p, list) and all(JSON_TYPES["integer"](t) for t in p):
            ids, p = p, None
        else:
            raise bad("'prompt' is required" if p is None else
                      "'prompt' must be a string, a list of token ids, or a list of either", "prompt")
        whole = ids
        ids, with_fields = prompt_fields(app, body, ids, params, logprobs if echo else None)  # (the same each time)
        prompts.append((ids, (p if p is not None and ids == whole else tok.decode(ids)) if echo_text else ""))
    return prompts, with_fields, None


def echo_only(body):
    """Completions' echo with max_tokens 0 (vLLM: scoring a text): the answer is the prompt alone (one token is made,
    for max_tokens' sake, and dropped: Job.echo_only)."""
    return get(body, "echo", "boolean", False) and get(body, "max_tokens", "integer") == 0


def prompt_fields(app, body, ids, params, implied=None):
    """The fields about the prompt, on both endpoints as vLLM reads them: `truncate_prompt_tokens` (keep the
    prompt's last N tokens; -1: max_model_len of them) and `prompt_logprobs` (each prompt token's logprob and
    the N most likely; not when streaming). `implied`: what echo with logprobs asks for the prompt (vLLM's
    completions). -> (the prompt's ids, params with both)."""
    n = get(body, "truncate_prompt_tokens", "integer")
    if n is not None:
        if n == 0 or n < -1:
            raise bad(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {short(n)}",
                      "truncate_prompt_tokens")
        try:
            ids = truncate_prompt(ids, n, app.llm.max_model_len)
        except ConfigError as e:
            raise bad(str(e), "truncate_prompt_tokens") from None
    want = get(body, "prompt_logprobs", "integer")
    if want is not None and (want > 0 or want == -1) and get(body, "stream", "boolean", False):
        raise bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    want = logprobs_count(body, "prompt_logprobs", app, "prompt")
    return ids, dataclasses.replace(params, prompt_logprobs=implied if want is None else want,
                                    truncate_prompt_tokens=n)


ROLES = ("system", "developer", "user", "assistant", "tool")
FUNCTION_SHAPE = '{"type": "function", "function": {"name": ...}}'
# The content parts vLLM reads as text (its TEXT_PART_TYPES): most hold it as "text" (TEXT_PARTS, the Responses API's
# too); a refusal (an assistant turn's, as OpenAI sends it back) and a thinking part under their type's name
TEXT_PARTS = ("text", "input_text", "output_text")
TEXT_UNDER_TYPE = ("refusal", "thinking")
TEXT_PART_TYPES = TEXT_PARTS + TEXT_UNDER_TYPE
# A chat part of these types with no text (null, or no field) is skipped, as vLLM's chat parser skips it (its
# PART_TYPES_TO_SKIP_NONE_CONTENT): clients send a null text part beside the real ones. A message of nothing but such
# parts stays a 400 (vLLM's request model refuses it), and so does an input_text, output_text or thinking part with
# none (not skipped there: its None goes on, to the template).
SKIPPED_WHEN_EMPTY = ("text", "refusal")


def part_text(part):
    """A text part's text: under "text", or under its type's name (a refusal, a thinking part)."""
    return part.get(part["type"] if part["type"] in TEXT_UNDER_TYPE else "text")


def parse_messages(msgs):
    """Check `messages` as vLLM's protocol does: each a {role, content} object (content a string, null or a
    list of text parts); an assistant's tool_calls a list of {function: {name, arguments}}."""
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs)):
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if m.get("role") not in ROLES:
            raise bad(f"{where}: 'role' must be one of {', '.join(ROLES)}, got {short(m.get('role'))}",
                      "messages")
        content = m.get("content")
        wrong = [p.get("type") for p in content if isinstance(p, dict) and p.get("type") not in TEXT_PART_TYPES] \
            if isinstance(content, list) else []
        if wrong:  # an image, a typo: refused by its type, as vLLM does (not read as text for a "text" it may hold)
            what = "a content part has no 'type'" if wrong[0] is None else \
                f"content part type {short(wrong[0])} is not supported"
            raise bad(f"{where}: {what} (this server takes text parts: {', '.join(TEXT_PART_TYPES)})", "messages")
        parts = False
        if isinstance(content, list):  # a refusal or a thinking part: a text part of its text (vLLM's reading)
            kept = [{"type": "text", "text": part_text(p)} if isinstance(p, dict) and p.get("type") in TEXT_UNDER_TYPE
                    else p for p in content if not (isinstance(p, dict) and p.get("type") in SKIPPED_WHEN_EMPTY
                                                    and part_text(p) is None)]
            # text parts, not all of them empty ones (SKIPPED_WHEN_EMPTY)
            parts = (bool(kept) or not content) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                        for p in kept)
            content = m["content"] = kept
        if not (content is None or isinstance(content, str) or parts):
            raise bad(f"{where}: 'content' must be a string or a list of text parts", "messages")
        calls = m.get("tool_calls")
        if calls is not None and not (m["role"] == "assistant" and isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", "{}"), (str, dict)) for c in calls)):
            raise bad(f"{where}: 'tool_calls' must be an assistant's list of {{\"id\", \"type\": "
                      "\"function\", \"function\": {\"name\", \"arguments\"}} objects", "messages")
    return msgs


def parse_tools(body):
    """-> (tools or None, tool_choice: "none" | "auto" | "required" | a function's name), checked as vLLM's
    protocol checks them; tool_choice defaults to "auto" with tools, else "none"."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            and t["function"]["name"] and isinstance(t["function"].get("parameters") or {}, dict)
            for t in tools)):
        raise bad(f"'tools' must be a list of {FUNCTION_SHAPE} objects", "tools")
    for t in tools or []:  # the tool-call formats write the name between < > or in quotes: it must fit there
        if BAD_NAME.search(t["function"]["name"]):
            raise bad(f"tool name {short(t['function']['name'])} cannot contain whitespace, braces, angle "
                      "brackets or quotes", "tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "required" and tools == []:
        return None, "none"  # vLLM (and OpenAI): nothing to require
    if choice not in (None, "none"):
        if tools is None:
            raise bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, dict):
            fn = choice.get("function")
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
                raise bad(f"Invalid value for `tool_choice`: {short(choice)}! Correct usage: "
                          f"{FUNCTION_SHAPE}", "tool_choice")
            if fn["name"] not in (t["function"]["name"] for t in tools):
                raise bad("The tool specified in `tool_choice` does not match any of the specified `tools`",
                          "tool_choice")
            choice = fn["name"]
        elif choice not in ("auto", "required"):
            raise bad(f"Invalid value for `tool_choice`: {short(choice)}! Only named tools, \"none\", "
                      "\"auto\" or \"required\" are supported.", "tool_choice")
    return tools, choice or "none"


def render_chat(app, body, msgs, tools):
    """The chat template's prompt for a request: its messages and tools, with its chat_template_kwargs over
    the server's --default-chat-template-kwargs."""
    if body.get("chat_template") is not None:
        raise bad("Chat template is passed with request, but --trust-request-chat-template is not set. "
                  "Refused request with untrusted chat template.", "chat_template")
    # As vLLM merges them (merge_kwargs): a request's value of null or "auto" sets nothing, so the server's
    # default (if any) stands. The server's tools (--default-chat-template-kwargs) are the template's only for a
    # request without tools of its own.
    own = {k: v for k, v in get(body, "chat_template_kwargs", "object", {}).items() if v is not None and v != "auto"}
    defaults = {k: v for k, v in app.chat_kwargs.items() if k != "tools"}
    kwargs = {**defaults, **own}
    if body.get("tools") is None:
        tools = app.chat_kwargs.get("tools", tools)
    # as vLLM, they go over the template's own arguments: they may set add_generation_prompt and the tools (what
    # the template shows; the tool parser keeps the request's), not the messages or documents
    from_kwargs = "add_generation_prompt" in kwargs or "continue_final_message" in kwargs
    add_generation_prompt = kwargs.pop("add_generation_prompt", get(body, "add_generation_prompt", "boolean", True))
    continue_final = kwargs.pop("continue_final_message", get(body, "continue_final_message", "boolean", False))
    tools = kwargs.pop("tools", tools)
    clash = [k for k in app.template.RESERVED if k in kwargs]
    if clash:
        raise bad(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    if continue_final and add_generation_prompt:  # (vLLM's check, before the template)
        raise bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                  "chat_template_kwargs" if from_kwargs else "continue_final_message")
    try:
        return app.template.render(msgs, tools, add_generation_prompt, continue_final, **kwargs)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise bad(f"invalid messages: {e}", "messages") from None
    except RecursionError:  # a template recursing too deep (deep tool arguments: refused before, _tool_call_object)
        raise bad("invalid messages: a value nests too deeply", "messages") from None


def token_str(app, i):
    """A token as the tokenizer's vocabulary spells it (vLLM's token_strs): byte-level, e.g. "Ġthe"."""
    if i in app.added_tokens:
        return app.added_tokens[i]
    return "".join(BYTE_CHARS[b] for b in app.tokenizer.token_bytes(i))


# What a chat request's answer goes through: ChatStream's arguments, and the tool choice (for finish_reason)
ChatSpec = namedtuple("ChatSpec", "start parser tool_choice include_reasoning max_calls role")


def chat_stream(spec):
    """A fresh ChatStream for an answer to the request of ChatSpec spec."""
    return ChatStream(spec.start, spec.parser, spec.max_calls)


def parse_chat(app, body):
    """A /v1/chat/completions body -> ([(prompt ids, echo text)], SamplingParams, ChatSpec). The prompt is
    the chat template's rendering (with the tools and the chat_template_kwargs over the server's defaults);
    tool_choice required or a named function holds the answer to calls (forced_calls)."""
    msgs = parse_messages(body.get("messages"))
    tools, tool_choice = parse_tools(body)
    if tool_choice == "auto" and not app.auto_tools:
        raise bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                  "tool_choice")
    forced = tool_choice not in ("none", "auto")
    prompt = render_chat(app, body, msgs, tools)
    max_tokens = max_tokens_field(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = max_tokens_field(body, "max_tokens", None)  # None: up to the context
    want, top = get(body, "logprobs", "boolean", False), get(body, "top_logprobs", "integer")
    if top is not None and (top == -1 or top > 0) and not want:
        raise bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    top = logprobs_count(body, "top_logprobs", app)
    logprobs = (top or 0) if want else None
    params = sampling_params(body, max_tokens, logprobs, app.vocab, app.llm.default_sampling)
    if (forced or params.structured_outputs is not None) and prompt_reasoning(prompt) == "thinking":
        # A forced call, or an answer held to a grammar, comes without thinking (as enable_thinking false): the
        # grammar holds the answer from its first token, and a thinking model's answer would otherwise be its
        # reasoning, held to the grammar, with no </think> allowed (vLLM lets the model think first and holds
        # only what follows; specdec's grammars do not wait for the reasoning's end yet)
        prompt += f"\n{END_THINK}\n\n"
    if forced and app.tool_parser is None:  # vLLM's way: the answer is JSON (json_calls), read as the calls
        parser = JsonCalls(tool_choice)
    else:
        parser = None if tool_choice == "none" else TOOL_PARSERS[app.tool_parser_name](tools)
    start = prompt_reasoning(prompt) if app.reasoning_parser else None
    parallel = get(body, "parallel_tool_calls", "boolean", True)  # false: the calls after the first dropped (vLLM)
    # vLLM's response role: the assistant's with a generation prompt, else the last message's (whose text the
    # answer goes on with: continue_final_message)
    role = "assistant" if get(body, "add_generation_prompt", "boolean", True) else msgs[-1]["role"]
    spec = ChatSpec(start, parser, tool_choice, get(body, "include_reasoning", "boolean", True),
                    None if parallel else 1, role)
    if forced:
        if params.structured_outputs is not None:
            raise bad("tool_choice 'required' or a named function holds the answer to tool calls: it cannot be "
                      "combined with structured outputs (response_format, structured_outputs, guided_*)",
                      "tool_choice")
        held = forced_calls(app, tools, tool_choice, parallel) if app.tool_parser else json_calls(tools, tool_choice)
        params = dataclasses.replace(params, structured_outputs=held)
    echo = chat_echo(body, msgs, role)
    # echo implies the prompt's logprobs (vLLM's chat: top_logprobs of them, default 0; not streamed)
    implied = (top or 0) if echo is not None and not get(body, "stream", "boolean", False) else None
    ids, params = prompt_fields(app, body, app.tokenizer.encode(prompt), params, implied)
    return [(ids, echo)], params, spec


def chat_echo(body, msgs, role):
    """vLLM's chat `echo`: None without it; else the text that leads the answer's content: the last message's
    where its role is the answer's (an answer the caller began: continue_final_message), else ""."""
    if not get(body, "echo", "boolean", False):
        return None
    content = msgs[-1].get("content") if msgs[-1].get("role") == role else None
    return "\n".join(p["text"] for p in content) if isinstance(content, list) else content or ""


# The tool-call parsers' formats as xgrammar's structural tags name them: qwen3_coder's XML calls (Qwen3.5 / 3.6,
# Qwen3-Coder) and hermes' JSON calls in <tool_call> tags (Qwen3)
CALL_FORMATS = {"qwen3_coder": "qwen_3_coder", "qwen3_xml": "qwen_3_coder", "hermes": "qwen_3"}


def forced_calls(app, tools, tool_choice, parallel):
    """tool_choice "required" or a named function, as vLLM holds it (structured outputs): the answer may be only
    tool calls in the parser's own format (a named function: its one call; required: text, then one call or
    more, one with parallel_tool_calls false), each call's arguments valid under its tool's JSON schema. The
    grammar is xgrammar's structural tag for the format, as EBNF text (StructuredOutputsParams.grammar)."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise bad("tool_choice 'required' or a named function needs the xgrammar package (pip install "
                  "xgrammar)", "tool_choice") from None
    choice = "required" if tool_choice == "required" else {"type": "function", "function": {"name": tool_choice}}
    try:
        tag = xgr.get_builtin_structural_tag(CALL_FORMATS[app.tool_parser_name], tools, choice,
                                             reasoning="disabled", max_whitespace_cnt=16,
                                             parallel_tool_calls=parallel)
        return StructuredOutputsParams(grammar=str(xgr.Grammar.from_structural_tag(tag)))
    except (ValueError, RuntimeError, TypeError) as e:
        raise bad(f"the tools' parameters cannot be held to by a grammar: {xgrammar_reason(e)}", "tools") from None


def json_calls(tools, tool_choice):
    """tool_choice "required" or a named function on a server without a tool-call parser, as vLLM holds it
    (ChatCompletionRequest._get_json_schema_from_tool): a named function's answer is its arguments, a JSON object
    under its parameters' schema (none: not held); required's is a JSON array of one call or more, each
    {"name": one of the tools, "parameters": under that tool's schema}. JsonCalls reads the answer as the calls."""
    fns = {t["function"]["name"]: t["function"] for t in tools}
    if tool_choice != "required":
        schema = fns[tool_choice].get("parameters")
        return None if schema is None else StructuredOutputsParams(json=schema)
    one = lambda f: {"properties": {"name": {"type": "string", "enum": [f["name"]]},  # noqa: E731
                                    "parameters": f.get("parameters") or {"type": "object", "properties": {}}},
                     "required": ["name", "parameters"]}
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [one(f) for f in fns.values()]}}
    defs = {k: v for f in fns.values() for k, v in ((f.get("parameters") or {}).get("$defs") or {}).items()}
    return StructuredOutputsParams(json=dict(schema, **({"$defs": defs} if defs else {})))


class RawCall:
    """A call whose arguments are the answer's own JSON text (JsonCalls), sent as it grows."""

    def __init__(self, name, arguments):
        self.name, self.text = name, arguments

    def arguments(self):
        return self.text


class JsonCalls:
    """The answer json_calls held, as calls (ChatStream's parser): a named function's is its one call's arguments,
    streamed as they come; required's array becomes its calls once whole (arguments: the parameters' JSON, as
    vLLM dumps them). An array that does not parse (max_tokens cut it) stays text, with no calls."""

    def __init__(self, tool_choice):
        self.name = None if tool_choice == "required" else tool_choice

    def parse(self, text, final):
        if self.name is not None:
            return ["", RawCall(self.name, text), ""]
        if not final:
            return [""]
        try:
            calls = json.loads(text)
            calls = [RawCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        except (ValueError, TypeError, KeyError, RecursionError):
            return [text]
        return [x for c in calls for x in ("", c)] + [""]


# ==============================================================================================
# Chat output: the reasoning parser (qwen3) and the tool-call parsers (qwen3_coder, hermes)
# ==============================================================================================
# Each reads the answer's whole text so far and says what it settles: with final=False it holds back what
# the next tokens could still change (half a tag, a value that may go on); at the end (final=True) nothing
# waits. ChatStream sends only what is new since the last step, so a stream's pieces add up to exactly the
# non-streamed answer, however the text arrived (a speculative step brings several tokens at once).

THINK, END_THINK, TOOL_CALL, END_TOOL_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"
FUNC, END_FUNC, PARAM, END_PARAM = "<function=", "</function>", "<parameter=", "</parameter>"
BAD_NAME = re.compile(r"[\s{}<>\"']")  # a tool's name has none of these (a name with them is no call)
TEXT_KINDS = ("string", "str", "text", "varchar", "char", "enum")  # schema types whose values stay text


def held(text, *tags):
    """How many characters at the end of `text` may be the start of one of `tags`."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def skip_space(text, i):
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def prompt_reasoning(prompt):
    """Where the answer starts: "thinking" (the prompt's last think tag opens a block: Qwen3.6's default),
    "answer" (it closes one: thinking is off), or "maybe" (no tag: the model may open one itself)."""
    opened, closed = prompt.rfind(THINK), prompt.rfind(END_THINK)
    return "thinking" if opened > closed else "answer" if closed > opened else "maybe"


def split_reasoning(text, start, final):
    """vLLM's qwen3 reasoning parser -> (reasoning, content or None while the thinking goes on). The thinking
    runs to </think>, or to a <tool_call> that opens a <function=...> (Qwen3.5+ may call a tool without
    closing it); an answer that never closes it is all reasoning; with thinking off all is content."""
    if start == "answer":
        return "", text
    if not final and len(text) < len(THINK) and THINK.startswith(text):  # nothing yet, or half a <think>
        return "", None
    if text.startswith(THINK):
        text = text[len(THINK):]
    elif start == "maybe":
        return "", text
    end = text.find(END_THINK)
    call = text.find(TOOL_CALL)
    # the first of the two ends the thinking (so a stream agrees)
    while 0 <= call and (end < 0 or call < end):
        after = text[skip_space(text, call + len(TOOL_CALL)):]
        if re.match(r"<function[\s=]", after):
            return text[:call], text[call:]
        if not final and "<function=".startswith(after):
            return text[:call], None
        call = text.find(TOOL_CALL, call + 1)
    if end >= 0:
        return text[:end], text[end + len(END_THINK):]
    return text[:len(text) - (0 if final else held(text, END_THINK, TOOL_CALL))], None


class Call:
    """One tool call as parsed so far: its name, its parameters [(name, value as JSON text)] and whether it
    is closed. Its arguments (a JSON object's text) only grow as parameters come."""

    def __init__(self, name):
        self.name, self.params, self.closed = name, [], False

    def add(self, name, value):
        if name not in (p for p, _ in self.params):  # a repeated parameter: the first one counts
            self.params.append((name, json.dumps(value, ensure_ascii=False)))

    def arguments(self):
        body = ", ".join(f"{json.dumps(p, ensure_ascii=False)}: {v}" for p, v in self.params)
        return "{" + body + ("}" if self.closed else "")


def typed_value(text, schema):
    """A parameter's text as the JSON value its schema types (vLLM's qwen3_coder rules): strings as they are;
    integers, numbers, booleans parsed; objects and arrays read as JSON (or a Python literal); "null" is null
    where the schema allows it; what does not parse stays text."""
    if not isinstance(schema, dict):
        return text
    options = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else []
    kinds = schema.get("type", [o.get("type") for o in options if isinstance(o, dict)])
    kinds = [str(k).strip().lower() for k in (kinds if isinstance(kinds, list) else [kinds])]
    kind = next((k for k in kinds if k != "null"), "null" if kinds else "string")
    if text.lower() in ("null", "none") and ("null" in kinds or kind not in TEXT_KINDS):
        return None
    if kind in TEXT_KINDS:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text) if re.fullmatch(r"\s*[-+]?\d+\s*", text) else text
        except ValueError:  # over Python's 4300 digits: kept as text, as a value that does not parse
            return text
    if kind.startswith(("num", "float")):
        try:
            v = float(text)
        except ValueError:
            return text
        return text if not math.isfinite(v) else int(v) if v.is_integer() else v
    if kind in ("boolean", "bool", "binary"):
        return text.strip().lower() == "true"  # vLLM: anything but true is false
    for read in (json.loads, ast.literal_eval):
        try:
            v = read(text)
            json.dumps(v)  # only what JSON can hold (not a set, bytes, a complex number)
            return v
        except Exception:  # any parse failure (also RecursionError on deep nesting): try the next, then text
            pass
    return text


class ToolParser:
    """What the tool-call parsers share: an answer cut into text and calls at each TOOL_CALL tag, a call read
    by the parser's call(text, pos, final) from the tag's end: -> (Call, its end or None while what follows is
    not settled), None (the tag is text, no call) or "wait" (not settled: the answer may still make it one)."""

    def parse(self, text, final):
        """-> [text, Call, text, Call, ..., text]: the answer's pieces around its calls, as far as settled."""
        items, start, search = [], 0, 0
        while True:
            i = text.find(TOOL_CALL, search)
            if i < 0:
                tail = text[start:]
                return items + [tail if final else tail[:len(tail) - held(tail, TOOL_CALL)]]
            got = self.call(text, i + len(TOOL_CALL), final)
            if got == "wait":
                return items + [text[start:i]]
            if got is None:  # not a call: the tag is text
                search = i + len(TOOL_CALL)
                continue
            call, end = got
            items += [text[start:i], call]
            if end is None:
                return items + [""]
            start = search = end


class Qwen3CoderParser(ToolParser):
    """vLLM's qwen3_coder parser: <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>, each VALUE typed by the tool's schema. A call counts once its NAME is
    complete; a parameter once its </parameter> is followed by the next tag (a value may hold XML-like text,
    even </parameter>); a call cut off by the end of the answer closes with the parameters it completed."""

    def __init__(self, tools):
        fns = [t["function"] for t in tools or []]
        props = [(f.get("parameters") or {}).get("properties") for f in fns]
        self.schemas = {f["name"]: p if isinstance(p, dict) else {} for f, p in zip(fns, props)}

    def call(self, text, pos, final):
        """The call starting at `pos` -> (Call, end or None if what follows is not settled), None (no call)
        or "wait"."""
        p = skip_space(text, pos)
        if not text.startswith(FUNC, p):
            return "wait" if not final and FUNC.startswith(text[p:]) else None
        q = text.find(">", p + len(FUNC))
        name = text[p + len(FUNC):q if q >= 0 else len(text)]
        if BAD_NAME.search(name) or (q >= 0 and not name) or (q < 0 and final):
            return None
        if q < 0:
            return "wait"
        call, pos = Call(name), q + 1
        while True:
            p = skip_space(text, pos)
            if text.startswith(END_FUNC, p):
                call.closed = True
                p = skip_space(text, p + len(END_FUNC))
                if text.startswith(END_TOOL_CALL, p):
                    return call, p + len(END_TOOL_CALL)
                return call, (None if not final and END_TOOL_CALL.startswith(text[p:]) else p)
            if text.startswith(PARAM, p):
                r = text.find(">", p + len(PARAM))
                end = None if r < 0 or r + 1 == len(text) else self.value_end(text, r + 1, final)
                if end is None:
                    break
                value = text[r + 1 + (text[r + 1] == "\n"):end]
                param = text[p + len(PARAM):r]
                call.add(param, typed_value(value[:-1] if value.endswith("\n") else value,
                                            self.schemas.get(name, {}).get(param)))
                pos = end + len(END_PARAM) if text.startswith(END_PARAM, end) else end
                continue
            nxt = [i for i in (text.find(PARAM, p), text.find(END_FUNC, p)) if i >= 0]  # stray text: skip it
            if not nxt:
                break
            pos = min(nxt)
        call.closed = final  # cut off: at the end of the answer it closes with what it has
        return call, None

    @staticmethod
    def value_end(text, v, final):
        """Where the value starting at `v` ends: at a </parameter> that the next tag follows (another one is
        part of the value); at the end of the answer, also at a </function> closing the call (a forgotten
        </parameter>). None: not settled yet."""
        s = v
        while (e := text.find(END_PARAM, s)) >= 0:
            after = text[skip_space(text, e + len(END_PARAM)):]
            if after.startswith((PARAM, END_FUNC, END_TOOL_CALL)):
                return e
            # the end, or half a tag
            if any(tag.startswith(after) for tag in (PARAM, END_FUNC, END_TOOL_CALL)):
                return e if final else None
            s = e + len(END_PARAM)
        f = text.find(END_FUNC, v)
        while final and f >= 0:
            after = text[skip_space(text, f + len(END_FUNC)):]
            if not after or after.startswith(END_TOOL_CALL):
                return f
            f = text.find(END_FUNC, f + 1)
        return None


class HermesParser(ToolParser):
    """vLLM's hermes parser: <tool_call>{"name": ..., "arguments": {...}}</tool_call>. A call counts once its
    JSON is complete and valid; one that is not stays in the content."""

    def __init__(self, tools):
        pass

    def call(self, text, pos, final):
        """The call whose JSON starts at `pos` and ends at the next END_TOOL_CALL (or the answer's end)."""
        j = text.find(END_TOOL_CALL, pos)
        if j < 0 and not final:
            return "wait"
        call = self.call_json(text[pos:j if j >= 0 else len(text)])
        return None if call is None else (call, None if j < 0 else j + len(END_TOOL_CALL))

    @staticmethod
    def call_json(body):
        try:
            obj = json.loads(body)
            args = obj.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, AttributeError, RecursionError):
            return None
        if not (isinstance(obj.get("name"), str) and obj["name"] and not BAD_NAME.search(obj["name"])
                and isinstance(args, dict)):
            return None
        call = Call(obj["name"])
        for p, v in args.items():
            call.add(p, v)
        call.closed = True
        return call


TOOL_PARSERS = {"qwen3_coder": Qwen3CoderParser, "qwen3_xml": Qwen3CoderParser, "hermes": HermesParser}
REASONING_PARSERS = ("qwen3",)


def content_of(items, final):
    """The content among parsed pieces: text around calls, where whitespace alone next to a call is dropped
    (and waits, not final, while no call has come: it may be the space before one)."""
    texts = items[0::2]
    if len(items) == 1:
        return texts[0] if final or texts[0].strip() else ""
    return "".join(t for t in texts if t.strip())


class ChatStream:
    """A chat answer as OpenAI message fields. feed(text, final) takes the answer so far (the engine's text)
    and returns what is new since the last feed: {"reasoning", "content", "tool_calls"}. `start`: where the
    answer starts (prompt_reasoning; None: no reasoning parser); `parser`: a tool parser, or None; `max_calls`:
    the calls after so many are dropped, whole and streamed (parallel_tool_calls false: 1, as vLLM), or None."""

    def __init__(self, start=None, parser=None, max_calls=None):
        self.start, self.parser, self.max_calls = start, parser, max_calls
        self.reasoning, self.content, self.calls = "", None, []  # everything sent, for the whole message

    def feed(self, text, final):
        reasoning, content = ("", text) if self.start is None else split_reasoning(text, self.start, final)
        calls = []
        if content is not None and self.parser is not None:
            items = self.parser.parse(content, final)
            content, calls = content_of(items, final), items[1::2][:self.max_calls]
        delta = {}
        if len(reasoning) > len(self.reasoning):
            delta["reasoning"], self.reasoning = reasoning[len(self.reasoning):], reasoning
        if content is not None:
            new = content[len(self.content or ""):]
            if new:
                delta["content"] = new
            self.content = content
        deltas = []
        for i, call in enumerate(calls):
            args = call.arguments()
            if i == len(self.calls):
                self.calls.append({"id": "chatcmpl-tool-" + uuid.uuid4().hex, "type": "function",
                                   "function": {"name": call.name, "arguments": args}})
                deltas.append({"index": i, **self.calls[i]})
            elif len(args) > len(self.calls[i]["function"]["arguments"]):
                sent = self.calls[i]["function"]["arguments"]
                deltas.append({"index": i, "function": {"arguments": args[len(sent):]}})
                self.calls[i]["function"]["arguments"] = args
        if deltas:
            delta["tool_calls"] = copy.deepcopy(deltas)
        return delta


# ==============================================================================================
# The Responses API (POST /v1/responses): vLLM's stateless form, through the chat path
# ==============================================================================================
# A request becomes a chat request (instructions -> a system message, input items -> messages, function tools
# -> chat tools, max_output_tokens -> max_tokens, text.format -> response_format); its answer, split by the
# same parsers, becomes output items: a reasoning item, a message with its output_text, function_call items.
# As in vLLM without VLLM_ENABLE_RESPONSES_API_STORE, nothing is stored: `store` is accepted and ignored, and
# what needs a stored response (background, previous_response_id, GET /v1/responses/{id}) is refused.

PASSED_TO_CHAT = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "logit_bias", "chat_template_kwargs", "include_reasoning",
                  "parallel_tool_calls", "ignore_eos", "min_tokens", "stream", "structured_outputs",
                  "include_stop_str_in_output")
# A chat field an error names -> the Responses field it came from (response_to_chat)
CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def open_turn(msgs):
    """Is the last message an assistant turn holding only reasoning so far (a Responses reasoning item), which the
    answer or calls after it join (as vLLM)?"""
    return bool(msgs) and msgs[-1]["role"] == "assistant" and msgs[-1]["content"] is None \
        and "reasoning_content" in msgs[-1] and not msgs[-1].get("tool_calls")


def response_messages(body):
    """instructions and input (a string or a list of items) -> chat messages."""
    msgs = []
    instructions = get(body, "instructions", "string")
    if instructions is not None:
        msgs.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not (isinstance(items, list) and items and all(isinstance(i, dict) for i in items)):
        raise bad("'input' must be a string or a non-empty list of items (messages, function_call, "
                  "function_call_output)", "input")
    for n, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):  # a null text is refused, not skipped: vLLM's request model refuses it
                if not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
                           for p in content):
                    raise bad(f"input[{n}]: content parts must be {{\"type\": \"input_text\", \"text\": ...}} "
                              "(images and files are not supported: specdec's models read text)", "input")
                content = "".join(p["text"] for p in content)
            if item.get("role") == "assistant" and open_turn(msgs):
                msgs[-1]["content"] = content  # the answer after its reasoning: one assistant turn
            else:
                msgs.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if open_turn(msgs) or (msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls")):
                msgs[-1].setdefault("tool_calls", []).append(call)  # parallel calls, reasoning: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad(f"input[{n}]: a function_call_output's 'output' must be a string", "input")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":  # the assistant turn's reasoning (the template shows it after the last query)
            parts = item.get("content") or []
            text = "".join(p.get("text") or "" for p in parts if isinstance(p, dict)) if isinstance(parts, list) else ""
            if text:
                msgs.append({"role": "assistant", "content": None, "reasoning_content": text})
        else:
            raise bad(f"input[{n}]: item type {short(kind)} is not supported (message, function_call, "
                      "function_call_output, reasoning)", "input")
    return msgs


def response_to_chat(body):
    """A /v1/responses body -> the /v1/chat/completions body that runs it."""
    if body.get("background"):
        raise bad("background mode needs stored responses, which this server does not keep (vLLM: "
                  "VLLM_ENABLE_RESPONSES_API_STORE); send the request without 'background'", "background")
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id needs stored responses, which this server does not keep: send the "
                  "conversation so far in 'input'", "previous_response_id")
    chat = {k: body[k] for k in PASSED_TO_CHAT if k in body}
    truncation = body.get("truncation", "disabled")
    if truncation not in ("auto", "disabled"):
        raise bad(f"'truncation' must be \"auto\" or \"disabled\", got {short(truncation)}", "truncation")
    if truncation == "auto":  # vLLM: the input's last max_model_len tokens
        chat["truncate_prompt_tokens"] = -1
    chat["messages"] = response_messages(body)
    # read here, by its own name: a value of another type is named as vLLM's pydantic names it (max_output_tokens);
    # one below 1 gets the chat path's "max_tokens must be at least 1", vLLM's too (its SamplingParams' check)
    max_output_tokens = get(body, "max_output_tokens", "integer")
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    tools = body.get("tools")
    if tools is not None:
        if not (isinstance(tools, list) and all(isinstance(t, dict) and t.get("type") == "function"
                                                and isinstance(t.get("name"), str) for t in tools)):
            raise bad('\'tools\' must be a list of {"type": "function", "name": ..., "parameters": {...}} '
                      "objects (built-in tools are not supported)", "tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                      "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = get(get(body, "text", "object", {}), "format", "object", within="text")
    if fmt is not None and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif fmt is not None:
        chat["response_format"] = fmt
    return chat


def response_usage(n_prompt, n_out, n_reasoning=0):
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": n_reasoning}, "total_tokens": n_prompt + n_out}


def reasoning_tokens(app, spec, ids):
    """How many of the answer's tokens ids are reasoning, as vLLM's reasoning parser counts them
    (count_reasoning_tokens): those inside <think> ... </think>, the answer starting inside one where the prompt
    opened it; the tags themselves not counted. 0 without --reasoning-parser."""
    if spec.start is None:
        return 0
    think, end = app.tokenizer.special_ids[THINK], app.tokenizer.special_ids[END_THINK]
    depth, n = int(spec.start == "thinking"), 0
    for t in ids:
        if t == think:
            depth += 1
        elif t == end:
            depth = max(0, depth - 1)
        elif depth:
            n += 1
    return n


class ResponseItems:
    """A response's output items, built from ChatStream's deltas (reasoning, content, tool_calls) in the order
    they come; events(delta) -> the streaming events they make (their types and fields as OpenAI's), close()
    -> the events that finish the open item. Text after a call opens a new message."""

    def __init__(self):
        self.items, self.open, self.calls = [], None, {}  # calls: a tool call's index -> its item

    def _start(self, item, events):
        events += self.close()
        self.items.append(item)
        self.open = item
        added = dict(copy.deepcopy(item), **({"content": []} if item["type"] == "message" else {}))
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": added})
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})

    def close(self):
        item, events = self.open, []
        if item is None:
            return events
        i, self.open = self.items.index(item), None
        item["status"] = None if item["type"] == "reasoning" else "completed"  # vLLM: a reasoning item has none
        if item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": i,
                           "content_index": 0, "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": i,
                        "content_index": 0, "text": part["text"], "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": i,
                        "content_index": 0, "part": copy.deepcopy(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": i, "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(item)})
        return events

    def events(self, delta):
        events = []
        if delta.get("reasoning"):
            if self.open is None or self.open["type"] != "reasoning":
                self._start({"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}, events)
            self.open["content"][0]["text"] += delta["reasoning"]
            events.append({"type": "response.reasoning_text.delta", "item_id": self.open["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": delta["reasoning"]})
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                self._start({"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                             "status": "in_progress",
                             "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]},
                            events)
            self.open["content"][0]["text"] += delta["content"]
            events.append({"type": "response.output_text.delta", "item_id": self.open["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": delta["content"],
                           "logprobs": []})
        for call in delta.get("tool_calls", []):
            item = self.calls.get(call["index"])
            if item is None:
                item = self.calls[call["index"]] = {
                    "id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": "call_" + uuid.uuid4().hex,
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                self._start(item, events)
            more = call["function"].get("arguments", "")
            if more:
                item["arguments"] += more
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "delta": more})
        return events


# ==============================================================================================
# Metrics: vLLM's Prometheus names, kept by hand (text format 0.0.4)
# ==============================================================================================

TTFT, ITL = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
E2E, QUEUE = "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"
PREFILL, DECODE = "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"
INFERENCE = "vllm:request_inference_time_seconds"
# per request, at its end: its prompt and generation tokens, its max_tokens and n, its mean time per output token;
# per step: the tokens it processed (a prompt's counted in the step that ends its prefill)
PROMPT_N, GEN_N = "vllm:request_prompt_tokens", "vllm:request_generation_tokens"
MAX_TOKENS, N_PARAM = "vllm:request_params_max_tokens", "vllm:request_params_n"
TPOT, STEP_TOKENS = "vllm:request_time_per_output_token_seconds", "vllm:iteration_tokens_total"
BUCKETS = {TTFT: TTFT_BUCKETS,  # vLLM's (TTFT's and the request latencies' as LLM.get_metrics has them)
           ITL: [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0],
           E2E: REQUEST_BUCKETS, QUEUE: REQUEST_BUCKETS, PREFILL: REQUEST_BUCKETS, DECODE: REQUEST_BUCKETS,
           INFERENCE: REQUEST_BUCKETS}
HISTOGRAM_DOCS = {PROMPT_N: "Number of prefill tokens processed.", GEN_N: "Number of generation tokens processed.",
                  MAX_TOKENS: "Histogram of the max_tokens request parameter.",
                  N_PARAM: "Histogram of the n request parameter.",
                  TPOT: "Histogram of time_per_output_token_seconds per request.",
                  STEP_TOKENS: "Histogram of number of tokens per engine_step.",
                  TTFT: "Histogram of time to first token in seconds.",
                  ITL: "Histogram of inter-token latency in seconds.",
                  E2E: "Histogram of e2e request latency in seconds.",
                  QUEUE: "Histogram of time spent in WAITING phase for request.",
                  PREFILL: "Histogram of time spent in PREFILL phase for request.",
                  DECODE: "Histogram of time spent in DECODE phase for request.",
                  INFERENCE: "Histogram of time spent in RUNNING phase for request."}


def one_two_five(most):
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return out
            out.append(m * scale)
        scale *= 10


class Metrics:
    """Written by the engine thread, read by GET /metrics, under one lock."""

    def __init__(self, model_name, num_spec_tokens, max_model_len=4096):
        esc = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels, self.k, self.lock = f'model_name="{esc}",engine="0"', num_spec_tokens, threading.Lock()
        self.running = self.waiting = self.prompt_tokens = self.generation_tokens = 0
        self.kv_usage = 0.0  # slot positions in use / all of them
        self.success = dict.fromkeys(("stop", "length", "abort", "error"), 0)
        tokens = one_two_five(max_model_len)  # vLLM's build_1_2_5_buckets(max_model_len)
        self.buckets = dict(BUCKETS, **{PROMPT_N: tokens, GEN_N: tokens, MAX_TOKENS: tokens, N_PARAM: [1, 2, 5, 10, 20],
                                        TPOT: BUCKETS[ITL], STEP_TOKENS: [1 << i for i in (0, *range(3, 15))]})
        self.hist = {name: [[0] * len(b), 0.0, 0] for name, b in self.buckets.items()}  # cumulative counts, sum, n
        self.seen = (0, 0)  # (generation tokens, prompt tokens) at the end of the last step (STEP_TOKENS)
        self.spec = (0, 0, 0, [0] * self.k)  # drafts, draft tokens, accepted tokens, accepted per position

    def _observe(self, name, v):
        h = self.hist[name]
        h[0] = [c + (v <= b) for c, b in zip(h[0], self.buckets[name])]
        h[1] += v
        h[2] += 1

    def on_update(self, job, req, n_new, now, t_step):
        """Once per step that gave `req` tokens (a step that started at t_step): TTFT and the queue and
        prefill times on the first (admitted at job.t_scheduled, set by EngineLoop when a chunked prefill
        spans steps, else in this step), then one ITL per step; the decode and inference times at the end (as
        vLLM)."""
        with self.lock:
            self.generation_tokens += n_new
            if job.t_last is None:
                self.prompt_tokens += len(req.prompt_ids)
                job.t_scheduled = t_step if job.t_scheduled is None else job.t_scheduled
                job.t_first = now
                self._observe(TTFT, now - job.t_arrival)
                self._observe(QUEUE, job.t_scheduled - job.t_arrival)
                self._observe(PREFILL, now - job.t_scheduled)
            else:
                self._observe(ITL, now - job.t_last)
            if req.finished:
                self.success[req.finish_reason] = self.success.get(req.finish_reason, 0) + 1
                self._observe(E2E, now - job.t_arrival)
                self._observe(DECODE, now - job.t_first)
                self._observe(INFERENCE, now - job.t_scheduled)
                n_out = len(req.output_ids)
                self._observe(PROMPT_N, len(req.prompt_ids))
                self._observe(GEN_N, n_out)
                self._observe(TPOT, (now - job.t_first) / (n_out - 1) if n_out > 1 else 0.0)
                if job.params.max_tokens is not None:
                    self._observe(MAX_TOKENS, job.params.max_tokens)
                if job.fork_of is None:  # once a request (its first sample), with its n
                    self._observe(N_PARAM, job.n_samples)
        job.t_last = now

    def after_step(self, eng):
        per_pos = list(eng.stats.accepted_per_pos)
        spec = (eng.stats.num_drafts, eng.stats.num_draft_tokens, eng.stats.num_accepted_tokens,
                per_pos + [0] * (self.k - len(per_pos)))
        prefilling = set(map(id, eng.prefilling))  # their KV holds the pieces prefilled so far
        used = sum(r.prefilled if id(r) in prefilling else len(r.tokens) for r in eng.slots if r is not None)
        with self.lock:
            step = (self.generation_tokens, self.prompt_tokens)
            if step != self.seen:  # (a step that made no token, e.g. a prefill's first piece, is not counted)
                self._observe(STEP_TOKENS, sum(step) - sum(self.seen))
            self.seen = step
            self.running, self.waiting = sum(r is not None for r in eng.slots), len(eng.waiting)
            self.kv_usage = used / (eng.max_num_seqs * eng.max_model_len)
            self.spec = spec

    def count_end(self, reason):  # ended by the server: "abort" (its client left) or "error" (it failed)
        with self.lock:
            self.success[reason] += 1

    def render(self):
        out = []

        def family(name, kind, doc, samples):  # samples: (name suffix, extra labels, value)
            named = name + "_total" if kind == "counter" else name  # a counter's lines as prometheus_client's
            out.extend([f"# HELP {named} {doc}", f"# TYPE {named} {kind}"])
            out.extend(f"{name}{sfx}{{{self.labels}{extra}}} {float(v)!r}" for sfx, extra, v in samples)
        with self.lock:
            family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [("", "", self.running)])
            family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [("", "", self.waiting)])
            family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   [("", "", self.kv_usage)])
            family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
                   [("_total", "", self.prompt_tokens)])
            family("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                   [("_total", "", self.generation_tokens)])
            family("vllm:request_success", "counter", "Count of successfully processed requests.",
                   [("_total", f',finished_reason="{r}"', n) for r, n in self.success.items()])
            # (no preemption: a request keeps its slot to the end; no prefix cache)
            family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
                   [("_total", "", 0)])
            family("vllm:prefix_cache_queries", "counter",
                   "Prefix cache queries, in terms of number of queried tokens.", [("_total", "", 0)])
            family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
                   [("_total", "", 0)])
            for name, (counts, total, n) in self.hist.items():
                family(name, "histogram", HISTOGRAM_DOCS[name],
                       [("_bucket", f',le="{float(b)!r}"', c) for b, c in zip(self.buckets[name], counts)]
                       + [("_bucket", ',le="+Inf"', n), ("_sum", "", total), ("_count", "", n)])
            if self.k:  # as in vLLM, only with a speculative config
                for what, v in zip(("drafts", "draft_tokens", "accepted_tokens"), self.spec):
                    family(f"vllm:spec_decode_num_{what}", "counter", f"Number of spec decoding {what}.",
                           [("_total", "", v)])
                family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                       "Accepted tokens per draft position.",
                       [("_total", f',position="{i}"', v) for i, v in enumerate(self.spec[3])])
        return "\n".join(out) + "\n"


class StatsLog:
    """vLLM's periodic log lines, every VLLM_LOG_STATS_INTERVAL seconds (10 by default; none with
    --disable-log-stats): the engine's prompt and generation throughput over the interval, the running and
    waiting requests and the KV-cache usage now (specdec has no prefix cache: its hit rate is 0), then, if the
    interval had drafts, the spec-decode counters with their accepted and drafted throughputs. An idle interval
    after an idle one prints nothing (vLLM logs those at debug level)."""

    def __init__(self, interval):
        self.interval, self.t, self.last, self.tokens, self.busy = interval, time.monotonic(), SpecStats(), (0, 0), 0

    def tick(self, metrics, stats, now):
        if now - self.t < self.interval:
            return
        with metrics.lock:
            tokens = (metrics.prompt_tokens, metrics.generation_tokens)
            running, waiting, kv = metrics.running, metrics.waiting, metrics.kv_usage
        prompt, gen = ((a - b) / (now - self.t) for a, b in zip(tokens, self.tokens))
        last, per_pos = self.last, list(stats.accepted_per_pos)
        delta = SpecStats(stats.num_drafts - last.num_drafts, stats.num_draft_tokens - last.num_draft_tokens,
                          stats.num_accepted_tokens - last.num_accepted_tokens,
                          [a - b for a, b in zip(per_pos, last.accepted_per_pos + [0] * len(per_pos))])
        if prompt or gen or self.busy:
            print(f"Engine 000: Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {gen:.1f} "
                  f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: {100 * kv:.1f}%, "
                  f"Prefix cache hit rate: 0.0%", file=sys.stderr, flush=True)
            if delta.num_drafts:
                print(delta.summary(now - self.t), file=sys.stderr, flush=True)
        self.busy = prompt or gen
        self.t, self.tokens, self.last = now, tokens, dataclasses.replace(stats, accepted_per_pos=per_pos)


# ==============================================================================================
# The engine thread
# ==============================================================================================

# What a handler learns from one engine step: the request's text so far (an immutable str, so a consistent
# snapshot), the new token ids and their logprobs (None if not asked for), output tokens so far, finish state.
Update = namedtuple("Update", "text ids logprobs n finish_reason stop_reason")


class Job:
    """One HTTP request's link to the engine."""

    def __init__(self, prompt_ids, params):
        self.prompt_ids, self.params, self.t_arrival = prompt_ids, params, time.perf_counter()
        self.events = queue.Queue()  # engine thread -> handler: ("accepted" | "update" | "error", payload)
        self.req, self.done, self.n_seen, self.t_last = None, False, 0, None  # engine-thread state
        self.ranked = False  # one of best_of samples: its cumulative logprob is counted
        self.fork_of = None  # n > 1: the first sample's job, whose prefill this one copies
        self.t_scheduled = self.t_first = None  # (engine thread) its first step began, its first token came
        self.echo_only = False  # completions' echo with max_tokens 0 (vLLM): the answer is the prompt alone
        self.n_samples = 1  # the request's n (the first sample's job counts it in /metrics)
        self.return_ids = False  # vLLM's return_token_ids: the answer's token ids (and the prompt's) in its choices
        self.as_ids = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
        self.bad_words_ids = None  # the bad words' token sequences, tokenized by the handler (EngineLoop.check)
        self.checked = False  # checked by its handler as the engine will check it (EngineLoop.check)


def device_fault(e):
    """Whether `e` leaves the device unusable: a CUDA error (an illegal address, a device-side assert) poisons
    the CUDA context, so no later step can succeed and only a new process helps. Anything else (a ValueError,
    an out-of-memory error) is a fault of the requests being served."""
    return isinstance(e, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(e)


class EngineLoop:
    def __init__(self, llm, max_queue, metrics, stats_log=None):
        self.engine, self.metrics, self.max_queue, self.stats_log = llm.engine, metrics, max_queue, stats_log
        self.t_step = None              # when the current step began (time.perf_counter())
        self.inbox = queue.Queue()      # handler threads -> engine thread: ("add" | "abort", job)
        self.lock = threading.Lock()    # guards inflight and dead
        self.compile_lock = threading.Lock()  # handler threads' grammar compiles (_compile)
        self.inflight = 0               # submitted and not finished: running + waiting
        self.dead = None                # why the engine thread stopped
        self.live = set()               # jobs inside the engine (engine thread only)
        threading.Thread(target=self.run, name="engine", daemon=True).start()

    def check(self, job):
        """(Handler thread) Refuse, with a 400, a job the engine would refuse as it adds it: a grammar that cannot be
        compiled, a bad word of no tokens, a prompt empty, out of the vocabulary or too long for the context. A
        request's handler checks every job of it this way before it submits any (a batch's later prompt bad: nothing
        of it runs, or is counted in /metrics, as in vLLM, which validates every prompt first); submit checks the
        job too, if its handler did not."""
        if job.params.structured_outputs is not None:
            self._compile(job.params.structured_outputs)
        if job.params.bad_words and job.bad_words_ids is None:  # tokenized here, not in the loop stepping every request
            try:  # (a sample of n > 1: its first sample's, submitted before it)
                job.bad_words_ids = job.fork_of.bad_words_ids if job.fork_of is not None else \
                    self.engine.bad_words_token_ids(job.params.bad_words)
            except ConfigError as e:
                raise bad(str(e), "bad_words") from None
        try:  # (the engine's own checks, as add_request makes them on the engine thread)
            self.engine.check_request(job.prompt_ids, job.params)
        except ConfigError as e:
            raise bad(str(e)) from None
        job.checked = True

    def submit(self, job):
        """(Handler thread) Queue a job in the engine; raises ApiError 400 (e.g. too long) or 503 (full)."""
        if not job.checked:
            self.check(job)
        with self.lock:
            if self.dead:
                raise ApiError(503, f"the engine has stopped ({self.dead})")
            if self.inflight >= self.engine.max_num_seqs + self.max_queue:
                raise ApiError(503, f"the server is at capacity: {self.inflight} requests are running or "
                                    f"waiting (--max-num-seqs {self.engine.max_num_seqs} + --max-queue "
                                    f"{self.max_queue}); retry later")
            self.inflight += 1
            self.inbox.put(("add", job))
        kind, err = job.events.get()
        if kind == "error":
            raise err

    def _compile(self, so):
        """(Handler thread) Compile a request's grammar here first: the engine thread's compile when it adds the
        request is then a hit in xgrammar's cache (4 ms for an enum of 5000 strings whose first compile took 0.8 s),
        so a large grammar costs its own request the time, not every request in flight, which the engine thread
        steps (xgrammar lets go of the GIL while it compiles). The engine's compiler is made once, under compile_lock;
        the compiles themselves run at once (xgrammar's compiler takes several threads), so that a grammar of
        seconds does not hold up every other request with one (before, a choice of 100,000 strings kept a small
        one waiting 34 s, after its own client had left). A grammar that cannot be compiled: a 400, as from the
        engine."""
        try:
            with self.compile_lock:  # (the compiler, made by the engine's first compile: of a one-choice grammar)
                if self.engine.grammars is None:
                    self.engine.grammar(StructuredOutputsParams(choice=["x"]))
            self.engine.grammar(so)
        except ConfigError as e:
            raise bad(str(e)) from None

    def abort(self, job, counted=True):
        """(Handler thread) The client left: free the job's slot (a no-op once it finished). counted=False: the
        request was refused (a later sequence of it did not fit or was bad), so it never ran as far as vLLM counts:
        no "abort" in /metrics."""
        self.inbox.put(("abort" if counted else "withdraw", job))

    def run(self):
        eng = self.engine
        try:
            while True:
                for kind, job in self.commands():
                    self._add(job) if kind == "add" else self._abort(job, counted=kind == "abort")
                if eng.has_work():
                    batch, waiting = [r for r in eng.slots if r is not None], list(eng.waiting)
                    self.t_step = time.perf_counter()
                    try:
                        eng.step()
                    except Exception as e:
                        if device_fault(e):
                            raise
                        self._fail_step(e, batch, waiting)
                    for job in self.live:  # admitted to a slot in this step (its prefill may take more)
                        if job.t_scheduled is None and job.req.slot is not None:
                            job.t_scheduled = self.t_step
                self.metrics.after_step(eng)
                if self.stats_log is not None:
                    self.stats_log.tick(self.metrics, eng.stats, time.monotonic())
        except BaseException as e:  # a device fault, or a fault of this loop itself: nothing can go on
            self._exit(e)

    def commands(self):
        """The handlers' commands: those waiting; idle, the first to come (sleeping on the inbox, but no
        longer than the stats log's interval, so that its last lines get written)."""
        if self.engine.has_work():
            return list(drain(self.inbox))
        try:
            first = self.inbox.get(timeout=None if self.stats_log is None else self.stats_log.interval)
        except queue.Empty:
            return []
        return [first] + list(drain(self.inbox))

    def _fail_step(self, e, batch, waiting):
        """A step raised: end the requests it was serving with a 500, keep the rest. A step first prefills
        (each request's prompt into its own slot, freshly reset at its first piece), then runs one batched
        step for the running requests. A fault in a request's own prefill names it (e.failed_request): it
        alone ends. Otherwise the batched step (or an admitted request's first token) failed, and every
        request it touched ends: its state may be a part of a step ahead of its tokens, and going on could
        silently give wrong tokens. Requests still waiting are untouched."""
        traceback.print_exc()
        admitted = [r for r in waiting if r.slot is not None]
        own = getattr(e, "failed_request", None)  # set by Engine._prefill
        failed = [own] if own is not None else batch + admitted
        err = ApiError(500, f"the engine failed while serving this request: {type(e).__name__}: {e}")
        for job in [job for job in self.live if job.req in failed]:
            self.engine.abort(job.req)
            self.metrics.count_end("error")
            self._release(job)
            job.events.put(("error", err))

    def _exit(self, e):
        """An unrecoverable fault: answer every request in flight with a 500, say why in one line, and exit
        non-zero so that a supervisor restarts the server (as vLLM's does) rather than it lingering at 503."""
        traceback.print_exc()
        with self.lock:
            self.dead = f"{type(e).__name__}: {e}"
            pending = [job for kind, job in drain(self.inbox) if kind == "add"]
        # one write, before any handler is woken to answer (and log) its 500: the line stays whole in the log
        sys.stderr.write(f"specdec server: fatal engine error, exiting: {' '.join(self.dead.split())}\n")
        sys.stderr.flush()
        for job in list(self.live) + pending:
            job.events.put(("error", ApiError(500, f"the engine failed: {self.dead}")))
        time.sleep(0.5)  # the handlers' 500s go out
        os._exit(1)

    def _add(self, job):
        try:
            parent = job.fork_of.req if job.fork_of is not None else None
            job.req = self.engine.add_request(job.prompt_ids, job.params, fork_of=parent,
                                              bad_words_ids=job.bad_words_ids)
        except Exception as e:  # ConfigError: too long for the context, a token id out of range, no prompt
            if device_fault(e):
                raise
            if not isinstance(e, ConfigError):
                traceback.print_exc()
            self._release(job)
            err = bad(str(e)) if isinstance(e, ConfigError) else \
                ApiError(500, f"the engine refused this request: {type(e).__name__}: {e}")
            return job.events.put(("error", err))
        if job.ranked:  # best_of ranks the samples by their cumulative logprob
            job.req.cumulative_logprob = 0.0
        job.req.on_update = lambda req, n_new: self._on_update(job, req, n_new)
        self.live.add(job)
        job.events.put(("accepted", None))

    def _on_update(self, job, req, n_new):
        self.metrics.on_update(job, req, n_new, time.perf_counter(), self.t_step)
        k, job.n_seen = job.n_seen, len(req.output_ids)
        lps = None if req.logprobs is None else req.logprobs[k:]
        job.events.put(("update", Update(req.text, req.output_ids[k:], lps, job.n_seen, req.finish_reason,
                                         req.stop_reason)))
        if req.finished:
            self._release(job)

    def _abort(self, job, counted=True):
        if not job.done:
            self.engine.abort(job.req)
            if counted:
                self.metrics.count_end("abort")
            self._release(job)

    def _release(self, job):
        job.done = True
        self.live.discard(job)
        with self.lock:
            self.inflight -= 1


def drain(q):
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


# ==============================================================================================
# Response bodies
# ==============================================================================================

def usage(n_prompt, n_out):
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": None}


def choice(body, logprobs, finish_reason, stop_reason, index=0):
    """One choice: `body` is {"text"} (completions), {"message"} or {"delta"} (chat)."""
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_delta(delta, spec):
    """ChatStream's delta in the wire's names: the reasoning as vLLM's `reasoning` and `reasoning_content`."""
    out = {}
    if delta.get("reasoning") and spec.include_reasoning:
        out["reasoning_content"] = out["reasoning"] = delta["reasoning"]
    return {**out, **{k: delta[k] for k in ("content", "tool_calls") if k in delta}}


def chat_message(chat, spec, echo=None):
    """The whole answer (ChatStream fed it with final=True) as the message of spec.role; echo (chat_echo): the
    text before the content (with echo the content is never null, as vLLM's)."""
    reasoning = (chat.reasoning or None) if spec.include_reasoning else None
    parsed = spec.start is not None or spec.parser is not None  # a parser may leave no content at all
    content = (chat.content or None) if parsed else chat.content
    if isinstance(spec.parser, JsonCalls):  # vLLM's message for calls read from JSON: content ""
        content = content or ""
    return {"role": spec.role, "content": content if echo is None else echo + (content or ""),
            "reasoning_content": reasoning, "reasoning": reasoning, "tool_calls": chat.calls}


def chat_finish(finish, chat, spec):
    """vLLM's finish_reason "tool_calls" when tool_choice auto or required called tools (a named function's
    call stays "stop"; an answer that max_tokens cut off stays "length": its last call may miss
    parameters)."""
    called = chat.calls and spec.tool_choice in ("auto", "required")
    return "tool_calls" if finish == "stop" and called else finish


def prompt_logprobs_json(lps):
    """A request's prompt logprobs as vLLM sends them: None for the first token, then {token id: {logprob,
    rank, decoded_token}} per token (-inf as -9999.0: JSON has no infinity)."""
    entry = lambda v: {"logprob": max(v.logprob, -9999.0), "rank": v.rank, "decoded_token": v.decoded_token}
    return [None if d is None else {str(t): entry(v) for t, v in d.items()} for d in lps]


class LogprobFormat:
    """The engine's per-token {token_id: Logprob} (top-N first, then the chosen token) in OpenAI's shapes:
    completions {tokens, token_logprobs, top_logprobs, text_offset}, chat {content: [{token, logprob, bytes,
    top_logprobs}]}. Called once per stream chunk (text_offset keeps counting) or once for a whole answer."""

    def __init__(self, tok, chat, n_top, as_ids=False):
        self.tok, self.chat, self.n_top, self.offset, self.as_ids = tok, chat, n_top, 0, as_ids

    def __call__(self, ids, lps):
        if self.n_top is None:
            return None
        lp = lambda v: max(v.logprob, -9999.0)  # -inf is not JSON
        # vLLM's return_tokens_as_token_ids: each token as "token_id:N" (and its bytes those of that text)
        text = (lambda t: f"token_id:{t}") if self.as_ids else (lambda t: self.tok.decode([t]))
        raw = (lambda t: list(text(t).encode())) if self.as_ids else (lambda t: list(self.tok.token_bytes(t)))
        if self.chat:
            entry = lambda t, v: {"token": text(t), "logprob": lp(v), "bytes": raw(t)}
            top = lambda d: [entry(i, v) for i, v in list(d.items())[:self.n_top]]
            return {"content": [dict(entry(t, d[t]), top_logprobs=top(d)) for t, d in zip(ids, lps)]}
        # an echoed prompt's first token has no logprob (None), as in vLLM
        out = {"tokens": [text(t) for t in ids],
               "token_logprobs": [None if d is None else lp(d[t]) for t, d in zip(ids, lps)],
               "top_logprobs": [None if d is None else {text(i): lp(v) for i, v in d.items()} for d in lps],
               "text_offset": []}
        for s in out["tokens"]:
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


# ==============================================================================================
# HTTP
# ==============================================================================================

ROUTES = {"/health": ("GET", "health"), "/ping": ("GET POST", "health"), "/version": ("GET", "version"),
          "/v1/models": ("GET", "models"), "/metrics": ("GET", "metrics"),
          "/v1/completions": ("POST", "completions"), "/v1/chat/completions": ("POST", "chat"),
          "/v1/responses": ("POST", "responses_api"), "/tokenize": ("POST", "tokenize"),
          "/detokenize": ("POST", "detokenize"), "/invocations": ("POST", "invocations")}
CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")
DROP_MAX = 1 << 20  # an unread body up to this size is read and dropped after an early answer (see drop_body)


class DeadlineReader(io.RawIOBase):
    """A connection's read side on which every read waits only until `deadline` (time.monotonic(); None: no
    limit). A per-read timeout would let a client that trickles a byte a second hold its thread for ever; a
    deadline bounds the whole request head, then the whole body."""

    def __init__(self, sock):
        self.sock, self.deadline = sock, None

    def readable(self):
        return True

    def readinto(self, buf):
        if self.deadline is not None:
            self.sock.settimeout(max(self.deadline - time.monotonic(), 1e-6))  # then recv raises TimeoutError
        return self.sock.recv_into(buf)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server_version = "specdec"
    default_request_version = "HTTP/1.0"  # a refusal before the version is read still has a status line
    unread = 0  # bytes of the request's body not read yet
    streaming = chunked = False  # the answer is an SSE stream; in chunks (HTTP/1.1)

    def setup(self):
        super().setup()
        # no Nagle: an answer's headers and body go out as two writes, and on a kept-alive connection the second
        # waited for the client's delayed ACK of the first (~40 ms more for every non-streamed answer)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self):
        self.reader.deadline = time.monotonic() + self.server.request_timeout  # for the line and headers
        super().handle_one_request()  # on a timeout it closes the connection without an answer

    def parse_request(self):
        self.command, self.request_version = None, self.default_request_version
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")  # as the stdlib reads it
        if len(self.requestline.split()) not in (0, 3):  # garbage, or HTTP/0.9's "GET /" (no status line)
            self.send_error(400, "Bad request line: expected 'METHOD /path HTTP/1.1'")
            return False
        return super().parse_request()

    def handle_expect_100(self):
        return True  # "100 Continue" goes out in read_body, once the head passed every check (the key first)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (a bad request line or header, an unknown method), in JSON."""
        self.close_connection = True
        self.send(code, http_error(code, message or HTTPStatus(code).phrase).body)

    def dispatch(self):
        """Check the request's head (framing, key, route, method, type, size), then read the body and run the
        route. Everything checked before the body is read: a refused request costs no more than its head."""
        app, path, self.streaming = self.server.app, urlsplit(self.path).path, False
        try:
            self.unread = self.content_length()
            origin, method = self.headers.get("Origin"), self.headers.get("Access-Control-Request-Method")
            if self.command == "OPTIONS" and origin is not None and method is not None:  # a CORS preflight
                status, body, headers = app.cors.preflight(origin, method,
                                                           self.headers.get("Access-Control-Request-Headers"))
                return self.send(status, body, "text/plain; charset=utf-8", headers)
            if path.startswith("/v1") and not app.authorized(self.headers.get("Authorization")):
                return self.send(401, {"error": "Unauthorized"})
            if path not in ROUTES and path.startswith("/v1/responses/"):  # retrieve, cancel: nothing is stored
                raise ApiError(404, f"Response with id '{path.split('/')[3]}' not found. (This server keeps no "
                               "responses, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE.)")
            if path not in ROUTES:
                raise http_error(404, f"Not Found: {path}")
            methods, name = ROUTES[path]
            allowed = methods.split() + (["HEAD"] if "GET" in methods else [])
            if self.command not in allowed:
                raise http_error(405, f"Method Not Allowed: {self.command} {path}", Allow=", ".join(allowed))
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if self.command == "POST" and name != "health" and ctype != "application/json":
                raise http_error(415, "Unsupported Media Type: Only 'application/json' is allowed")
            getattr(self, name)(app, self.read_body())
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client left, or stopped reading
            self.close_connection = True
        except Exception as e:
            if not isinstance(e, ApiError):  # a bug: the traceback goes to the log, never to the client
                traceback.print_exc()
                e = ApiError(500, f"internal server error ({type(e).__name__}); see the server log")
            try:
                if self.streaming:  # the headers are out: report in the stream, as vLLM does
                    self.end_stream(e.body)
                else:
                    self.send(e.status, e.body, headers=e.headers)
            except OSError:
                self.close_connection = True

    # every method HTTP defines reaches dispatch (405 or 404 there); any other gets the stdlib's 501
    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = dispatch

    def content_length(self):
        """The body's length, refusing what RFC 9112 refuses: several or malformed Content-Length values (a
        request-smuggling vector), a Transfer-Encoding (chunked request bodies are not supported here)."""
        lengths, coding = self.headers.get_all("Content-Length", []), self.headers.get("Transfer-Encoding")
        valid = all(CONTENT_LENGTH.fullmatch(v.strip()) for v in lengths)
        if coding is not None or len(lengths) > 1 or not valid:
            self.close_connection = True  # where the body ends is unknown: nothing more can be read
            if coding is not None and not lengths:
                raise http_error(411, "Length Required: send the body with a Content-Length (chunked request "
                                      "bodies are not supported)")
            raise http_error(400, "Bad Request: a request needs one valid Content-Length (or none) and no "
                                  f"Transfer-Encoding, got Content-Length {lengths}, Transfer-Encoding "
                                  f"{coding!r}")
        n = int(lengths[0]) if lengths else 0
        if n > MAX_BODY:
            self.close_connection = True
            raise http_error(413, f"Request Entity Too Large: the body has {n} bytes, at most {MAX_BODY}")
        return n

    def read_body(self):
        """The body: all of its Content-Length, within --request-timeout, else 400 (it ended early) or 408."""
        n, self.unread, timeout = self.unread, 0, self.server.request_timeout
        if n and self.request_version != "HTTP/1.0" and self.expects_continue():
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.reader.deadline = time.monotonic() + timeout
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            self.close_connection = True
            raise http_error(408, f"Request Timeout: the body ({n} bytes) did not come within {timeout} s") \
                from None
        finally:
            self.reader.deadline = None
            self.connection.settimeout(timeout)  # and each write of the answer must go out within it
        if len(raw) < n:
            self.close_connection = True
            raise http_error(400, f"Bad Request: the body ended after {len(raw)} of the {n} bytes of its "
                                  "Content-Length")
        return raw

    def drop_body(self):
        """An answer given before the body was read. A client sends its whole body before it reads, so a
        body of up to DROP_MAX bytes is read and dropped (the client gets the answer, the connection stays
        usable); a larger one, or one the client holds back for a "100 Continue", is not read: the connection
        closes."""
        if self.unread > DROP_MAX or self.expects_continue():
            self.close_connection = True
        else:
            try:
                self.read_body()
            except ApiError:  # it never came: read_body closed the connection
                pass
        self.unread = 0

    def expects_continue(self):
        return self.headers.get("Expect", "").lower() == "100-continue"

    def end_headers(self):
        headers = getattr(self, "headers", None)  # (none yet when the request line itself was refused)
        origin = headers.get("Origin") if headers is not None else None
        if origin is not None:  # a browser's request: vLLM's CORS headers (Cors)
            for name, value in self.server.app.cors.origin_headers(origin).items():
                self.send_header(name, value)
        super().end_headers()

    def send(self, status, body, ctype="application/json", headers=None):
        if self.unread:
            self.drop_body()
        data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def health(self, app, raw):
        self.send(503 if app.loop.dead else 200, b"", "text/plain")

    def models(self, app, raw):
        # one card per --served-model-name, vLLM's fields and values (its metrics' names are vLLM's too)
        perm = {"object": "model_permission", "created": app.created, "allow_create_engine": False,
                "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
        cards = [{"id": name, "object": "model", "created": app.created, "owned_by": "vllm",
                  "root": app.llm.model_path, "parent": None, "max_model_len": app.llm.max_model_len,
                  "permission": [dict(perm, id="modelperm-" + uuid.uuid4().hex)]} for name in app.names]
        self.send(200, {"object": "list", "data": cards})

    def metrics(self, app, raw):
        self.send(200, app.metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def version(self, app, raw):
        self.send(200, {"version": VERSION})

    def tokenize(self, app, raw):
        """vLLM's /tokenize: {"prompt"} or a chat ({"messages", "tools", ...}) -> its token ids."""
        body = app.check_model(parse_json(raw))
        if body.get("messages") is not None:
            msgs, tools = parse_messages(body["messages"]), parse_tools(body)[0]
            ids = app.tokenizer.encode(render_chat(app, body, msgs, tools))
        elif isinstance(body.get("prompt"), str):
            ids = app.tokenizer.encode(body["prompt"])
        else:
            raise bad("'prompt' (a string) or 'messages' is required", "prompt")
        strs = [token_str(app, t) for t in ids] if get(body, "return_token_strs", "boolean") else None
        self.send(200, {"count": len(ids), "max_model_len": app.llm.max_model_len, "tokens": ids,
                        "token_strs": strs})

    def detokenize(self, app, raw):
        body = app.check_model(parse_json(raw))
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(JSON_TYPES["integer"](t) for t in ids)):
            raise bad("'tokens' must be a list of token ids", "tokens")
        wrong = [t for t in ids if not 0 <= t < app.vocab]
        if wrong:
            raise bad(f"token id {short(wrong[0])} is out of range [0, {app.vocab})", "tokens")
        self.send(200, {"prompt": app.tokenizer.decode(ids)})

    def invocations(self, app, raw):
        """POST /invocations (SageMaker's, as vLLM routes it): a chat request (messages) or a completion (prompt)."""
        body = parse_json(raw)
        if "messages" in body:
            return self.chat(app, raw)
        if "prompt" in body:
            return self.completions(app, raw)
        raise bad("Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', "
                  "'CompletionRequest']")

    def completions(self, app, raw):
        body = app.check_model(parse_json(raw))
        self.generate(app, body, *parse_completion(app, body))

    def chat(self, app, raw):
        body = app.check_model(parse_json(raw))
        self.generate(app, body, *parse_chat(app, body))

    def responses_api(self, app, raw):  # (BaseHTTPRequestHandler.responses is its table of status lines)
        """POST /v1/responses: the request run as a chat request (response_to_chat), answered as a response object
        whole, or streamed as OpenAI's typed events (ResponseItems) ending with response.completed."""
        body = app.check_model(parse_json(raw))
        try:
            prompts, params, spec = parse_chat(app, response_to_chat(body))
        except ApiError as e:  # the chat path's field names -> the ones this request used
            err = e.body["error"]
            err["param"] = CHAT_TO_RESPONSES.get(err["param"], err["param"])
            raise
        ids = prompts[0][0]
        job = Job(ids, params)
        job.ranked, job.fork_of = False, None
        head = {"id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
                "model": app.name}
        fmt = get(get(body, "text", "object", {}), "format", "object", within="text")

        def response(status, items, n_out=0, finish=None):
            return dict(head, status="incomplete" if finish == "length" else status, background=False, error=None,
                        incomplete_details={"reason": "max_output_tokens"} if finish == "length" else None,
                        instructions=body.get("instructions"), max_output_tokens=body.get("max_output_tokens"),
                        metadata=body.get("metadata"), output=items,
                        parallel_tool_calls=body.get("parallel_tool_calls", True), previous_response_id=None,
                        reasoning=body.get("reasoning"), store=False, temperature=params.temperature,
                        text={"format": fmt or {"type": "text"}}, tool_choice=body.get("tool_choice", "auto"),
                        tools=body.get("tools", []), top_p=params.top_p,
                        truncation=body.get("truncation", "disabled"),
                        usage=response_usage(len(ids), n_out, reasoning_tokens(
                            app, spec, job.req.output_ids if job.req else [])) if status != "in_progress" else None,
                        user=body.get("user"))
        app.log_request(head["id"], ids, params)
        out, items = chat_stream(spec), ResponseItems()

        def feed(text, final):  # the answer so far -> its events (the items grow with them)
            delta = out.feed(text, final)
            if not spec.include_reasoning:
                delta.pop("reasoning", None)
            return items.events(delta)
        stream = get(body, "stream", "boolean", False)  # (checked before the engine sees the request)
        app.loop.submit(job)
        try:
            if not stream:
                for text, _, _, n, finish, _ in self.updates(job):
                    pass
                feed(text, final=True)
                items.close()
                self.send(200, response("completed", items.items, n, finish))
                return
            self.start_sse()
            seq = iter(range(1 << 62))

            def send(events):
                for e in events:
                    data = json.dumps({**e, "sequence_number": next(seq)}, ensure_ascii=False, separators=(",", ":"))
                    self.chunk(f"event: {e['type']}\ndata: {data}\n\n".encode())
            send([{"type": "response.created", "response": response("in_progress", [])},
                  {"type": "response.in_progress", "response": response("in_progress", [])}])
            hold, sent = max(map(len, job.params.stop), default=1) - 1, 0  # a stop string a later token may end
            try:
                for text, _, _, n, finish, _ in self.updates(job):
                    end = len(text) if finish else max(sent, len(text) - hold)
                    send(feed(text[:end], final=finish is not None))
                    sent = max(sent, end)
                send(items.close() + [{"type": "response.completed",
                                       "response": response("completed", items.items, n, finish)}])
            except ApiError as e:  # the engine failed it: OpenAI's error event ends the stream
                send([{"type": "error", **{k: e.body["error"][k] for k in ("code", "message", "param")}}])
            self.chunk(b"")
        except BaseException:  # the client left, or a failure: free the slot now
            app.loop.abort(job)
            raise

    def generate(self, app, body, prompts, params, spec):
        """Run one request (spec: its ChatSpec, None for a completion) and answer, whole or streamed. prompts:
        [(ids, echo text)], several for a completions batch. n > 1 (or best_of) runs that many samples of each
        prompt as jobs of their own (prompt i's choices i * n .. i * n + n - 1; best_of keeps the n of highest
        cumulative logprob)."""
        stream, opts = get(body, "stream", "boolean", False), get(body, "stream_options", "object")
        if opts is not None and not stream:
            raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
        # vLLM's StreamOptions, two booleans read before anything runs (a string "false" is false): include_usage
        # defaults to true once stream_options is given (null: false); continuous_usage_stats puts each choice's own
        # usage so far on its chunks
        with_usage = opts is not None and ("include_usage" not in opts or
                                           get(opts, "include_usage", "boolean", False, within="stream_options"))
        continuous = opts is not None and get(opts, "continuous_usage_stats", "boolean", False, within="stream_options")
        usage_opts = (with_usage, with_usage and continuous)
        if stream and params.ranked:
            raise bad("best_of > n is not supported with stream=true (the best are known only at the end)",
                      "best_of")
        chat = spec is not None
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else "")
        # vLLM's id: the X-Request-Id header, else the body's request_id, else a random one, after the prefix
        rid = self.headers.get("X-Request-Id")
        rid = get(body, "request_id", "string", uuid.uuid4().hex) if rid is None else rid
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "object": kind,
                "created": int(time.time()), "model": app.name}
        groups = []  # per prompt: its jobs (one per sample; the first's prefill copied by the others), echo
        prompt_only = not chat and echo_only(body)
        return_ids = get(body, "return_token_ids", "boolean", False)
        as_ids = get(body, "return_tokens_as_token_ids", "boolean", False)
        for ids, echo in prompts:
            app.log_request(head["id"], ids, params)
            group = [Job(ids, p) for p in params.samples()]
            for job in group:
                job.ranked, job.echo_only, job.n_samples = params.ranked, prompt_only, len(group)
                job.return_ids, job.as_ids = return_ids, as_ids
                job.fork_of = group[0] if job is not group[0] else None
            groups.append((group, echo))
        jobs = [job for group, _ in groups for job in group]
        most = app.loop.engine.max_num_seqs + app.loop.max_queue
        if len(jobs) > most:  # more than the server ever holds at once: it would answer 503 however long one waits
            raise bad(f"this request needs {len(jobs)} sequences ({len(groups)} prompt(s) x "
                      f"{len(jobs) // len(groups)} samples), more than the server takes at once: {most} "
                      f"(--max-num-seqs + --max-queue)", "prompt" if len(groups) > 1 else "n")
        for job in jobs:  # every prompt checked before any is submitted: a bad one refuses the request, none runs
            app.loop.check(job)
        submitted = []
        # completions' echo with logprobs: the prompt's tokens lead the logprobs (vLLM)
        with_prompt = not chat and get(body, "echo", "boolean", False) and params.logprobs is not None
        try:
            try:
                for job in jobs:
                    app.loop.submit(job)
                    submitted.append(job)
            except ApiError:  # a later sequence refused (503, 400): the request is, and those before it withdrawn
                for job in submitted:
                    app.loop.abort(job, counted=False)
                submitted = []
                raise
            n_prompt = sum(len(group[0].prompt_ids) for group, _ in groups)  # (once per prompt, whatever n)
            if stream:
                self.stream(groups, n_prompt, head, spec, usage_opts, app.tokenizer, with_prompt)
                return
            choices, n_out = [], 0
            for group, echo in groups:
                answers = []
                for job in group:
                    ids, lps = [], []
                    for text, new_ids, new_lps, n, finish, stop in self.updates(job):
                        ids, lps = ids + new_ids, lps + (new_lps or [])
                    answers.append((job, text, ids, lps, n, finish, stop))
                if params.ranked:
                    answers = sorted(answers, key=lambda a: -a[0].req.cumulative_logprob)[:params.n]
                plps = group[0].req.prompt_logprobs  # set before the request's first update
                extra = {} if plps is None else {"prompt_logprobs": prompt_logprobs_json(plps)}
                for job, text, ids, lps, n, finish, stop in answers:
                    made = {"token_ids": ids} if return_ids else {}  # (the answer's own: before the prompt's)
                    if with_prompt:
                        ids, lps = job.prompt_ids + ids, job.req.prompt_logprobs + lps
                    if chat:
                        out = chat_stream(spec)
                        out.feed(text, final=True)
                        answer, finish = {"message": chat_message(out, spec, echo), **made}, \
                            chat_finish(finish, out, spec)
                    else:  # completions': the prompt's logprobs and ids in the choice
                        answer = {"text": echo + text, **extra, **made,
                                  **({"prompt_token_ids": job.prompt_ids} if return_ids else {})}
                    fmt = LogprobFormat(app.tokenizer, chat, params.logprobs, job.as_ids)
                    choices.append(choice(answer, fmt(ids, lps), finish, stop, len(choices)))
                n_out += sum(a[4] for a in answers)
            if chat:  # vLLM: chat's prompt_logprobs (and prompt_token_ids) beside its choices (one prompt)
                head = dict(head, **extra, **({"prompt_token_ids": jobs[0].prompt_ids} if return_ids else {}))
            self.send(200, dict(head, choices=choices, usage=usage(n_prompt, n_out)))
        except BaseException:  # the client left, or a failure: free the slots now
            for job in submitted:
                app.loop.abort(job)
            raise

    def updates(self, job):
        """Yield the job's updates, merging any that queued up while we were writing; ends after the last."""
        check = time.monotonic() + 0.5  # a client that leaves is seen by looking (twice a second)
        while True:
            try:
                kind, up = job.events.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if time.monotonic() >= check:
                if self.client_gone():
                    raise ConnectionResetError("the client closed the connection")
                check = time.monotonic() + 0.5
            if kind is None:
                continue
            while kind == "update" and up.finish_reason is None:  # merge what else is already there
                try:
                    kind, more = job.events.get_nowait()
                except queue.Empty:
                    break
                lps = None if kind == "error" or more.logprobs is None else up.logprobs + more.logprobs
                up = more if kind == "error" else more._replace(ids=up.ids + more.ids, logprobs=lps)
            if kind == "error":
                raise up
            # echo without generation: vLLM generates one token and answers the prompt alone (counting the token)
            yield up._replace(text="", ids=[], logprobs=[] if up.logprobs is not None else None) if job.echo_only \
                else up
            if up.finish_reason is not None:
                return

    def client_gone(self):
        """Whether the connection is broken. A socket that is readable with nothing to read means the client
        closed its side: for good (it left) or only its sending side (a half-close: it waits for the answer).
        Only a write tells the two apart, so then a probe goes out that a client skips: an interim "100
        Continue" before the answer (HTTP/1.1 clients must skip any number of them; an HTTP/1.0 one gets no
        probe and is answered) or an SSE comment in a stream. A client that left answers the probe with a
        reset: the next look, half a second later, fails."""
        try:
            if not select.select([self.connection], [], [], 0)[0] or self.connection.recv(1, socket.MSG_PEEK):
                return False
            if self.streaming:
                self.chunk(b": still generating\n\n")
            elif self.request_version != "HTTP/1.0":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return False
        except (OSError, ValueError):
            return True

    def stream(self, groups, n_prompt, head, spec, usage_opts, tok, with_prompt=False):
        """The answer as server-sent events: groups [(one prompt's jobs, its echo text)], n_prompt their prompt
        tokens in all; usage_opts (with_usage, continuous) from stream_options. With n > 1 or several prompts the
        choices go one after the other (each chunk names its index), while the engine runs them all."""
        self.start_sse()
        jobs = [(job, echo) for group, echo in groups for job in group]
        n_done = 0
        for index, (job, echo) in enumerate(jobs):
            n_done += self.stream_choice(job, index, head, spec, echo, tok, usage_opts, with_prompt)
        self.end_stream(dict(head, choices=[], usage=usage(n_prompt, n_done)) if usage_opts[0] else None)

    def stream_choice(self, job, index, head, spec, echo, tok, usage_opts, with_prompt=False):
        """One choice's chunks; returns its number of tokens."""
        with_usage, continuous = usage_opts
        fmt = LogprobFormat(tok, spec is not None, job.params.logprobs, job.as_ids)
        hold = max(map(len, job.params.stop), default=1) - 1  # may start a stop string a later token ends
        chat = None if spec is None else chat_stream(spec)
        sent, n_prompt, first, ids, lps, n, made = 0, len(job.prompt_ids), True, [], [], 0, []
        if with_prompt:  # echo with logprobs: the prompt's tokens go first
            ids = list(job.prompt_ids)
        for text, new_ids, new_lps, n, finish, stop in self.updates(job):
            end = len(text) if finish else max(sent, len(text) - hold)
            if with_prompt and first:
                lps = list(job.req.prompt_logprobs)
            ids, lps = ids + new_ids, lps + (new_lps or [])  # tokens not sent yet (with their logprobs)
            made += new_ids  # (return_token_ids: the answer's own, not sent yet)
            extra = {"usage": usage(n_prompt, n) if continuous else None} if with_usage else {}
            if first and chat is not None:  # vLLM sends the chat role with the first output, not before
                none_yet = {"usage": usage(n_prompt, 0) if continuous else None} if with_usage else {}
                role = {"delta": {"role": spec.role, "content": ""}}
                prompt_ids = {"prompt_token_ids": job.prompt_ids} if job.return_ids else {}
                self.sse(dict(head, choices=[choice(role, None, None, None, index)], **none_yet, **prompt_ids))
                if echo:  # chat's echo (chat_echo): a chunk of its own after the role's, as vLLM's
                    said = {"delta": {"content": echo}}
                    self.sse(dict(head, choices=[choice(said, None, None, None, index)], **none_yet))
            if chat is None:
                answer = {"text": (echo if first else "") + text[sent:end]}
                if job.return_ids and first:
                    answer["prompt_token_ids"] = job.prompt_ids
            else:
                delta = chat_delta(chat.feed(text[:end], final=finish is not None), spec)
                finish = finish and chat_finish(finish, chat, spec)
                if not delta and finish is None:  # nothing settled yet (e.g. half a tag): wait for more
                    sent, first = max(sent, end), False
                    continue
                answer = {"delta": delta or {"content": ""}}
            sent, first = max(sent, end), False
            if job.return_ids:
                answer["token_ids"] = made
            self.sse(dict(head, choices=[choice(answer, fmt(ids, lps), finish, stop, index)], **extra))
            ids, lps, made = [], [], []
        return n

    def start_sse(self):
        """The headers of a server-sent-event stream; what follows goes out with chunk()."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.chunked = self.request_version != "HTTP/1.0"  # HTTP/1.0 has no chunks: closing ends the stream
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self.streaming = True

    def sse(self, obj):
        self.chunk(b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")

    def chunk(self, data):  # one piece of the chunked transfer encoding
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def end_stream(self, last=None):
        if last is not None:
            self.sse(last)
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")


HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what "*" allows (as Starlette)


class Cors(namedtuple("Cors", "origins methods headers credentials")):
    """Cross-origin requests as vLLM answers them (Starlette's CORSMiddleware with --allowed-origins,
    --allowed-methods, --allowed-headers, --allow-credentials): a browser's preflight (OPTIONS with Origin and
    Access-Control-Request-Method) gets 200 "OK" or 400 "Disallowed CORS ...", before any route or key check;
    any other answer to a request with an allowed Origin says so in its headers."""

    def allows(self, origin):
        return "*" in self.origins or origin in self.origins

    def origin_headers(self, origin):
        """The headers an answer to a request from `origin` carries (none for an origin not allowed)."""
        if not self.allows(origin):
            return {}
        echo = self.credentials or "*" not in self.origins  # a named origin (or credentials): that origin, Vary
        out = {"Access-Control-Allow-Origin": origin if echo else "*", **({"Vary": "Origin"} if echo else {})}
        return dict(out, **({"Access-Control-Allow-Credentials": "true"} if self.credentials else {}))

    def preflight(self, origin, method, headers):
        """(status, body, headers) of the answer to a preflight asking for `method` and `headers` (or None); the
        origin's own headers come with every answer (Handler.end_headers)."""
        methods = HTTP_METHODS if "*" in self.methods else tuple(self.methods)
        out = {"Access-Control-Allow-Methods": ", ".join(methods), "Access-Control-Max-Age": "600"}
        wanted = [h.strip().lower() for h in (headers or "").split(",") if h.strip()]
        allowed = {h.lower() for h in self.headers}
        failed = [what for what, ok in (("origin", self.allows(origin)), ("method", method in methods),
                                        ("headers", "*" in self.headers or set(wanted) <= allowed)) if not ok]
        if headers is not None and "*" in self.headers:
            out["Access-Control-Allow-Headers"] = headers
        return (400, b"Disallowed CORS " + ", ".join(failed).encode(), out) if failed else (200, b"OK", out)


class App:
    """What the handlers share: the model and the names it is served as, the chat template and the parsers
    (ChatOptions), the engine loop and the metrics."""

    def __init__(self, llm, served_model_name=None, api_key=None, max_queue=64, chat=None,
                 log_requests=False, log_stats=True, cors=None):
        self.llm, self.tokenizer, self.api_key, self.vocab = llm, llm.tokenizer, api_key, llm.cfg.vocab_size
        names = served_model_name or [llm.model_path]
        self.names = [names] if isinstance(names, str) else list(names)
        self.name, self.created, self.log_requests = self.names[0], int(time.time()), log_requests
        chat = chat or ChatOptions()
        self.template = chat.template or llm.chat_template
        self.chat_kwargs, self.reasoning_parser = chat.kwargs, chat.reasoning_parser
        self.tool_parser_name, self.tool_parser = chat.tool_parser, TOOL_PARSERS.get(chat.tool_parser)
        self.auto_tools = chat.auto_tools and self.tool_parser is not None
        self.added_tokens = {i: t for t, i in llm.tokenizer.special_ids.items()}
        k = llm.spec.num_speculative_tokens if llm.spec else 0
        self.metrics = Metrics(self.name, k, llm.max_model_len)
        interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", 10))
        self.loop = EngineLoop(llm, max_queue, self.metrics, StatsLog(interval) if log_stats else None)
        self.cors = cors or Cors(["*"], ["*"], ["*"], False)  # vLLM's defaults (--allowed-origins ...)

    def log_request(self, rid, ids, params):
        """--enable-log-requests: vLLM's line for each request received."""
        if self.log_requests:
            print(f"Received request {rid}: prompt: {self.tokenizer.decode(ids)!r}, params: {params}, "
                  f"prompt_token_ids: {ids}", file=sys.stderr, flush=True)

    def authorized(self, header):
        want = f"Bearer {self.api_key}".encode()
        return not self.api_key or hmac.compare_digest((header or "").encode(), want)

    def check_model(self, body):
        model = get(body, "model", "string")  # (a list or an object is a 400, as vLLM's: not a model not found)
        if model is not None and model not in self.names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return body


class Server(ThreadingHTTPServer):
    """One thread per connection, for at most `max_connections` connections: one more is answered 503 at once
    by the accepting thread (it never waits on that client), so silent clients cannot pile up threads."""
    daemon_threads = True
    request_queue_size = 256  # a deep accept backlog

    def __init__(self, address, app, max_connections, request_timeout):
        self.app, self.max_connections, self.request_timeout = app, max_connections, request_timeout
        self.open, self.lock = 0, threading.Lock()  # connections with a thread
        super().__init__(address, Handler)

    def process_request(self, sock, address):
        with self.lock:
            full = self.open >= self.max_connections
            self.open += not full
        if not full:
            return super().process_request(sock, address)
        err = ApiError(503, f"too many open connections (--max-connections {self.max_connections}); "
                            "retry later")
        body = json.dumps(err.body).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n")
        try:
            sock.setblocking(False)  # it fits the socket's buffer; if not, the client gets only the close
            sock.send(head.encode() + body)
        except OSError:
            pass
        self.shutdown_request(sock)

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return  # the client reset its connection (a keep-alive client that exits): not the server's error
        super().handle_error(request, client_address)

    def process_request_thread(self, sock, address):
        try:
            super().process_request_thread(sock, address)
        finally:
            with self.lock:
                self.open -= 1


# ==============================================================================================
# CLI
# ==============================================================================================

# How chat answers are made: the template (None: the model's), its default kwargs, and the parsers
ChatOptions = namedtuple("ChatOptions", "template kwargs reasoning_parser tool_parser auto_tools",
                         defaults=(None, {}, None, None, False))


def json_list(flag):
    """argparse's type for a flag that takes a JSON list of strings."""
    def parse(text):
        try:
            v = json.loads(text)
        except ValueError:
            v = None
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
        return v
    return parse


def build_parser():
    ap = argparse.ArgumentParser(
        prog="server.py", description="specdec's OpenAI-compatible server, started as vLLM's is: `python "
        "server.py MODEL [flags]` for `vllm serve MODEL [flags]` (an underscore in a flag's name works as a "
        "dash, as in vLLM)")
    ap.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="the model, as `vllm serve MODEL`: a checkpoint directory, .gguf file or hub id "
                    "(Org/Name) in the local Hugging Face cache; --model works too")
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default: loopback only; vLLM binds all)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="the model ids clients may use; the first is reported (default: the model's path)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument("--reasoning-parser", default=None, help="qwen3: the thinking goes to reasoning_content "
                    "(and reasoning), the answer to content (default: none, all is content)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='let the model call tools itself (tool_choice "auto"); needs --tool-call-parser')
    ap.add_argument("--tool-call-parser", default=None, help="qwen3_coder (Qwen3.5/3.6's <function=...> "
                    "XML; qwen3_xml is the same) or hermes (<tool_call>{json}</tool_call>): calls become "
                    "tool_calls")
    ap.add_argument("--chat-template", default=None,
                    help="a chat template (a file, or the template itself) instead of the model's own")
    ap.add_argument("--default-chat-template-kwargs", default=None,
                    help='JSON object of chat template kwargs for every request, e.g. '
                    '\'{"preserve_thinking": true}\' (a request\'s chat_template_kwargs go over it; its '
                    'tools are the template\'s for requests without tools; add_generation_prompt and '
                    'continue_final_message there are ignored: the request\'s fields win, as in vLLM)')
    ap.add_argument("--enable-log-requests", action="store_true", help="log each request's prompt and params")
    ap.add_argument("--max-queue", type=int, default=64, help="requests that may wait beyond --max-num-seqs; "
                                                              "more get 503")
    ap.add_argument("--max-connections", type=int, default=256, help="open connections served at once; one "
                                                                     "more gets 503 (default 256)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):  # vLLM's CORS flags: JSON lists, default ["*"]
        ap.add_argument(flag, type=json_list(flag), default=["*"], help=f'CORS: allowed {what}, a JSON list '
                        '(default ["*"])')
    ap.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    ap.add_argument("--request-timeout", type=float, default=30.0,
                    help="seconds a client has to send a request's line and headers (or to start the next "
                    "one on a kept-alive connection), then its body, and to take each write of the answer "
                    "(default 30)")
    return ap


def chat_options(a):
    """The chat flags, checked before the model loads (the template override needs the model: see main)."""
    if a.reasoning_parser not in (None, *REASONING_PARSERS):
        raise ConfigError(f"--reasoning-parser {a.reasoning_parser!r} is not supported; specdec has: "
                          f"{', '.join(REASONING_PARSERS)}")
    if a.tool_call_parser not in (None, *TOOL_PARSERS):
        raise ConfigError(f"--tool-call-parser {a.tool_call_parser!r} is not supported; specdec has: "
                          f"{', '.join(TOOL_PARSERS)}")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (qwen3_coder or hermes)")
    try:
        kwargs = json.loads(a.default_chat_template_kwargs or "{}")
    except ValueError as e:
        raise ConfigError(f"--default-chat-template-kwargs is not valid JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError("--default-chat-template-kwargs must be a JSON object")
    # vLLM takes any keys here. add_generation_prompt and continue_final_message never reach the template from
    # it: each request's own fields (true and false unless set) go over these defaults, so they are dropped now;
    # tools stand in for a request's when it has none (render_chat). The messages and documents are render's own.
    for key in ("add_generation_prompt", "continue_final_message"):
        kwargs.pop(key, None)
    clash = [k for k in ChatTemplate.RESERVED if k in kwargs and k != "tools"]
    if clash:
        raise ConfigError(f"--default-chat-template-kwargs may not set {', '.join(clash)} "
                          "(each request's own)")
    return ChatOptions(None, kwargs, a.reasoning_parser, a.tool_call_parser, a.enable_auto_tool_choice)


def check_tokens(llm, chat):
    """The parsers read tags the tokenizer must have (vLLM refuses to start without them, too)."""
    need = {"qwen3": (THINK, END_THINK)}.get(chat.reasoning_parser, ())
    need += (TOOL_CALL, END_TOOL_CALL) if chat.tool_parser else ()
    missing = [t for t in need if t not in llm.tokenizer.special_ids]
    if missing:
        raise ConfigError(f"the parsers need the tokens {', '.join(missing)}, which this tokenizer does not "
                          "have")


def startup_lines(llm, app):
    """What the server says at start-up: the memory arithmetic, the sampling defaults, the chat setup."""
    lines = [llm.memory_report]
    if llm.default_sampling:
        lines += ["Default sampling parameters have been overridden by the model's Hugging Face generation "
                  "config recommended from the model creator. If this is not intended, please relaunch with "
                  "`--generation-config vllm`.",
                  f"Using default sampling params from model: {llm.default_sampling}"]
    tools = app.tool_parser_name
    if tools and app.auto_tools:
        tools += " (auto tool choice)"
    lines.append(f"chat template: {app.template.origin}; reasoning parser: {app.reasoning_parser}; tool-call "
                 f"parser: {tools}")
    return lines


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(vllm_argv(sys.argv[1:] if argv is None else argv))
    if a.model_tag is not None and a.model not in (None, a.model_tag):
        ap.error(f"the model is given twice: {a.model_tag!r} and --model {a.model!r}")
    a.model = a.model_tag or a.model
    if a.max_queue < 0:
        ap.error("--max-queue must be >= 0")
    if a.max_connections < 1 or not 0 < a.request_timeout < math.inf:
        ap.error("--max-connections must be >= 1 and --request-timeout > 0")
    try:
        chat = chat_options(a)
        llm = llm_from_args(a)
        check_tokens(llm, chat)
        if a.chat_template is not None:
            template = ChatTemplate.from_arg(a.chat_template, llm.chat_template.special_tokens)
            chat = chat._replace(template=template)
        llm.warmup()  # every graph captured before the first request (on CUDA)
        app = App(llm, a.served_model_name, a.api_key, a.max_queue, chat, a.enable_log_requests,
                  not a.disable_log_stats, Cors(a.allowed_origins, a.allowed_methods, a.allowed_headers,
                                                a.allow_credentials))
        httpd = Server((a.host, a.port), app, a.max_connections, a.request_timeout)
    except Exception as e:  # a bad config or checkpoint, a busy port: one line, no traceback
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}" if isinstance(e, ConfigError) else f"error: {type(e).__name__}: {msg}",
              file=sys.stderr)
        return 1
    for line in startup_lines(llm, app):
        print(line, file=sys.stderr)
    print(f"specdec server: {app.name!r} on http://{a.host}:{httpd.server_address[1]} (max_num_seqs="
          f"{llm.engine.max_num_seqs}, max_model_len={llm.max_model_len}, "
          f"speculative={llm.spec and llm.spec.method})", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
