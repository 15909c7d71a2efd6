"""The server's front door (issue 25): a battery of generated bad requests, each with the status,
`param` and `code` it must get, run against the real server; slow and idle clients; and the
clients that must keep working (the openai package, curl, `nibble bench serve`)."""
import http.client
import json
import os
import select
import socket
import subprocess
import threading
import time
from collections import Counter

import openai

from conftest import NIBBLE, ROOT

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
JSON = {"Content-Type": "application/json"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {COMPLETIONS: {"prompt": "Hi", "max_tokens": 1}, CHAT: {"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 1}}


class Case:
    def __init__(self, category, path, body, status, param, code=None, method="POST", headers=JSON):
        self.category, self.path, self.body, self.method, self.headers = category, path, body, method, headers
        self.status, self.param, self.code = status, param, code

    def data(self):
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


def with_field(path, key, value, base=None):
    body = json.loads(json.dumps(base if base is not None else BASE[path]))
    body[key] = value
    return body


def without(path, key):
    body = dict(BASE[path])
    del body[key]
    return body


def rust_quote(key):
    """How the server writes an odd field name in `param` (Rust's {:?} of the first 40 chars)."""
    if 0 < len(key.encode()) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) or key == "":
        return key
    return json.dumps(key[:40], ensure_ascii=False) + ("..." if len(key) > 40 else "")


# --- the battery ------------------------------------------------------------------------------

WRONG_NUMBER = ["1", "x", "", True, False, [], [1], {}, {"a": 1}]
WRONG_INT = WRONG_NUMBER + [1.5, 2.0, 1e2, -0.5]
WRONG_BOOL = [0, 1, "true", "false", "", [], {}, 1.0, "1"]
WRONG_STRING = [5, 1.5, True, [], {}, ["x"]]

RANGES = {  # field: values out of its range (each refused, never clamped)
    "temperature": [-0.001, -1, 2.0001, 2.5, 3, 100, 1e38, 1e300, -1e300],
    "top_p": [0, 0.0, -0.1, 1.0001, 2, 1e10, -1e-9],
    "min_p": [-0.01, 1.01, 5, -1e30],
    "repetition_penalty": [0, -0.5, -1e10, 1e300],
    "presence_penalty": [-2.01, 2.01, 10, -100, 1e38],
    "frequency_penalty": [-2.0001, 2.5, 50, -1e38],
    "max_tokens": [0, -1, -100, -2**63, 2**63, 2**64, 10**30],
    "n": [0, -1, -2**63, 2**63, 17, 128, 2**40],  # 1 to --max-n (16)
    "top_k": [-2, -3, -1000, -2**63, 2**64],
    "seed": [2**63, 2**64, -2**63 - 1, 10**25],
}
# Fields both endpoints share with valid values asking for something nibble does not do: none
# since the penalties and logit_bias were implemented (completions_only and chat_only list theirs).
UNSUPPORTED = {}
BAD_LOGIT_BIAS = [{"1": 101}, {"1": -101}, {"1": 1e9}, {"1": "x"}, {"1": None}, {"1": [1]}, {"abc": 1},
                  {"-1": 1}, {str(VOCAB): 1}, {"1.5": 1}, {"": 1}, {"99999999999999999999": 1}]
BAD_LOGIT_BIAS_TYPE = [[], "x", 5, True, [[1, 2]]]
UNKNOWN = ["max_token", "temprature", "top-p", "Stream", "PROMPT", "Messages", "foo", "__proto__",
           "constructor", "x" * 100, "a b", "x\ny", "ñ", "stop_sequences", "max_new_tokens", "do_sample",
           "typical_p", "length_penalty", "num_beams", "use_beam_search", "guided_choice", "guided_decoding_backend",
           "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
           "prompt_logprobs", "add_generation_prompt", "chat_template", "documents", "priority", "request_id",
           "stream_usage", "logprob", "best-of", "penalty", "api_key", "organization", "deployment_id",
           "engine", "timeout", "extra_body", "extra_headers", "headers", "", " ", "1", "null", "MODEL",
           "Temperature", "topP", "maxTokens", "top_a", "tfs", "mirostat", "grammar", "json_schema",
           "context", "system", "raw"]
ROLES = ["SYSTEM", "System", "User", "USER", "Assistant", "ASSISTANT", "Tool", "Developer", "", " ", "user ",
         " user", "hacker", "function", "bot", "human", "model", "user\n<|im_start|>system", "<|im_start|>",
         "system\u0000", "tool_call", "developer\n", "ipython", "root", "u\u0301ser", "usér", "assistant<|im_end|>",
         "system\r\n"]
ROLE_FIELDS = {"system": {}, "developer": {}, "user": {}, "assistant": {}, "tool": {"tool_call_id": "call_1"}}
TOKEN_IDS = [  # (prompt, index of the bad id, code)
    ([4294967296], 0, "invalid_value"), ([2**33 + 1, 2**40 + 2], 0, "invalid_value"), ([-1], 0, "invalid_value"),
    ([VOCAB], 0, "invalid_value"), ([VOCAB + 1], 0, "invalid_value"), ([2**31], 0, "invalid_value"),
    ([2**32 - 1], 0, "invalid_value"), ([2**63 - 1], 0, "invalid_value"), ([2**63], 0, "invalid_value"),
    ([2**64 - 1], 0, "invalid_value"), ([2**64], 0, "invalid_value"), ([10**30], 0, "invalid_value"),
    ([1, 2, -5], 2, "invalid_value"), ([1, 2**32], 1, "invalid_value"), ([1, 2, 3, 2**32 + 7], 3, "invalid_value"),
    ([-2**63], 0, "invalid_value"), ([1, VOCAB], 1, "invalid_value"), ([1.5], 0, "invalid_type"),
    ([1.0], 0, "invalid_type"), ([1, 2.0], 1, "invalid_type"), ([1, "1"], 1, "invalid_type"),
    ([1, True], 1, "invalid_type"), ([1, None], 1, "invalid_type"), ([1, [2]], 1, "invalid_type"),
    ([1, {}], 1, "invalid_type"), ([True], 0, "invalid_type"), ([None], 0, "invalid_type"),
    ([{}], 0, "invalid_type"), (["a", 1], 1, "invalid_type"), (["a", None], 1, "invalid_type"),
]
BAD_BODIES = [b"", b"{", b"{not json", b"[1,2]", b"[]", b'"x"', b"5", b"null", b"true", b'{"prompt": NaN}',
              b'{"prompt": Infinity}', b'{"temperature": -Infinity}', b"\xff\xfe", b'{"prompt": "x",}',
              b"{'prompt': 'x'}", b'{"prompt": "\\ud800"}', b"[" * 200 + b"]" * 200, b'{"a":1}{"b":2}',
              b'{"prompt":"x"} garbage', b'{"max_tokens": 1e400}', b"\xef\xbb\xbf{}", b'{"prompt": "\xff"}',
              b'{"prompt": "x"', b"{" + b'"a":{' * 200 + b"}" * 201, b'{"prompt": tru}', b"\x00"]
BAD_CONTENT_TYPES = [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x", "*/*", "application/*", "application/jsonx",
                     "application/json-patch+json", "application/vnd.api+json", "text/json",
                     "application/json; charset=latin1", "application/json; charset=utf-16", "json", "",
                     "application/javascript", "application/xml", "application/json, text/plain", "text/html"]


def battery():
    cases = []
    add = cases.append
    for path in (COMPLETIONS, CHAT):
        ep = "completions" if path == COMPLETIONS else "chat"
        numbers = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
        ints = ["max_tokens", "n", "seed", "top_k"] + (["logprobs", "best_of"] if ep == "completions"
                                                       else ["max_completion_tokens"])
        bools = ["stream", "ignore_eos"] + (["echo"] if ep == "completions" else ["logprobs", "store"])
        strings = ["user", "model"] + (["suffix"] if ep == "completions" else [])
        for f in numbers:
            for v in WRONG_NUMBER:
                add(Case(f"type/{ep}", path, with_field(path, f, v), 400, f, "invalid_type"))
        for f in ints:
            for v in WRONG_INT:
                add(Case(f"type/{ep}", path, with_field(path, f, v), 400, f, "invalid_type"))
        for f in bools:
            for v in WRONG_BOOL:
                add(Case(f"type/{ep}", path, with_field(path, f, v), 400, f, "invalid_type"))
        for f in strings:
            for v in WRONG_STRING:
                add(Case(f"type/{ep}", path, with_field(path, f, v), 400, f, "invalid_type"))
        for f, values in RANGES.items():
            for v in values:
                add(Case(f"range/{ep}", path, with_field(path, f, v), 400, f, "invalid_value"))
        for f, values in UNSUPPORTED.items():
            for v in values:
                add(Case(f"unsupported/{ep}", path, with_field(path, f, v), 400, f, "unsupported_parameter"))
        for v in BAD_LOGIT_BIAS:
            code = "invalid_type" if isinstance(v.get("1", 0), (str, list, type(None))) else "invalid_value"
            add(Case(f"range/{ep}", path, with_field(path, "logit_bias", v), 400, "logit_bias", code))
        for v in BAD_LOGIT_BIAS_TYPE:
            add(Case(f"type/{ep}", path, with_field(path, "logit_bias", v), 400, "logit_bias", "invalid_type"))
        for k in UNKNOWN:
            add(Case(f"unknown/{ep}", path, with_field(path, k, 1), 400, rust_quote(k), "unknown_parameter"))
        other_only = ["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                      "store", "functions", "parallel_tool_calls"] if ep == "completions" else \
            ["prompt", "echo", "suffix", "best_of"]
        for k in other_only:
            add(Case(f"unknown/{ep}", path, with_field(path, k, None), 400, k, "unknown_parameter"))
        # stop
        for v, param, code in [(5, "stop", "invalid_type"), (True, "stop", "invalid_type"),
                               ({}, "stop", "invalid_type"), ([1], "stop[0]", "invalid_type"),
                               (["a", None], "stop[1]", "invalid_type"), (["a", 5], "stop[1]", "invalid_type"),
                               ([[]], "stop[0]", "invalid_type"), (["s"] * 17, "stop", "invalid_value"),
                               ([str(i) for i in range(100)], "stop", "invalid_value"), ("", "stop", "invalid_value"),
                               (["a", ""], "stop[1]", "invalid_value")]:
            add(Case(f"stop/{ep}", path, with_field(path, "stop", v), 400, param, code))
        for v, param, code in [(5, "stop_token_ids", "invalid_type"), ("1", "stop_token_ids", "invalid_type"),
                               ([1, "2"], "stop_token_ids[1]", "invalid_type"), ([1.5], "stop_token_ids[0]", "invalid_type"),
                               ([-1], "stop_token_ids[0]", "invalid_value"), ([VOCAB], "stop_token_ids[0]", "invalid_value"),
                               ([2**32], "stop_token_ids[0]", "invalid_value"), ([1] * 17, "stop_token_ids", "invalid_value")]:
            add(Case(f"stop/{ep}", path, with_field(path, "stop_token_ids", v), 400, param, code))
        # stream_options
        streaming = with_field(path, "stream", True)
        for v in [5, "x", [], True, [{"include_usage": True}]]:
            add(Case(f"stream_options/{ep}", path, with_field(path, "stream_options", v, streaming), 400,
                     "stream_options", "invalid_type"))
        for v in [1, "yes", [], {}, 0.0]:
            add(Case(f"stream_options/{ep}", path, with_field(path, "stream_options", {"include_usage": v}, streaming),
                     400, "stream_options.include_usage", "invalid_type"))
        for k in ["foo", "include_obfuscation", "includeUsage"]:
            add(Case(f"stream_options/{ep}", path, with_field(path, "stream_options", {k: True}, streaming), 400,
                     f"stream_options.{k}", "unknown_parameter"))
        for stream in [None, False]:
            body = with_field(path, "stream_options", {"include_usage": True}, with_field(path, "stream", stream))
            add(Case(f"stream_options/{ep}", path, body, 400, "stream_options", "invalid_value"))
        # the model
        for m in ["gpt-4", "", MODEL + " ", MODEL.lower(), "x" * 1000, "SmolLM2-135M"]:
            add(Case(f"model/{ep}", path, with_field(path, "model", m), 404, "model", "model_not_found"))
        # bodies that are not one JSON object
        for b in BAD_BODIES:
            code = "invalid_type" if b in (b"[1,2]", b"[]", b'"x"', b"5", b"null", b"true") else "invalid_json"
            add(Case(f"body/{ep}", path, b, 400, "body", code))
        # content types: JSON only
        for ct in BAD_CONTENT_TYPES:
            headers = {} if ct is None else {"Content-Type": ct}
            add(Case(f"content_type/{ep}", path, BASE[path], 415, "content-type", "unsupported_media_type",
                     headers=headers))
        add(Case(f"content_type/{ep}", path, BASE[path], 415, "content-type", "unsupported_media_type",
                 headers=[("Content-Type", "application/json"), ("Content-Type", "application/json")]))
        # the context length
        big = "word " * 9000
        add(Case(f"context/{ep}", path, with_field(path, "max_tokens", 10**7), 400, "max_tokens",
                 "context_length_exceeded"))
        if ep == "completions":
            add(Case(f"context/{ep}", path, with_field(path, "prompt", big), 400, "prompt", "context_length_exceeded"))
            add(Case(f"context/{ep}", path, with_field(path, "prompt", list(range(9000))), 400, "prompt",
                     "context_length_exceeded"))
        else:
            add(Case(f"context/{ep}", path, with_field(path, "messages", [{"role": "user", "content": big}]), 400,
                     "messages", "context_length_exceeded"))

    # --- completions only
    P = COMPLETIONS
    for v, param, code in [(5, "prompt", "invalid_type"), (True, "prompt", "invalid_type"), ({}, "prompt", "invalid_type"),
                           (1.5, "prompt", "invalid_type"), ([], "prompt", "invalid_value"),
                           ([["a"]], "prompt[0][0]", "invalid_type"), ([[1], 2], "prompt[1]", "invalid_type"),
                           ([[1], []], "prompt[1]", "invalid_value"), ([[1], [VOCAB]], "prompt[1][0]", "invalid_value"),
                           (["a", ""], "prompt[1]", "invalid_value"), ([[1]] * 300, "prompt", "invalid_value"),
                           (None, "prompt", "missing_required_parameter"), ("", "prompt", "invalid_value")]:
        add(Case("prompt", P, with_field(P, "prompt", v), 400, param, code))
    add(Case("prompt", P, without(P, "prompt"), 400, "prompt", "missing_required_parameter"))
    for ids, i, code in TOKEN_IDS:
        add(Case("token_ids", P, with_field(P, "prompt", ids), 400, f"prompt[{i}]", code))
    add(Case("completions_only", P, {**BASE[P], "echo": True, "logprobs": 1}, 400, "echo", "unsupported_parameter"))
    add(Case("completions_only", P, {**BASE[P], "n": 2, "best_of": 1}, 400, "best_of", "invalid_value"))
    for f, values, code in [("logprobs", [-1, 21, 100, 2**40], "invalid_value"), ("best_of", [0, -1], "invalid_value"),
                            ("best_of", [2, 3], "unsupported_parameter"),
                            ("suffix", ["x", " and then"], "unsupported_parameter")]:
        for v in values:
            add(Case("completions_only", P, with_field(P, f, v), 400, f, code))

    # --- chat only
    C = CHAT

    def chat_with(messages, **extra):
        return {"messages": messages, "max_tokens": 1, **extra}

    ok = {"role": "user", "content": "ok"}
    for v, code in [(None, "missing_required_parameter"), ("hi", "invalid_type"), (5, "invalid_type"),
                    ({}, "invalid_type"), ({"role": "user", "content": "x"}, "invalid_type"), ([], "invalid_value"),
                    ([ok] * 2049, "invalid_value")]:
        add(Case("messages", C, with_field(C, "messages", v), 400, "messages", code))
    add(Case("messages", C, without(C, "messages"), 400, "messages", "missing_required_parameter"))
    for at in range(3):
        def place(m):
            msgs = [ok, ok, ok]
            msgs[at] = m
            return chat_with(msgs)
        for m in ["hi", 5, None, [], True, [ok]]:
            add(Case("messages", C, place(m), 400, f"messages[{at}]", "invalid_type"))
        for role in ROLES:
            add(Case("roles", C, place({"role": role, "content": "x"}), 400, f"messages[{at}].role", "invalid_value"))
        for role in [1, True, [], {}, ["user"]]:
            add(Case("roles", C, place({"role": role, "content": "x"}), 400, f"messages[{at}].role", "invalid_type"))
        for m in [{"content": "x"}, {"role": None, "content": "x"}]:
            add(Case("roles", C, place(m), 400, f"messages[{at}].role", "missing_required_parameter"))
    at = 1
    for role, needs in ROLE_FIELDS.items():
        def msg(**fields):
            return chat_with([ok, {"role": role, **needs, **fields}])
        pre = f"messages[{at}]"
        add(Case("role_fields", C, msg(), 400, f"{pre}.content", "missing_required_parameter"))
        add(Case("role_fields", C, msg(content=None), 400, f"{pre}.content", "missing_required_parameter"))
        for v in [5, True, {}, 1.5, {"type": "text", "text": "x"}]:
            add(Case("role_fields", C, msg(content=v), 400, f"{pre}.content", "invalid_type"))
        others = {"system": ["tool_call_id", "tool_calls", "refusal"], "developer": ["tool_call_id", "tool_calls"],
                  "user": ["tool_call_id", "tool_calls", "refusal", "audio"], "assistant": ["tool_call_id"],
                  "tool": ["name", "tool_calls", "refusal"]}[role]
        for k in others + ["foo", "Content", "role2"]:
            add(Case("role_fields", C, msg(content="x", **{k: "v"}), 400, f"{pre}.{k}", "unknown_parameter"))
        if role != "tool":
            add(Case("role_fields", C, msg(content="x", name="bob"), 400, f"{pre}.name", "unsupported_parameter"))
            for v in [5, [], {}]:
                add(Case("role_fields", C, msg(content="x", name=v), 400, f"{pre}.name", "invalid_type"))
        # content parts
        good = {"type": "text", "text": "ok"}
        parts = [([], f"{pre}.content", "invalid_value"), ([1, 2], f"{pre}.content[0]", "invalid_type"),
                 ([good, "x"], f"{pre}.content[1]", "invalid_type"), ([good, None], f"{pre}.content[1]", "invalid_type"),
                 ([good, []], f"{pre}.content[1]", "invalid_type"),
                 ([{"type": "text", "text": 5}], f"{pre}.content[0].text", "invalid_type"),
                 ([{"type": "text", "text": None}], f"{pre}.content[0].text", "missing_required_parameter"),
                 ([{"type": "text"}], f"{pre}.content[0].text", "missing_required_parameter"),
                 ([{"text": "x"}], f"{pre}.content[0].type", "missing_required_parameter"),
                 ([good, {"type": 5, "text": "x"}], f"{pre}.content[1].type", "invalid_type"),
                 ([{"type": "video"}], f"{pre}.content[0].type", "invalid_value"),
                 ([{"type": "TEXT", "text": "x"}], f"{pre}.content[0].type", "invalid_value"),
                 ([{"type": "text", "text": "x", "extra": 1}], f"{pre}.content[0].extra", "unknown_parameter"),
                 ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], f"{pre}.content[0].type",
                  "unsupported_parameter"),
                 ([good, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                  f"{pre}.content[1].type", "unsupported_parameter"),
                 ([{"type": "file", "file": {}}], f"{pre}.content[0].type", "unsupported_parameter"),
                 ([{"type": "refusal", "refusal": "no"}], f"{pre}.content[0].type", "unsupported_parameter")]
        for content, param, code in parts:
            add(Case("content_parts", C, msg(content=content), 400, param, code))
    pre = "messages[1]"
    for fields, param, code in [
        ({"role": "tool", "content": "x"}, "tool_call_id", "missing_required_parameter"),
        ({"role": "tool", "content": "x", "tool_call_id": None}, "tool_call_id", "missing_required_parameter"),
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "tool_call_id", "invalid_type"),
        ({"role": "tool", "content": "x", "tool_call_id": []}, "tool_call_id", "invalid_type"),
        ({"role": "assistant", "content": "x", "tool_calls": 5}, "tool_calls", "invalid_type"),
        ({"role": "assistant", "content": "x", "tool_calls": "x"}, "tool_calls", "invalid_type"),
        ({"role": "assistant", "content": "x", "tool_calls": {}}, "tool_calls", "invalid_type"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
         "tool_calls[0].function", "missing_required_parameter"),
        ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
         "tool_calls[0].id", "missing_required_parameter"),
        ({"role": "assistant", "content": "x", "refusal": "no"}, "refusal", "unsupported_parameter"),
        ({"role": "assistant", "content": "x", "refusal": 5}, "refusal", "invalid_type"),
        ({"role": "assistant", "content": "x", "function_call": {"name": "f"}}, "function_call", "unsupported_parameter"),
        ({"role": "assistant", "content": "x", "audio": {"id": "a"}}, "audio", "unsupported_parameter"),
    ]:
        add(Case("role_fields", C, chat_with([ok, fields]), 400, f"{pre}.{param}", code))
    for f, v, param, code in [
        ("response_format", "json", "response_format", "invalid_type"),
        ("response_format", 5, "response_format", "invalid_type"),
        ("response_format", [], "response_format", "invalid_type"),
        ("response_format", {}, "response_format.type", "missing_required_parameter"),
        ("response_format", {"type": 5}, "response_format.type", "invalid_type"),
        ("response_format", {"type": "xml"}, "response_format.type", "invalid_value"),
        ("response_format", {"type": "json_object", "schema": {}}, "response_format.schema", "unknown_parameter"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
         "missing_required_parameter"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
         "response_format", "invalid_value"),
        ("guided_regex", "a(b", "guided_regex", "invalid_value"),
        ("response_format", {"type": "text", "x": 1}, "response_format.x", "unknown_parameter"),
        ("tools", [{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name", "invalid_value"),
        ("tools", [{"type": "function"}], "tools[0].function", "missing_required_parameter"),
        ("tools", "x", "tools", "invalid_type"),
        ("tools", {}, "tools", "invalid_type"),
        ("tool_choice", "auto", "tool_choice", "invalid_value"),  # no tools
        ("tool_choice", "required", "tool_choice", "invalid_value"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool_choice.function.name", "invalid_value"),
        ("parallel_tool_calls", "auto", "parallel_tool_calls", "invalid_type"),
        ("tool_choice", "maybe", "tool_choice", "invalid_value"),
        ("tool_choice", "", "tool_choice", "invalid_value"),
        ("tool_choice", 5, "tool_choice", "invalid_type"),
        ("tool_choice", [], "tool_choice", "invalid_type"),
        ("store", True, "store", "unsupported_parameter"),
        ("top_logprobs", 2, "top_logprobs", "invalid_value"),
        ("max_completion_tokens", 0, "max_completion_tokens", "invalid_value"),
        ("max_completion_tokens", 2, "max_completion_tokens", "invalid_value"),  # differs from max_tokens: 1
    ] + [(f, v, f, "unsupported_parameter") for f in
         ["functions", "function_call", "metadata", "service_tier", "modalities", "audio",
          "prediction", "reasoning_effort", "web_search_options", "verbosity"] for v in [True, "auto", {}]]:
        add(Case("chat_only", C, with_field(C, f, v), 400, param, code))
    for extra, param in [({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": -1}, "top_logprobs")]:
        add(Case("chat_only", C, {**BASE[C], **extra}, 400, param, "invalid_value"))

    # --- routing and methods
    for method, path in [("GET", "/"), ("POST", "/"), ("GET", "/v1"), ("GET", "/v1/"), ("POST", "/v1/completion"),
                         ("POST", "/v1/chat"), ("POST", "/v1/embeddings"), ("POST", "/v2/completions"),
                         ("GET", "/healthz"), ("POST", "/v1/completions/"), ("POST", "/V1/completions"),
                         ("POST", "//v1/completions"), ("GET", "/v1/models/x"), ("POST", "/v1/responses"),
                         ("DELETE", "/nope"), ("GET", "/v1/completions/../models"), ("GET", "/metrics/x"),
                         ("POST", "/v1/chat/completions/x"), ("GET", "/.env"), ("GET", "/favicon.ico")]:
        add(Case("route", path, BASE[COMPLETIONS], 404, None, "not_found", method=method))
    for method, path in [(m, p) for p in (COMPLETIONS, CHAT) for m in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS")] + \
            [(m, p) for p in ("/v1/models", "/health", "/metrics") for m in ("POST", "PUT", "DELETE", "PATCH")]:
        add(Case("method", path, BASE[COMPLETIONS], 405, None, "method_not_allowed", method=method))
    return cases


def check_error(status, headers, raw, want_status, want_param, want_code):
    """Every error: the status asked, OpenAI's shape, JSON content type, the param and code asked."""
    problems = []
    if status != want_status:
        problems.append(f"status {status}, want {want_status}")
    if "application/json" not in (headers.get("Content-Type") or ""):
        problems.append(f"content-type {headers.get('Content-Type')!r}")
    try:
        body = json.loads(raw)
    except ValueError:
        return problems + [f"body is not JSON: {raw[:200]!r}"]
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict)
            and set(err) == {"message", "type", "param", "code"}):
        return problems + [f"not OpenAI's shape: {body}"]
    if not (isinstance(err["message"], str) and err["message"]):
        problems.append("empty message")
    want_type = "authentication_error" if want_status == 401 else "invalid_request_error"
    if err["type"] != want_type:
        problems.append(f"type {err['type']}")
    if err["param"] != want_param:
        problems.append(f"param {err['param']!r}, want {want_param!r}")
    if want_code is not None and err["code"] != want_code:
        problems.append(f"code {err['code']!r}, want {want_code!r}")
    return problems


class Conn:
    """One keep-alive connection, reopened when the server closes it."""

    def __init__(self, server):
        self.server, self.c = server, None

    def send(self, method, path, data, headers):
        for attempt in range(2):
            if self.c is None:
                self.c = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
            try:
                self.c.putrequest(method, path, skip_accept_encoding=True)
                pairs = headers.items() if isinstance(headers, dict) else headers
                for k, v in pairs:
                    self.c.putheader(k, v)
                self.c.putheader("Content-Length", str(len(data or b"")))
                self.c.endheaders(data)
                r = self.c.getresponse()
                raw = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.close()
                return r.status, r.headers, raw
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise

    def close(self):
        if self.c is not None:
            self.c.close()
        self.c = None


def test_battery_of_bad_requests(server):
    cases = battery()
    assert len(cases) >= 1000, len(cases)
    t0 = time.time()
    conn = Conn(server)
    failures, by_category, by_status = [], Counter(), Counter()
    for case in cases:
        status, headers, raw = conn.send(case.method, case.path, case.data(), case.headers)
        by_category[case.category.split("/")[0]] += 1
        by_status[status] += 1
        problems = check_error(status, headers, raw, case.status, case.param, case.code)
        if problems:
            failures.append(f"{case.category} {case.method} {case.path} {case.data()[:150]!r}: {'; '.join(problems)}")
    conn.close()
    elapsed = time.time() - t0
    summary = {"requests": len(cases), "seconds": round(elapsed, 2), "by_category": dict(sorted(by_category.items())),
               "by_status": {str(k): v for k, v in sorted(by_status.items())}, "failures": len(failures)}
    with open(os.path.join(ROOT, "target", "front-door-battery.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    assert not failures, f"{len(failures)} of {len(cases)} failed:\n" + "\n".join(failures[:40])
    assert 200 not in by_status and not any(s >= 500 for s in by_status)
    assert elapsed < 60
    # Nothing reached the engine, and the server still serves.
    m = server.metrics()
    assert m["nibble_requests_running"] == 0 and m["nibble_kv_blocks_in_use"] == 0
    r = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert r.choices[0].text == " Paris."


# --- the HTTP layer, on raw sockets -------------------------------------------------------------

def raw_exchange(server, data, timeout=10):
    """Sends bytes, reads until the server closes; returns (response bytes, seconds)."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    t0 = time.time()
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    return out, time.time() - t0


def parse_raw(out):
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {k.title(): v for k, v in headers.items()}
    return int(lines[0].split()[1]), headers, body


def test_http_layer_errors_are_openai_shaped(server):
    long_header = b"X-Big: " + b"a" * 40000 + b"\r\n"
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(120))
    for data, status, param, code in [
        (b"NOT A REQUEST\r\n\r\n", 400, None, "invalid_http_request"),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400, None, "invalid_http_request"),
        (b"GET /\x01 HTTP/1.1\r\n\r\n", 400, None, "invalid_http_request"),
        (b"GET / HTTP/9.9\r\n\r\n", 400, None, "invalid_http_request"),
        (b"GET /v1/models HTTP/1.1\r\n" + long_header + b"\r\n", 431, None, "headers_too_large"),
        (b"GET /v1/models HTTP/1.1\r\n" + many + b"\r\n", 431, None, "headers_too_large"),
        (b"GET /v1/models?" + b"a" * 9000 + b" HTTP/1.1\r\nConnection: close\r\n\r\n", 414, None, "uri_too_long"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 999999999\r\n\r\n",
         413, "body", "body_too_large"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"zz\r\n", 400, "body", "invalid_body"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: text/plain\r\nConnection: close\r\n"
         b"Content-Length: 2\r\n\r\n{}", 415,
         "content-type", "unsupported_media_type"),
    ]:
        out, _ = raw_exchange(server, data)
        assert out, data[:60]
        st, headers, body = parse_raw(out)
        problems = check_error(st, headers, body, status, param, code)
        assert not problems, (data[:80], problems, out[:300])


def test_api_key_errors_are_openai_shaped(keyed_server):
    conn = Conn(keyed_server)
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    for auth in [None, "", "Bearer", "Bearer ", "Bearer wrong", "bearer sekrit", "Basic c2Vrcml0", "sekrit",
                 "Bearer sekrit2", "Bearer  sekrit"]:
        headers = dict(JSON) if auth is None else {**JSON, "Authorization": auth}
        for path, method in [(COMPLETIONS, "POST"), (CHAT, "POST"), ("/v1/models", "GET")]:
            status, h, raw = conn.send(method, path, body if method == "POST" else b"", headers)
            assert not check_error(status, h, raw, 401, None, "invalid_api_key"), (auth, path, raw)
    conn.close()


# --- limits and slow clients (the small-limits server) --------------------------------------------

def test_body_and_list_limits(limits_server):
    s, lim = limits_server, limits_server.limits
    big = json.dumps({"prompt": "x" * (lim["max_body_bytes"] + 10), "max_tokens": 1}).encode()
    out, _ = raw_exchange(s, b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(big) + big)
    assert not check_error(*parse_raw(out), 413, "body", "body_too_large")
    # Chunked, so no length is declared: refused once the limit is passed.
    chunks = b"".join(b"%x\r\n%s\r\n" % (8192, b"x" * 8192) for _ in range(10)) + b"0\r\n\r\n"
    out, _ = raw_exchange(s, b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
    assert not check_error(*parse_raw(out), 413, "body", "body_too_large")
    conn = Conn(s)
    ok = {"role": "user", "content": "x"}
    cases = [(CHAT, {"messages": [ok] * (lim["max_messages"] + 1)}, "messages"),
             (CHAT, {"messages": [ok], "stop": ["a"] * (lim["max_stop_strings"] + 1)}, "stop"),
             (COMPLETIONS, {"prompt": "x", "stop": ["a"] * (lim["max_stop_strings"] + 1)}, "stop")]
    for path, body, param in cases:
        status, h, raw = conn.send("POST", path, json.dumps(body).encode(), JSON)
        assert not check_error(status, h, raw, 400, param, "invalid_value"), raw
    # At the limits, served.
    for path, body, param in cases:
        body[param] = body[param][:-1]
        body["max_tokens"] = 1
        status, _, raw = conn.send("POST", path, json.dumps(body).encode(), JSON)
        assert status == 200, raw
    conn.close()


def slowloris(server, results, idx, payload):
    """Sends `payload` a byte every 100 ms until the server answers or hangs up; records how long
    that took and what it said."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    t0 = time.time()
    out = b""
    try:
        for b in payload:
            if select.select([s], [], [], 0.1)[0]:
                break
            s.sendall(bytes([b]))
        while chunk := s.recv(4096):
            out += chunk
    except OSError:
        pass
    results[idx] = (time.time() - t0, out)
    s.close()


def test_slowloris_is_cut_off_while_others_are_served(limits_server):
    s = limits_server
    timeout = s.limits["header_timeout"]
    payload = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    results = {}
    threads = [threading.Thread(target=slowloris, args=(s, results, i, payload)) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    # Served meanwhile: the openai package and curl.
    t0 = time.time()
    r = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=30).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert r.choices[0].text == " Paris."
    out = subprocess.run(["curl", "-sS", "-f", s.base + "/v1/models"], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out)["data"][0]["id"] == MODEL
    assert time.time() - t0 < timeout, "other clients had to wait for the slow ones"
    for t in threads:
        t.join()
    assert len(results) == 16
    for took, said in results.values():
        # Cut off at the header timeout, though it never stopped sending.
        assert timeout - 0.05 <= took < timeout + 1.0, took
        assert not check_error(*parse_raw(said), 408, None, "request_timeout"), said


def test_slow_body_never_reaches_the_engine(limits_server):
    s = limits_server
    timeout = s.limits["body_timeout"]
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    body = json.dumps({"prompt": "Hello", "max_tokens": 50, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    t0 = time.time()
    time.sleep(timeout / 2)
    m = s.metrics()
    assert m["nibble_requests_running"] == 0 and m["nibble_requests_waiting"] == 0
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    took = time.time() - t0
    sock.close()
    assert timeout - 0.1 <= took < timeout + 1.0, took
    assert not check_error(*parse_raw(out), 408, "body", "request_timeout"), out


def test_idle_keep_alive_connections_are_closed(limits_server):
    s = limits_server
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.time()
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    took = time.time() - t0
    sock.close()
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"}")  # served, then closed silently
    assert s.limits["header_timeout"] - 0.05 <= took < s.limits["header_timeout"] + 1.0, took


def test_long_generations_outlast_the_header_timeout(limits_server):
    """The header timeout covers waiting for a head, never a response being generated."""
    s = limits_server
    c = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120)
    # Long enough on this machine to outlast the header timeout three times (a fixed 300 tokens
    # took 1.42 s against a 1.5 s timeout on a fast run): sized from a short generation's pace.
    t = time.time()
    c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64, temperature=0,
                         extra_body={"ignore_eos": True})
    per_token = (time.time() - t) / 64
    n = min(4000, max(300, int(3 * s.limits["header_timeout"] / per_token)))
    t0 = time.time()
    chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=n, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == n
    t1 = time.time()
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=n, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == n
    assert min(t1 - t0, time.time() - t1) > s.limits["header_timeout"], "too fast to show anything"


# --- valid clients are unaffected -------------------------------------------------------------------

def test_valid_requests_still_work(server):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, top_p=1, presence_penalty=0, frequency_penalty=0, n=1,
        user="someone", logit_bias={}, response_format={"type": "text"}, seed=1, stop=["\n\n"],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer."},
                  {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                               {"type": "text", "text": "of France?"}]},
                  {"role": "assistant", "content": "Let me think."},
                  {"role": "tool", "content": "Paris", "tool_call_id": "call_1"},
                  {"role": "user", "content": "So?"}])
    assert r.choices[0].message.role == "assistant"
    r = c.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=2, temperature=0,
                             echo=False, best_of=1, suffix=None, extra_body={"top_k": -1, "min_p": 0.0})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 2)
    for ct in ["application/json", "application/json; charset=utf-8", "Application/JSON",
               'application/json;charset="UTF-8"']:
        out = subprocess.run(["curl", "-sS", "-f", server.base + COMPLETIONS, "-H", f"Content-Type: {ct}", "-d",
                              json.dumps({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})],
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out)["choices"][0]["text"] == " Paris."


def test_bench_serve_still_works(server, tmp_path):
    replies = ["Paris is the capital of France and its largest city.",
               "The quick brown fox jumps over the lazy dog again and again.",
               "Water boils at one hundred degrees Celsius at sea level.",
               "Seven days make a week, and twelve months make a year."]
    data = [{"conversations": [{"from": "human", "value": f"Question {i}: tell me something true about the world."},
                               {"from": "gpt", "value": replies[i % len(replies)]}]} for i in range(8)]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(data))
    for endpoint in ["completions", "chat"]:
        report = tmp_path / f"{endpoint}.json"
        subprocess.run([NIBBLE, "bench", "serve", "--base-url", server.base, "--endpoint", endpoint,
                        "--dataset", str(dataset), "--num-prompts", "6", "--json", str(report), "--timeout", "120"],
                       capture_output=True, text=True, check=True)
        r = json.loads(report.read_text())
        assert (r["completed"], r["failed"], r["refused"]) == (6, 0, 0), r["errors"]
