//! Every refusal of the validation layer: its status, `param` and `code`.

use serde_json::{Value, json};

use super::*;

const RULES: Rules = Rules {
    model_name: "smol",
    vocab_size: 1000,
    max_messages: 4,
    max_stop: 3,
    max_n: 4,
    max_sequences: 6,
};

fn completion_of(body: Value) -> ApiResult<CompletionRequest> {
    completion(body.to_string().as_bytes(), &RULES)
}

fn chat_of(body: Value) -> ApiResult<ChatRequest> {
    chat(body.to_string().as_bytes(), &RULES)
}

/// Adds `field` to a valid completion request and expects a 400 naming `param` with `code`.
fn refused(endpoint: &str, extra: Value, param: &str, code: &str) {
    let mut body = if endpoint == "chat" {
        json!({"messages": [{"role": "user", "content": "hi"}]})
    } else {
        json!({"prompt": "hi"})
    };
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let err = if endpoint == "chat" {
        chat_of(body.clone()).err()
    } else {
        completion_of(body.clone()).err()
    };
    let err = err.unwrap_or_else(|| panic!("{body} was accepted"));
    assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
    assert_eq!(err.code, Some(code), "{body}: {}", err.message);
    assert!(
        err.message.contains(param) || param == "body",
        "{}",
        err.message
    );
}

fn both(extra: Value, param: &str, code: &str) {
    refused("completion", extra.clone(), param, code);
    refused("chat", extra, param, code);
}

#[test]
fn valid_requests_become_typed_requests() {
    let r = completion_of(json!({"prompt": "hi", "model": "smol", "max_tokens": 5,
        "temperature": 0, "top_p": 1, "top_k": -1, "stop": ["a", "b"], "seed": -1,
        "logprobs": 2, "stream": true, "stream_options": {"include_usage": true},
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": false,
        "suffix": "", "best_of": 1, "n": 1, "user": "u1", "ignore_eos": true, "min_p": null,
        "stop_token_ids": [0, 999]}))
    .unwrap();
    assert_eq!(r.prompts, [Prompt::Text("hi".into())]);
    assert!(!r.echo);
    let g = r.generation;
    assert_eq!(g.max_tokens, Some(5));
    assert_eq!(g.params.temperature, 0.0);
    assert_eq!(g.params.top_k, 0);
    assert_eq!(g.params.seed, Some(u64::MAX));
    assert_eq!(g.stop, ["a", "b"]);
    assert_eq!(g.logprobs, Some(2));
    assert!(g.stream && g.include_usage && g.ignore_eos);
    assert_eq!(g.n, 1);
    assert_eq!(g.stop_token_ids, [0, 999]);
    let prompts = |p: Value| completion_of(json!({ "prompt": p })).unwrap().prompts;
    assert_eq!(prompts(json!([1, 999])), [Prompt::Tokens(vec![1, 999])]);
    assert_eq!(prompts(json!(["one"])), [Prompt::Text("one".into())]);
    assert_eq!(
        prompts(json!(["one", ""])),
        [Prompt::Text("one".into()), Prompt::Text("".into())]
    );
    assert_eq!(
        prompts(json!([[1], [2, 3]])),
        [Prompt::Tokens(vec![1]), Prompt::Tokens(vec![2, 3])]
    );
    let r = completion_of(json!({"prompt": ["a", "b"], "n": 3, "echo": true, "best_of": null}))
        .unwrap();
    assert!(r.echo);
    assert_eq!((r.prompts.len(), r.generation.n), (2, 3));

    let c = chat_of(json!({"messages": [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": [{"type": "text", "text": "d1"}, {"type": "text", "text": "d2"}]},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "tool_calls": [], "refusal": null},
    ], "logprobs": true, "top_logprobs": 3, "max_tokens": 7, "max_completion_tokens": 7,
       "response_format": {"type": "text"}, "tool_choice": "none", "store": false}))
    .unwrap();
    assert_eq!(c.messages.len(), 4);
    assert_eq!(c.messages[1].content, "d1\nd2");
    assert_eq!(c.messages[1].role.template_name(), "system");
    assert_eq!(c.generation.logprobs, Some(3));
    assert_eq!(c.generation.max_tokens, Some(7));
    assert_eq!(
        chat_of(json!({"messages": [{"role": "user", "content": "u"}], "n": 4}))
            .unwrap()
            .generation
            .n,
        4
    );
    let t = chat_of(json!({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}))
        .unwrap();
    assert_eq!(t.messages[0].role, Role::Tool);
}

#[test]
fn bodies_that_are_not_one_json_object() {
    for body in [
        &b"{not json"[..],
        b"",
        b"[1]",
        b"\"x\"",
        b"null",
        b"{\"a\": NaN}",
        b"\xff",
    ] {
        let err = completion(body, &RULES).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("body"));
        assert!(matches!(err.code, Some("invalid_json" | "invalid_type")));
    }
}

#[test]
fn types_are_checked() {
    let wrong = [json!("x"), json!(true), json!([1]), json!({"a": 1})];
    for field in [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
    ] {
        for v in &wrong {
            both(json!({ field: v }), field, "invalid_type");
        }
    }
    for field in ["max_tokens", "n", "seed", "top_k"] {
        for v in wrong.iter().chain([&json!(1.5), &json!(2.0)]) {
            both(json!({ field: v }), field, "invalid_type");
        }
    }
    for field in ["stream", "ignore_eos"] {
        for v in [json!(1), json!("true"), json!([])] {
            both(json!({ field: v }), field, "invalid_type");
        }
    }
    both(json!({"user": 5}), "user", "invalid_type");
    both(json!({"model": 5}), "model", "invalid_type");
    both(json!({"stop": 5}), "stop", "invalid_type");
    both(json!({"stop": ["a", 5]}), "stop[1]", "invalid_type");
    both(
        json!({"stream_options": true, "stream": true}),
        "stream_options",
        "invalid_type",
    );
    both(
        json!({"stream": true, "stream_options": {"include_usage": 1}}),
        "stream_options.include_usage",
        "invalid_type",
    );
    both(
        json!({"stop_token_ids": 5}),
        "stop_token_ids",
        "invalid_type",
    );
    both(
        json!({"stop_token_ids": [1, "2"]}),
        "stop_token_ids[1]",
        "invalid_type",
    );
    both(
        json!({"stop_token_ids": [1.5]}),
        "stop_token_ids[0]",
        "invalid_type",
    );
    both(json!({"logit_bias": [1]}), "logit_bias", "invalid_type");
    both(
        json!({"logit_bias": {"5": "x"}}),
        "logit_bias",
        "invalid_type",
    );
    refused(
        "completion",
        json!({"logprobs": true}),
        "logprobs",
        "invalid_type",
    );
    refused("completion", json!({"echo": 1}), "echo", "invalid_type");
    refused("completion", json!({"suffix": 1}), "suffix", "invalid_type");
    refused(
        "completion",
        json!({"best_of": "2"}),
        "best_of",
        "invalid_type",
    );
    refused("chat", json!({"logprobs": 2}), "logprobs", "invalid_type");
    refused(
        "chat",
        json!({"logprobs": true, "top_logprobs": "2"}),
        "top_logprobs",
        "invalid_type",
    );
    refused(
        "chat",
        json!({"response_format": "json"}),
        "response_format",
        "invalid_type",
    );
    refused(
        "chat",
        json!({"response_format": {"type": 1}}),
        "response_format.type",
        "invalid_type",
    );
    refused("chat", json!({"tools": {}}), "tools", "invalid_type");
    refused(
        "chat",
        json!({"tool_choice": 1}),
        "tool_choice",
        "invalid_type",
    );
    refused("chat", json!({"store": "yes"}), "store", "invalid_type");
    refused(
        "chat",
        json!({"max_completion_tokens": 1.5}),
        "max_completion_tokens",
        "invalid_type",
    );
}

#[test]
fn ranges_are_checked_not_clamped() {
    for (field, values) in [
        (
            "temperature",
            vec![json!(-0.01), json!(2.01), json!(100), json!(1e38)],
        ),
        ("top_p", vec![json!(0), json!(-1), json!(1.01)]),
        ("min_p", vec![json!(-0.1), json!(1.5)]),
        (
            "repetition_penalty",
            vec![json!(0), json!(-1), json!(1e300)],
        ),
        ("presence_penalty", vec![json!(-2.01), json!(3)]),
        ("frequency_penalty", vec![json!(2.5)]),
        ("max_tokens", vec![json!(0), json!(-5)]),
        ("n", vec![json!(0), json!(-1)]),
        ("top_k", vec![json!(-2), json!(-100)]),
        ("seed", vec![json!(u64::MAX), json!(1e19)]),
        ("max_tokens", vec![json!(1e30)]),
    ] {
        for v in values {
            both(json!({ field: v }), field, "invalid_value");
        }
    }
    both(
        json!({"logit_bias": {"5": 101}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"logit_bias": {"5": -100.5}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"logit_bias": {"1000": 1}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"logit_bias": {"-1": 1}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"logit_bias": {"x": 1}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"stop": ["a", "b", "c", "d"]}),
        "stop",
        "invalid_value",
    );
    both(json!({"stop": ""}), "stop", "invalid_value");
    both(
        json!({"stop_token_ids": [1, 2, 3, 4]}),
        "stop_token_ids",
        "invalid_value",
    );
    both(
        json!({"stop_token_ids": [1, 1000]}),
        "stop_token_ids[1]",
        "invalid_value",
    );
    both(
        json!({"stop_token_ids": [-1]}),
        "stop_token_ids[0]",
        "invalid_value",
    );
    both(json!({"stop": ["a", ""]}), "stop[1]", "invalid_value");
    both(
        json!({"stream_options": {"include_usage": true}}),
        "stream_options",
        "invalid_value",
    );
    refused(
        "completion",
        json!({"logprobs": 21}),
        "logprobs",
        "invalid_value",
    );
    refused(
        "completion",
        json!({"logprobs": -1}),
        "logprobs",
        "invalid_value",
    );
    refused(
        "completion",
        json!({"best_of": 0}),
        "best_of",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"logprobs": true, "top_logprobs": 21}),
        "top_logprobs",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"top_logprobs": 2}),
        "top_logprobs",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"logprobs": false, "top_logprobs": 2}),
        "top_logprobs",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"max_completion_tokens": 0}),
        "max_completion_tokens",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"max_tokens": 5, "max_completion_tokens": 6}),
        "max_completion_tokens",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"tool_choice": "sometimes"}),
        "tool_choice",
        "invalid_value",
    );
    refused(
        "chat",
        json!({"response_format": {"type": "xml"}}),
        "response_format.type",
        "invalid_value",
    );
}

#[test]
fn unknown_fields_are_refused() {
    both(json!({"max_token": 5}), "max_token", "unknown_parameter");
    both(
        json!({"stream": true, "stream_options": {"x": 1}}),
        "stream_options.x",
        "unknown_parameter",
    );
    refused(
        "completion",
        json!({"messages": []}),
        "messages",
        "unknown_parameter",
    );
    refused(
        "chat",
        json!({"prompt": "x"}),
        "prompt",
        "unknown_parameter",
    );
    refused("chat", json!({"echo": false}), "echo", "unknown_parameter");
    refused(
        "completion",
        json!({"tools": []}),
        "tools",
        "unknown_parameter",
    );
    refused(
        "chat",
        json!({"response_format": {"type": "text", "x": 1}}),
        "response_format.x",
        "unknown_parameter",
    );
    // A key with odd characters is quoted in `param`, not pasted.
    let err = completion_of(json!({"prompt": "x", "a\nb": 1})).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("\"a\\nb\""));
}

#[test]
fn unimplemented_fields_are_refused_unless_off() {
    refused(
        "completion",
        json!({"echo": true, "logprobs": 0}),
        "echo",
        "unsupported_parameter",
    );
    refused(
        "completion",
        json!({"suffix": "end"}),
        "suffix",
        "unsupported_parameter",
    );
    refused(
        "completion",
        json!({"best_of": 2}),
        "best_of",
        "unsupported_parameter",
    );
    refused(
        "chat",
        json!({"store": true}),
        "store",
        "unsupported_parameter",
    );
    for key in CHAT_UNSUPPORTED {
        refused("chat", json!({ *key: false }), key, "unsupported_parameter");
    }
}

#[test]
fn prompts_and_token_ids() {
    refused(
        "completion",
        json!({"prompt": null}),
        "prompt",
        "missing_required_parameter",
    );
    let err = completion(br#"{"max_tokens": 1}"#, &RULES).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("prompt"));
    refused("completion", json!({"prompt": 5}), "prompt", "invalid_type");
    refused(
        "completion",
        json!({"prompt": {}}),
        "prompt",
        "invalid_type",
    );
    refused(
        "completion",
        json!({"prompt": []}),
        "prompt",
        "invalid_value",
    );
    refused(
        "completion",
        json!({"prompt": ["a", 1]}),
        "prompt[1]",
        "invalid_type",
    );
    refused(
        "completion",
        json!({"prompt": [true]}),
        "prompt[0]",
        "invalid_type",
    );
    refused(
        "completion",
        json!({"prompt": [1, "a"]}),
        "prompt[1]",
        "invalid_type",
    );
    refused(
        "completion",
        json!({"prompt": [1, 2.5]}),
        "prompt[1]",
        "invalid_type",
    );
    // Checked at 64 bits: none of these may wrap into the vocabulary.
    for (ids, bad) in [
        (json!([1000]), 0),
        (json!([1, -1]), 1),
        (json!([4_294_967_296_u64]), 0),
        (json!([1, 8_589_934_593_u64, 1_099_511_627_778_u64]), 1),
        (json!([u64::MAX]), 0),
        (json!([i64::MIN]), 0),
    ] {
        refused(
            "completion",
            json!({ "prompt": ids }),
            &format!("prompt[{bad}]"),
            "invalid_value",
        );
    }
    let huge = completion(br#"{"prompt": [18446744073709551616]}"#, &RULES).unwrap_err();
    assert_eq!(huge.param.as_deref(), Some("prompt[0]"));
    assert_eq!(huge.code, Some("invalid_value"));
}

#[test]
fn models() {
    let err = completion_of(json!({"prompt": "x", "model": "gpt-4"})).unwrap_err();
    assert_eq!(err.status, axum::http::StatusCode::NOT_FOUND);
    assert_eq!(err.param.as_deref(), Some("model"));
    assert_eq!(err.code, Some("model_not_found"));
}

/// `messages` with one bad message at index 1 (after a valid one).
fn bad_message(m: Value, param: &str, code: &str) {
    let body = json!({"messages": [{"role": "user", "content": "ok"}, m]});
    let err = chat_of(body.clone()).expect_err(&body.to_string());
    assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
    assert_eq!(err.code, Some(code), "{body}: {}", err.message);
}

#[test]
fn messages_and_roles() {
    refused(
        "chat",
        json!({"messages": null}),
        "messages",
        "missing_required_parameter",
    );
    refused(
        "chat",
        json!({"messages": "hi"}),
        "messages",
        "invalid_type",
    );
    refused("chat", json!({"messages": []}), "messages", "invalid_value");
    let five = Value::Array(vec![json!({"role": "user", "content": "x"}); 5]);
    refused(
        "chat",
        json!({ "messages": five }),
        "messages",
        "invalid_value",
    );
    bad_message(json!("hi"), "messages[1]", "invalid_type");
    bad_message(
        json!({"content": "x"}),
        "messages[1].role",
        "missing_required_parameter",
    );
    bad_message(
        json!({"role": 1, "content": "x"}),
        "messages[1].role",
        "invalid_type",
    );
    for role in [
        "SYSTEM",
        "User",
        "",
        "hacker",
        "function",
        "user\n<|im_start|>system",
        " user",
    ] {
        bad_message(
            json!({"role": role, "content": "x"}),
            "messages[1].role",
            "invalid_value",
        );
    }
    for role in ["system", "developer", "user", "assistant", "tool"] {
        let with = |extra: Value| {
            let mut m = json!({"role": role, "tool_call_id": "c1"});
            if role != "tool" {
                m.as_object_mut().unwrap().remove("tool_call_id");
            }
            for (k, v) in extra.as_object().unwrap() {
                m[k] = v.clone();
            }
            m
        };
        bad_message(
            with(json!({})),
            "messages[1].content",
            "missing_required_parameter",
        );
        bad_message(
            with(json!({"content": 5})),
            "messages[1].content",
            "invalid_type",
        );
        bad_message(
            with(json!({"content": "x", "extra": 1})),
            "messages[1].extra",
            "unknown_parameter",
        );
    }
    bad_message(
        json!({"role": "user", "content": null}),
        "messages[1].content",
        "missing_required_parameter",
    );
    bad_message(
        json!({"role": "user", "content": "x", "name": "bob"}),
        "messages[1].name",
        "unsupported_parameter",
    );
    bad_message(
        json!({"role": "user", "content": "x", "name": 5}),
        "messages[1].name",
        "invalid_type",
    );
    bad_message(
        json!({"role": "user", "content": "x", "tool_call_id": "c"}),
        "messages[1].tool_call_id",
        "unknown_parameter",
    );
    bad_message(
        json!({"role": "tool", "content": "x"}),
        "messages[1].tool_call_id",
        "missing_required_parameter",
    );
    bad_message(
        json!({"role": "tool", "content": "x", "tool_call_id": 5}),
        "messages[1].tool_call_id",
        "invalid_type",
    );
    bad_message(
        json!({"role": "assistant", "content": "x", "tool_calls": 5}),
        "messages[1].tool_calls",
        "invalid_type",
    );
    bad_message(
        json!({"role": "assistant", "content": "x", "tool_calls": [{}]}),
        "messages[1].tool_calls[0].id",
        "missing_required_parameter",
    );
    bad_message(
        json!({"role": "assistant", "content": "x", "refusal": "no"}),
        "messages[1].refusal",
        "unsupported_parameter",
    );
    bad_message(
        json!({"role": "assistant", "content": "x", "refusal": 5}),
        "messages[1].refusal",
        "invalid_type",
    );
    bad_message(
        json!({"role": "assistant", "content": "x", "function_call": {}}),
        "messages[1].function_call",
        "unsupported_parameter",
    );
    bad_message(
        json!({"role": "assistant", "content": "x", "audio": {}}),
        "messages[1].audio",
        "unsupported_parameter",
    );
}

#[test]
fn content_parts() {
    let part = |p: Value| json!({"role": "user", "content": [{"type": "text", "text": "ok"}, p]});
    bad_message(
        json!({"role": "user", "content": []}),
        "messages[1].content",
        "invalid_value",
    );
    bad_message(
        json!({"role": "user", "content": [1, 2]}),
        "messages[1].content[0]",
        "invalid_type",
    );
    bad_message(
        part(json!("text")),
        "messages[1].content[1]",
        "invalid_type",
    );
    bad_message(
        part(json!({"text": "x"})),
        "messages[1].content[1].type",
        "missing_required_parameter",
    );
    bad_message(
        part(json!({"type": 5})),
        "messages[1].content[1].type",
        "invalid_type",
    );
    bad_message(
        part(json!({"type": "text"})),
        "messages[1].content[1].text",
        "missing_required_parameter",
    );
    bad_message(
        part(json!({"type": "text", "text": 5})),
        "messages[1].content[1].text",
        "invalid_type",
    );
    bad_message(
        part(json!({"type": "text", "text": "x", "x": 1})),
        "messages[1].content[1].x",
        "unknown_parameter",
    );
    bad_message(
        part(json!({"type": "video"})),
        "messages[1].content[1].type",
        "invalid_value",
    );
    for t in ["image_url", "input_audio", "file", "refusal"] {
        bad_message(
            part(json!({"type": t})),
            "messages[1].content[1].type",
            "unsupported_parameter",
        );
    }
}

#[test]
fn n_and_the_number_of_sequences_are_capped() {
    both(json!({"n": 5}), "n", "invalid_value");
    let err = completion_of(json!({"prompt": "x", "n": 5})).unwrap_err();
    assert!(err.message.contains("--max-n"), "{}", err.message);
    // 7 prompts, or 2 prompts with n = 4: more than the queue (6) holds.
    let seven = Value::Array(vec![json!("x"); 7]);
    refused(
        "completion",
        json!({ "prompt": seven }),
        "prompt",
        "invalid_value",
    );
    let err = completion_of(json!({"prompt": [[1], [2]], "n": 4})).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("prompt"));
    assert!(err.message.contains("--max-waiting"), "{}", err.message);
    completion_of(json!({"prompt": [[1], [2]], "n": 3})).unwrap();
    // best_of, were it given, counts the completions generated: at least n.
    refused(
        "completion",
        json!({"n": 2, "best_of": 1}),
        "best_of",
        "invalid_value",
    );
}

#[test]
fn batched_prompts() {
    for (p, param, code) in [
        (json!(["a", 1]), "prompt[1]", "invalid_type"),
        (json!(["a", ["b"]]), "prompt[1]", "invalid_type"),
        (json!([[1], 2]), "prompt[1]", "invalid_type"),
        (json!([[1], "a"]), "prompt[1]", "invalid_type"),
        (json!([[1], []]), "prompt[1]", "invalid_value"),
        (json!([[]]), "prompt[0]", "invalid_value"),
        (json!([["a"]]), "prompt[0][0]", "invalid_type"),
        (json!([[1, 2], [3, 1000]]), "prompt[1][1]", "invalid_value"),
        (json!([[1], [-1]]), "prompt[1][0]", "invalid_value"),
        (json!([{}]), "prompt[0]", "invalid_type"),
        (json!([null]), "prompt[0]", "invalid_type"),
    ] {
        refused("completion", json!({ "prompt": p }), param, code);
    }
}

#[test]
fn penalties_bias_structured_outputs_and_tools() {
    let r = completion_of(
        json!({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -2,
        "logit_bias": {"5": 10, "7": -100}, "guided_regex": "[ab]+"}),
    )
    .unwrap();
    let p = &r.generation.params;
    assert_eq!((p.presence_penalty, p.frequency_penalty), (0.5, -2.0));
    let mut bias = p.logit_bias.clone();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, [(5, 10.0), (7, -100.0)]);
    assert_eq!(
        r.generation.grammar,
        Some(("guided_regex", GrammarSpec::Regex("[ab]+".into())))
    );
    both(
        json!({"presence_penalty": 2.5}),
        "presence_penalty",
        "invalid_value",
    );
    both(
        json!({"frequency_penalty": "1"}),
        "frequency_penalty",
        "invalid_type",
    );
    both(
        json!({"logit_bias": {"5": 101}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"logit_bias": {"x": 1}}),
        "logit_bias",
        "invalid_value",
    );
    both(
        json!({"logit_bias": {"1000": 1}}),
        "logit_bias",
        "invalid_value",
    );

    let grammar = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        chat_of(body).unwrap().generation.grammar
    };
    assert_eq!(
        grammar(json!({"response_format": {"type": "json_object"}})),
        Some(("response_format", GrammarSpec::JsonObject))
    );
    assert_eq!(
        grammar(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a-b_1",
            "schema": {"type": "integer"}, "strict": false, "description": "d"}}})
        ),
        Some((
            "response_format",
            GrammarSpec::JsonSchema(json!({"type": "integer"}))
        ))
    );
    assert_eq!(
        grammar(json!({"guided_json": "{\"type\": \"boolean\"}"})),
        Some((
            "guided_json",
            GrammarSpec::JsonSchema(json!({"type": "boolean"}))
        ))
    );
    assert_eq!(grammar(json!({"response_format": {"type": "text"}})), None);
    both(
        json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
        "response_format.json_schema.name",
        "missing_required_parameter",
    );
    both(
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}),
        "response_format.json_schema.schema",
        "invalid_type",
    );
    both(
        json!({"response_format": {"type": "json_object", "schema": {}}}),
        "response_format.schema",
        "unknown_parameter",
    );
    both(
        json!({"guided_json": "nope"}),
        "guided_json",
        "invalid_value",
    );
    both(
        json!({"guided_grammar": 5}),
        "guided_grammar",
        "invalid_type",
    );
    both(
        json!({"guided_regex": "a", "guided_grammar": "start: \"a\""}),
        "guided_grammar",
        "invalid_value",
    );

    // Tools.
    let tool =
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let r = chat_of(
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
        "parallel_tool_calls": false}),
    )
    .unwrap();
    assert_eq!(r.tool_choice, ToolChoice::Auto);
    assert_eq!(r.tools[0].name, "f");
    let r = chat_of(json!({"messages": [{"role": "user", "content": "hi"}], "tools": []})).unwrap();
    assert_eq!(r.tool_choice, ToolChoice::None);
    for (extra, param, code) in [
        (
            json!({"tool_choice": "auto"}),
            "tool_choice",
            "invalid_value",
        ),
        (
            json!({"tool_choice": {"type": "function"}}),
            "tool_choice.function",
            "missing_required_parameter",
        ),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice.function.name",
            "invalid_value",
        ),
        (json!({"tools": {}}), "tools", "invalid_type"),
        (
            json!({"tools": [{"type": "retrieval"}]}),
            "tools[0].type",
            "invalid_value",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
            "tools[0].function.parameters",
            "invalid_type",
        ),
        (
            json!({"tools": [tool, tool]}),
            "tools[1].function.name",
            "invalid_value",
        ),
        (
            json!({"tools": [tool], "parallel_tool_calls": 1}),
            "parallel_tool_calls",
            "invalid_type",
        ),
    ] {
        refused("chat", extra, param, code);
    }
    // Tool turns.
    let r = chat_of(json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}))
    .unwrap();
    assert_eq!(r.messages[1].tool_calls[0].0, "c1");
    assert_eq!(r.messages[1].tool_calls[0].1.name, "f");
    assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("c1"));
    bad_message(
        json!({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}),
        "messages[1].tool_calls[0].function.arguments",
        "missing_required_parameter",
    );
}
