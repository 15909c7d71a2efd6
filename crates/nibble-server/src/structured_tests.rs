//! Structured outputs, tool calls, penalties and logit bias over the routes, on the tiny Qwen2
//! test model (random weights: whatever it writes, the grammar must hold it to the schema).

use super::*;

/// Leaves of the battery: every kind of value a schema bounds (a random model must finish the
/// value within the budget, so strings, arrays and numbers have limits).
fn leaves() -> Vec<Value> {
    vec![
        json!({"type": "integer", "minimum": -5, "maximum": 40}),
        json!({"type": "integer", "minimum": 100, "maximum": 999}),
        json!({"type": "integer", "exclusiveMinimum": 0, "maximum": 9}),
        json!({"type": "boolean"}),
        json!({"type": "null"}),
        json!({"enum": ["red", "green", "blue"]}),
        json!({"enum": [1, "two", null, true]}),
        json!({"const": "fixed"}),
        json!({"type": "string", "maxLength": 6}),
        json!({"type": "string", "minLength": 2, "maxLength": 4}),
        json!({"type": "string", "pattern": "^[a-z]{2,5}$"}),
        json!({"type": "string", "pattern": "^[A-Z][0-9]{3}$"}),
        json!({"type": "string", "pattern": "^(yes|no|maybe)$"}),
        json!({"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}),
        json!({"type": "string", "enum": ["a b", "c\"d", "e\\f"]}),
        json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]}),
    ]
}

/// At least 50 schemas: the leaves alone, arrays of them, objects of them with required and
/// optional properties, nested objects and arrays of objects.
fn battery() -> Vec<Value> {
    let leaves = leaves();
    let mut out: Vec<Value> = leaves.clone();
    for (i, l) in leaves.iter().enumerate() {
        out.push(json!({"type": "array", "items": l, "minItems": i % 2, "maxItems": 3}));
    }
    for (i, pair) in leaves.windows(2).enumerate() {
        let required: Vec<&str> = match i % 3 {
            0 => vec!["a", "b"],
            1 => vec!["a"],
            _ => vec![],
        };
        out.push(
            json!({"type": "object", "properties": {"a": pair[0], "b": pair[1]},
            "required": required, "additionalProperties": false}),
        );
    }
    for (i, l) in leaves.iter().enumerate().step_by(3) {
        let inner = json!({"type": "object", "properties": {"x": l, "flag": {"type": "boolean"}},
            "required": ["x"], "additionalProperties": false});
        out.push(json!({"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "inner": inner,
            "list": {"type": "array", "items": inner, "maxItems": 2},
            "tag": leaves[(i + 5) % leaves.len()],
        }, "required": ["id", "inner", "list"], "additionalProperties": false}));
    }
    out
}

fn check(schema: &Value, reply: &str, what: &str) {
    let v: Value = serde_json::from_str(reply)
        .unwrap_or_else(|e| panic!("{what}: {reply:?} is not JSON ({e}); schema {schema}"));
    let validator = jsonschema::validator_for(schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
    assert!(
        errors.is_empty(),
        "{what}: {reply} does not validate against {schema}: {errors:?}"
    );
}

/// The text of a stream's chunks for choice 0.
fn streamed_text(chunks: &[Value]) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            let piece = ch["text"].as_str().or(ch["delta"]["content"].as_str());
            text.push_str(piece.unwrap_or(""));
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}

#[tokio::test]
async fn every_reply_of_the_schema_battery_validates() {
    let app = app(EngineConfig::default());
    let schemas = battery();
    assert!(schemas.len() >= 50, "{} schemas", schemas.len());
    for (i, schema) in schemas.iter().enumerate() {
        // Greedy and sampled; chat with response_format and completions with vLLM's guided_json;
        // every third streamed.
        let sampling = if i % 2 == 0 {
            json!({"temperature": 0})
        } else {
            json!({"temperature": 1.0, "seed": i})
        };
        let (path, mut body) = if i % 4 == 3 {
            (
                "/v1/completions",
                json!({"prompt": "JSON:", "guided_json": schema}),
            )
        } else {
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Give me JSON."}],
                    "response_format": {"type": "json_schema",
                        "json_schema": {"name": format!("s{i}"), "schema": schema, "strict": true}}}),
            )
        };
        body["max_tokens"] = json!(400);
        for (k, v) in sampling.as_object().unwrap() {
            body[k] = v.clone();
        }
        let what = format!("schema {i} on {path}");
        let (text, finish) = if i % 3 == 0 {
            body["stream"] = json!(true);
            streamed_text(&chunks(&app, path, body).await)
        } else {
            let r = ok(&app, path, body).await;
            let c = &r["choices"][0];
            (
                texts(&r)[0].clone(),
                c["finish_reason"].as_str().map(String::from),
            )
        };
        assert_eq!(finish.as_deref(), Some("stop"), "{what}: {text:?}");
        check(schema, &text, &what);
    }
}

#[tokio::test]
async fn json_object_regex_and_grammar_hold_the_reply() {
    let app = app(EngineConfig::default());
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 300,
            "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // A regex and a Lark grammar, on both endpoints.
    let r = ok(
        &app,
        "/v1/chat/completions",
        chat(json!({"guided_regex": "[a-c]{3}-[0-9]{2}"})),
    )
    .await;
    let t = &texts(&r)[0];
    assert!(
        t.len() == 6
            && t[..3].bytes().all(|b| (b'a'..=b'c').contains(&b))
            && &t[3..4] == "-"
            && t[4..].bytes().all(|b| b.is_ascii_digit()),
        "{t:?}"
    );
    let grammar =
        "start: greeting \" \" name \"!\"\ngreeting: \"hello\" | \"hi\"\nname: /[A-Z][a-z]{1,5}/";
    let r = ok(
        &app,
        "/v1/completions",
        json!({"prompt": "x", "guided_grammar": grammar, "max_tokens": 50}),
    )
    .await;
    let t = &texts(&r)[0];
    let (greeting, name) = t.split_once(' ').unwrap();
    assert!(["hello", "hi"].contains(&greeting), "{t:?}");
    assert!(
        name.ends_with('!') && name.as_bytes()[0].is_ascii_uppercase(),
        "{t:?}"
    );
    // json_object: any object (the random model's may run long: only check what it wrote
    // when it finished).
    let r = ok(
        &app,
        "/v1/chat/completions",
        chat(json!({"response_format": {"type": "json_object"}})),
    )
    .await;
    let t = &texts(&r)[0];
    assert!(t.starts_with('{'), "{t:?}");
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Map<String, Value>>(t).is_ok(),
            "{t:?}"
        );
    }
}

#[tokio::test]
async fn grammars_that_cannot_compile_and_bad_formats_are_400() {
    let app = app(EngineConfig::default());
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    for (body, param) in [
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}}),
            "response_format",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}),
            "response_format",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "wibble"}}}}),
            "response_format",
        ),
        (
            json!({"messages": msgs, "guided_regex": "a(b"}),
            "guided_regex",
        ),
        (
            json!({"messages": msgs, "guided_grammar": "start: undefined_rule"}),
            "guided_grammar",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema",
                "json_schema": {"name": "bad name!", "schema": {}}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (
            json!({"messages": msgs, "guided_regex": "a", "response_format": {"type": "json_object"}}),
            "guided_regex",
        ),
    ] {
        let (status, text) = post(&app, "/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(err["error"]["param"], param, "{text}");
    }
    // The message says why.
    let (_, text) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "x", "guided_json": {"$ref": "#/$defs/missing"}}),
    )
    .await;
    assert!(text.contains("JSON schema cannot be compiled"), "{text}");
}

#[tokio::test]
async fn logit_bias_and_penalties_change_the_sampling() {
    let app = app(EngineConfig::default());
    let base = json!({"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "logprobs": 0});
    let tokens = |r: &Value| -> Vec<String> {
        serde_json::from_value(r["choices"][0]["logprobs"]["tokens"].clone()).unwrap()
    };
    let plain = tokens(&ok(&app, "/v1/completions", base.clone()).await);
    // +100 on one token: greedy takes it every time.
    let mut b = base.clone();
    b["logit_bias"] = json!({"120": 100});
    let forced = tokens(&ok(&app, "/v1/completions", b).await);
    assert!(forced.iter().all(|t| t == &forced[0]), "{forced:?}");
    assert_ne!(forced, plain);
    // -100 on a greedy token (the first that is one ASCII byte, whose id is that byte in this
    // vocabulary): the same tokens up to it, then another.
    let at = plain
        .iter()
        .position(|t| t.len() == 1 && t.is_ascii())
        .expect("an ASCII token");
    let mut b = base.clone();
    b["logit_bias"] = json!({plain[at].as_bytes()[0].to_string(): -100});
    let banned = tokens(&ok(&app, "/v1/completions", b).await);
    assert_eq!(banned[..at], plain[..at]);
    assert_ne!(banned[at], plain[at]);
    // A frequency penalty of 2 against a bias of 30 on one token.
    let mut b = base.clone();
    b["logit_bias"] = json!({"120": 30});
    b["frequency_penalty"] = json!(2.0);
    b["max_tokens"] = json!(30);
    let pen = tokens(&ok(&app, "/v1/completions", b.clone()).await);
    let count = pen.iter().filter(|t| **t == forced[0]).count();
    // Each use costs 2: the +30 bias wins until about 15 uses have spent it (the raw logits
    // of this model differ by a few units).
    assert!((10..=20).contains(&count), "{count}: {pen:?}");
    b["frequency_penalty"] = json!(0);
    b["presence_penalty"] = json!(2.0);
    let pres = tokens(&ok(&app, "/v1/completions", b).await);
    assert_eq!(
        pres.iter().filter(|t| **t == forced[0]).count(),
        30,
        "a presence penalty of 2 never outweighs a bias of 30: {pres:?}"
    );
    for (body, param) in [
        (
            json!({"prompt": "x", "presence_penalty": 2.5}),
            "presence_penalty",
        ),
        (
            json!({"prompt": "x", "frequency_penalty": -3}),
            "frequency_penalty",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"5": 101}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"99999": 1}}),
            "logit_bias",
        ),
    ] {
        let (status, text) = post(&app, "/v1/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(err["error"]["param"], param, "{text}");
    }
}

/// The tiny model with a Hermes-style template that renders `tools`, calls and results
/// compactly (the model's context is 512 tokens of bytes).
fn tool_app() -> Router {
    const TEMPLATE: &str = "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools> reply <tool_call>{json}</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}({{ c.function.arguments | tojson }})</tool_call>{% endfor %}{% endif %}{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures/tiny-qwen2");
    let mut files = open_model(&dir, None).unwrap();
    files.tokenizer.chat_template = Some(TEMPLATE.into());
    let backend = CpuBackend::new(1).unwrap();
    let model = Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    let engine = LlmEngine::new(backend, model, files.tokenizer, EngineConfig::default()).unwrap();
    router(crate::start(engine, "tiny".into(), None, Limits::default()).unwrap())
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}})
}

fn clock_tool() -> Value {
    json!({"type": "function", "function": {"name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}})
}

#[tokio::test]
async fn required_and_named_tool_choices_call_a_tool_with_valid_arguments() {
    let app = tool_app();
    let weather_params = weather_tool()["function"]["parameters"].clone();
    for (choice, want) in [
        (json!("required"), None),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            Some("get_weather"),
        ),
        (
            json!({"type": "function", "function": {"name": "now"}}),
            Some("now"),
        ),
    ] {
        for stream in [false, true] {
            let body = json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [weather_tool(), clock_tool()], "tool_choice": choice,
                "max_tokens": 200, "temperature": 0.8, "seed": 3, "stream": stream});
            let (calls, finish, content) = if stream {
                let chunks = chunks(&app, "/v1/chat/completions", body).await;
                let mut calls = Vec::new();
                let mut finish = None;
                let mut content = String::new();
                for c in &chunks {
                    let ch = &c["choices"][0];
                    content.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
                    if let Some(tc) = ch["delta"]["tool_calls"].as_array() {
                        calls.extend(tc.iter().cloned());
                    }
                    if let Some(f) = ch["finish_reason"].as_str() {
                        finish = Some(f.to_string());
                    }
                }
                (calls, finish, content)
            } else {
                let r = ok(&app, "/v1/chat/completions", body).await;
                let m = &r["choices"][0]["message"];
                (
                    m["tool_calls"].as_array().cloned().unwrap_or_default(),
                    r["choices"][0]["finish_reason"].as_str().map(String::from),
                    m["content"].as_str().unwrap_or("").to_string(),
                )
            };
            assert_eq!(
                finish.as_deref(),
                Some("tool_calls"),
                "{choice} {content:?}"
            );
            assert_eq!(calls.len(), 1, "{calls:?}");
            assert!(content.is_empty(), "{content:?}");
            let f = &calls[0]["function"];
            let name = f["name"].as_str().unwrap();
            if let Some(want) = want {
                assert_eq!(name, want);
            }
            assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
            let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
            let schema = if name == "now" {
                clock_tool()["function"]["parameters"].clone()
            } else {
                weather_params.clone()
            };
            check(&schema, &args.to_string(), name);
        }
    }
}

#[tokio::test]
async fn tool_turns_round_trip_into_the_prompt_and_bad_tools_are_400() {
    let app = tool_app();
    let history = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    ]);
    let usage = |messages: &Value, tools: bool| {
        let mut b = json!({"messages": messages, "max_tokens": 1});
        if tools {
            b["tools"] = json!([weather_tool()]);
        }
        b
    };
    let prompt_tokens = |r: &Value| r["usage"]["prompt_tokens"].as_u64().unwrap();
    let with = ok(&app, "/v1/chat/completions", usage(&history, true)).await;
    let without_tools = ok(&app, "/v1/chat/completions", usage(&history, false)).await;
    let first = ok(
        &app,
        "/v1/chat/completions",
        usage(&json!([history[0].clone()]), false),
    )
    .await;
    // This vocabulary is bytes (and a few merges), so token counts follow the rendered text:
    // the tools line, and the call with its arguments and the result with its id.
    let tools_line = "<|im_start|>system\n<tools>get_weather;</tools> reply <tool_call>{json}</tool_call><|im_end|>\n";
    let turns = "<|im_start|>assistant\n<tool_call>get_weather({\"city\": \"Oslo\", \"days\": 1})</tool_call><|im_end|>\n<|im_start|>tool\n[call_1]-3 C, snow<|im_end|>\n";
    let near = |got: u64, text: &str| {
        // Special tokens are one token; merges take a few bytes together.
        let specials =
            text.matches("<|im_start|>").count() * 11 + text.matches("<|im_end|>").count() * 9;
        let bytes = (text.len() - specials) as u64;
        assert!(
            got <= bytes && got * 10 >= bytes * 7,
            "{got} tokens for {text:?}"
        );
    };
    near(
        prompt_tokens(&with) - prompt_tokens(&without_tools),
        tools_line,
    );
    near(prompt_tokens(&without_tools) - prompt_tokens(&first), turns);
    for (body, param) in [
        (
            json!({"messages": history, "tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": history, "tools": [weather_tool()],
                "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"messages": history, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": history, "tools": [weather_tool()], "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].id",
        ),
        (
            json!({"messages": history, "tools": [weather_tool()], "tool_choice": "required",
                "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
    ] {
        let (status, text) = post(&app, "/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(err["error"]["param"], param, "{text}");
    }
}
