"""Structured outputs, tool calling, penalties and logit_bias through the `openai` package, on the
default model: every reply held to a schema parses and validates (the `jsonschema` package)."""
import json

import jsonschema
import openai
import pytest

from test_server import MODEL, client, post

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                                      "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
     "required": ["capital"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z ]{1,15}$"}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["name", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 3}},
     "required": ["city", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"enum": ["low", "high"]}},
     "required": ["answer", "confidence"], "additionalProperties": False},
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_validate(server, i, stream):
    schema = SCHEMAS[i]
    c = client(server)
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                max_tokens=200, temperature=0,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    if stream:
        chunks = list(c.chat.completions.create(stream=True, **args))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        r = c.chat.completions.create(**args)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_completions_guided_json(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object about cats."}],
                                  max_tokens=120, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = c.completions.create(model=MODEL, prompt="The list of colors:", max_tokens=80, temperature=0,
                             extra_body={"guided_json": SCHEMAS[2]})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[2])
    r = c.completions.create(model=MODEL, prompt="Phone:", max_tokens=20, temperature=0,
                             extra_body={"guided_regex": r"\+[0-9]{2} [0-9]{3} [0-9]{4}"})
    t = r.choices[0].text
    assert len(t) == 12 and t[0] == "+" and t[3] == " " and t[7] == " ", t


def test_uncompilable_schema_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"$ref": "#/$defs/nowhere"}}})
    assert e.value.body["param"] == "response_format"
    assert "cannot be compiled" in e.value.body["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_are_parsed_and_valid(server, choice, stream):
    c = client(server)
    args = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER], tool_choice=choice, max_tokens=100, temperature=0)
    if stream:
        calls = {}
        finish = None
        for ch in c.chat.completions.create(stream=True, **args):
            d = ch.choices[0].delta
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        calls = [calls[k] for k in sorted(calls)]
    else:
        r = c.chat.completions.create(**args)
        finish = r.choices[0].finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments, "id": t.id}
                 for t in r.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_tool_results_round_trip(server):
    c = client(server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                  max_tokens=100, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    msgs.append(r.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"})
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=40, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    # tool_choice "none": the tools are shown, no call is parsed.
    r3 = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                   max_tokens=20, temperature=0)
    assert r3.choices[0].message.tool_calls is None
    assert r3.choices[0].finish_reason in ("stop", "length")


def test_penalties_and_logit_bias(server):
    c = client(server)
    base = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    plain = c.completions.create(**base).choices[0].text
    pen = c.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **base).choices[0].text
    assert pen != plain
    ids = c.completions.create(logit_bias={"28": 100}, logprobs=0, **base)
    tokens = ids.choices[0].logprobs.tokens
    assert len(set(tokens)) == 1, tokens
    status, body = post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"28": 150}})
    assert status == 400 and body["error"]["param"] == "logit_bias"
