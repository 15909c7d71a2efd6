//! The one validation layer for `/v1/completions` and `/v1/chat/completions`: a request body
//! becomes a typed [`CompletionRequest`] or [`ChatRequest`], or a 400 that names the offending
//! field in `param` (`temperature`, `messages[1].content[0].text`), in OpenAI's words and codes
//! (`invalid_type`, `invalid_value`, `missing_required_parameter`, `unknown_parameter`,
//! `unsupported_parameter`).
//!
//! The rules, as OpenAI's and vLLM's request models have them:
//! * every field has a type and a range (`temperature` 0 to 2, `top_p` in (0, 1], penalties -2 to
//!   2, `logit_bias` values -100 to 100, `top_logprobs` 0 to 20, `max_tokens` at least 1), and a
//!   value outside it is refused, never clamped; `null` means "not given";
//! * integers are JSON integers (`2.0` is not one), checked at 64 bits before any narrowing, so
//!   the token id 2^32 is out of the vocabulary rather than token 0;
//! * an unknown field is refused (a misspelt `max_token` must not silently mean the default);
//! * a field OpenAI defines but nibble does not implement is refused unless it holds the value
//!   that asks for nothing (`best_of: 1`, `suffix: ""`, ...);
//! * `n` is capped (`--max-n`), and a request never asks for more sequences (`n` times its
//!   prompts) than the engine's waiting queue holds, which could never admit it;
//! * chat roles come from a closed set, each with the fields it allows; the role string never
//!   reaches the chat template, so a client cannot forge a turn through it.
//!
//! Tokenizing and rendering the chat template happen after this, in `api`.

use nibble_engine::SamplingParams;
use nibble_engine::structured::GrammarSpec;
use nibble_model::sampling::MAX_TOP_LOGPROBS;
use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::tools::{Tool, ToolCall, ToolChoice};

/// What a request is checked against.
pub struct Rules<'a> {
    pub model_name: &'a str,
    pub vocab_size: usize,
    pub max_messages: usize,
    pub max_stop: usize,
    pub max_n: usize,
    /// The engine's waiting queue (`--max-waiting`): the most sequences one request may start.
    pub max_sequences: usize,
}

/// What both endpoints ask of the engine.
#[derive(Debug)]
pub struct Generation {
    /// Choices per prompt, each its own sequence.
    pub n: usize,
    pub params: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// vLLM's `stop_token_ids`: sampling one ends the choice, the token not in its text.
    pub stop_token_ids: Vec<u32>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// Alternatives to report per token; `Some(0)` reports the chosen token's log-probability.
    pub logprobs: Option<usize>,
    /// Structured output, and the field that asked for it (for errors when it is compiled).
    pub grammar: Option<(&'static str, GrammarSpec)>,
}

#[derive(Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug)]
pub struct CompletionRequest {
    /// One prompt, or a batch: each gets `n` choices.
    pub prompts: Vec<Prompt>,
    /// Each choice's text starts with its prompt's.
    pub echo: bool,
    pub generation: Generation,
}

#[derive(Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub generation: Generation,
    pub tools: Vec<Tool>,
    /// `none` when no tools are given; `auto` by default when some are.
    pub tool_choice: ToolChoice,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    const NAMES: [(&'static str, Role); 5] = [
        ("system", Role::System),
        ("developer", Role::Developer),
        ("user", Role::User),
        ("assistant", Role::Assistant),
        ("tool", Role::Tool),
    ];

    /// The role as the chat template sees it. `developer` is OpenAI's newer name for the
    /// system turn; templates written before it know only `system`.
    pub fn template_name(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// An assistant turn's calls: (id, call).
    pub tool_calls: Vec<(String, ToolCall)>,
    /// A tool result's call id.
    pub tool_call_id: Option<String>,
}

/// Fields both endpoints take. `user` is OpenAI's end-user id for abuse monitoring; it never
/// changes the output, so it is accepted (as a string) and not recorded.
const COMMON: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    // vLLM's extensions, which nibble implements.
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "response_format",
    // vLLM's structured-output extensions (`guided_grammar` in llguidance's Lark dialect).
    "guided_json",
    "guided_regex",
    "guided_grammar",
];
const COMPLETION_ONLY: &[&str] = &["prompt", "echo", "suffix", "best_of"];
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "store",
];
/// OpenAI chat fields nibble does not implement and that have no "off" value worth checking:
/// any value but `null` is refused.
const CHAT_UNSUPPORTED: &[&str] = &[
    "functions",
    "function_call",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "verbosity",
];

/// Parses a body that must be one JSON object.
pub fn json_object(body: &[u8]) -> ApiResult<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::invalid_type("body", "a JSON object", &other)),
        Err(e) => Err(ApiError::bad(
            "body",
            "invalid_json",
            format!("The request body is not valid JSON: {e}."),
        )),
    }
}

pub fn completion(body: &[u8], rules: &Rules) -> ApiResult<CompletionRequest> {
    let map = json_object(body)?;
    let o = Obj::top(&map);
    o.only(&[COMMON, COMPLETION_ONLY])?;
    model(&o, rules)?;
    let prompts = prompts(&o, rules.vocab_size)?;
    let mut generation = generation(&o, rules)?;
    sequences(prompts.len(), generation.n, rules)?;
    generation.logprobs = o
        .int_in("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    let echo = o.bool("echo")?.unwrap_or(false);
    if echo && generation.logprobs.is_some() {
        return Err(ApiError::unsupported(
            "echo",
            "with 'logprobs' is not supported: nibble does not compute the prompt's log-probabilities",
        ));
    }
    if o.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "is not supported: nibble does not insert text",
        ));
    }
    if let Some(b) = o.int_in("best_of", 1, i64::MAX)? {
        if b > 1 {
            return Err(ApiError::unsupported(
                "best_of",
                "above 1 is not supported: use 'n' for several completions",
            ));
        }
        if (b as usize) < generation.n {
            return Err(ApiError::invalid_value(
                "best_of",
                "it must be at least 'n' (it is how many completions are generated to return 'n').",
            ));
        }
    }
    Ok(CompletionRequest {
        prompts,
        echo,
        generation,
    })
}

/// Refuses a request for more sequences than the waiting queue holds: it could never be
/// admitted, so "retry later" (429) would be wrong.
fn sequences(prompts: usize, n: usize, rules: &Rules) -> ApiResult<()> {
    let total = prompts.saturating_mul(n);
    if total <= rules.max_sequences {
        return Ok(());
    }
    let (param, what) = if prompts > 1 {
        (
            "prompt",
            format!("{prompts} prompts with n = {n} are {total} sequences"),
        )
    } else {
        ("n", format!("{n} choices"))
    };
    Err(ApiError::invalid_value(
        param,
        format!(
            "{what}; this server queues at most {} at once (--max-waiting).",
            rules.max_sequences
        ),
    ))
}

pub fn chat(body: &[u8], rules: &Rules) -> ApiResult<ChatRequest> {
    let map = json_object(body)?;
    let o = Obj::top(&map);
    o.only(&[COMMON, CHAT_ONLY, CHAT_UNSUPPORTED])?;
    model(&o, rules)?;
    let messages = messages(&o, rules.max_messages)?;
    let mut generation = generation(&o, rules)?;
    sequences(1, generation.n, rules)?;
    if let Some(m) = o.int_in("max_completion_tokens", 1, i64::MAX)? {
        if generation.max_tokens.is_some_and(|t| t != m as usize) {
            return Err(ApiError::invalid_value(
                "max_completion_tokens",
                "it is the newer name of 'max_tokens'; give one of them, or both equal.",
            ));
        }
        generation.max_tokens = Some(m as usize);
    }
    let top = o.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    generation.logprobs = match (o.bool("logprobs")?, top) {
        (Some(true), top) => Some(top.unwrap_or(0) as usize),
        (_, Some(_)) => {
            return Err(ApiError::invalid_value(
                "top_logprobs",
                "it needs 'logprobs' to be true.",
            ));
        }
        (_, None) => None,
    };
    let tools = tools(&o)?;
    let tool_choice = tool_choice(&o, &tools)?;
    // Parsing takes every call the model writes; a reply held to a grammar makes one. Either
    // value is honest.
    o.bool("parallel_tool_calls")?;
    if tool_choice != ToolChoice::None && generation.grammar.is_some() {
        return Err(ApiError::invalid_value(
            "tool_choice",
            "tools and a structured output cannot be combined; give 'tool_choice': 'none'.",
        ));
    }
    if o.bool("store")? == Some(true) {
        return Err(ApiError::unsupported(
            "store",
            "is not supported: nibble keeps no completions",
        ));
    }
    for key in CHAT_UNSUPPORTED {
        if o.get(key).is_some() {
            return Err(ApiError::unsupported(key, "is not supported yet"));
        }
    }
    Ok(ChatRequest {
        messages,
        generation,
        tools,
        tool_choice,
    })
}

/// A JSON object's fields, named by their path in the request for errors. `null` reads as
/// absent, as in OpenAI's API.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Obj<'a> {
    fn top(map: &'a Map<String, Value>) -> Self {
        Obj {
            map,
            prefix: String::new(),
        }
    }

    fn nested(map: &'a Map<String, Value>, prefix: String) -> Self {
        Obj { map, prefix }
    }

    fn path(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    /// Refuses the first field not in `known`.
    fn only(&self, known: &[&[&str]]) -> ApiResult<()> {
        match self
            .map
            .keys()
            .find(|k| !known.iter().any(|set| set.contains(&k.as_str())))
        {
            Some(k) => Err(ApiError::unknown(&self.path(&quote_key(k)))),
            None => Ok(()),
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn bool(&self, key: &str) -> ApiResult<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid_type(&self.path(key), "a boolean", v)),
        }
    }

    fn str(&self, key: &str) -> ApiResult<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid_type(&self.path(key), "a string", v)),
        }
    }

    /// An integer in `lo..=hi`.
    fn int_in(&self, key: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let param = self.path(key);
        let n = integer(&param, v)?;
        if n < lo || n > hi {
            let want = if hi == i64::MAX {
                format!("at least {lo}")
            } else {
                format!("from {lo} to {hi}")
            };
            return Err(ApiError::invalid_value(
                &param,
                format!("expected an integer {want}, but got {n}."),
            ));
        }
        Ok(Some(n))
    }

    /// A number in the range `lo`..=`hi`, or (`lo_open`) above `lo`.
    fn number_in(&self, key: &str, lo: f64, lo_open: bool, hi: f64) -> ApiResult<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let param = self.path(key);
        let x = number(&param, v)?;
        if x > hi || x < lo || (lo_open && x == lo) {
            let low = if lo_open { "above" } else { "at least" };
            let high = if hi.is_finite() {
                format!(" and at most {hi}")
            } else {
                String::new()
            };
            return Err(ApiError::invalid_value(
                &param,
                format!("expected a number {low} {lo}{high}, but got {v}."),
            ));
        }
        Ok(Some(x))
    }
}

/// A JSON integer as an `i64`. serde_json reads an integer beyond 64 bits as a decimal, so a
/// whole decimal that large is reported as out of range rather than as a type error.
fn integer(param: &str, v: &Value) -> ApiResult<i64> {
    let Value::Number(n) = v else {
        return Err(ApiError::invalid_type(param, "an integer", v));
    };
    if let Some(i) = n.as_i64() {
        return Ok(i);
    }
    let huge = n.is_u64()
        || n.as_f64()
            .is_some_and(|f| f.fract() == 0.0 && f.abs() >= 9.2e18);
    if huge {
        Err(ApiError::invalid_value(
            param,
            format!("{n} is out of the 64-bit integer range."),
        ))
    } else {
        Err(ApiError::invalid_type(param, "an integer", v))
    }
}

fn number(param: &str, v: &Value) -> ApiResult<f64> {
    match v.as_f64() {
        Some(x) if v.is_number() => Ok(x),
        _ => Err(ApiError::invalid_type(param, "a number", v)),
    }
}

/// A client's string inside a message, shortened and escaped.
fn quote(s: &str) -> String {
    let short: String = s.chars().take(40).collect();
    let more = if short.len() < s.len() { "..." } else { "" };
    format!("{:?}{more}", short)
}

/// A field name as part of `param`: names with odd characters are escaped and shortened.
fn quote_key(k: &str) -> String {
    let plain = k.len() <= 64
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain { k.to_string() } else { quote(k) }
}

fn model(o: &Obj, rules: &Rules) -> ApiResult<()> {
    match o.str("model")? {
        Some(m) if m != rules.model_name => Err(ApiError::client(
            axum::http::StatusCode::NOT_FOUND,
            "model_not_found",
            format!(
                "The model {} does not exist; this server serves '{}'.",
                quote(m),
                rules.model_name
            ),
        )
        .param("model")),
        _ => Ok(()),
    }
}

fn generation(o: &Obj, rules: &Rules) -> ApiResult<Generation> {
    let stream = o.bool("stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None => false,
        Some(Value::Object(m)) => {
            if !stream {
                return Err(ApiError::invalid_value(
                    "stream_options",
                    "it is only allowed when 'stream' is true.",
                ));
            }
            let so = Obj::nested(m, "stream_options".into());
            so.only(&[&["include_usage"]])?;
            so.bool("include_usage")?.unwrap_or(false)
        }
        Some(v) => return Err(ApiError::invalid_type("stream_options", "an object", v)),
    };
    let max_tokens = o.int_in("max_tokens", 1, i64::MAX)?.map(|m| m as usize);
    let n = o.int_in("n", 1, i64::MAX)?.unwrap_or(1);
    if n as u64 > rules.max_n as u64 {
        return Err(ApiError::invalid_value(
            "n",
            format!(
                "{n} choices; this server generates at most {} per request (--max-n).",
                rules.max_n
            ),
        ));
    }
    // vLLM's convention: -1 (or 0) turns top-k off; nothing below that means anything.
    let top_k = match o.get("top_k") {
        None => 0,
        Some(v) => match integer("top_k", v)? {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::invalid_value(
                    "top_k",
                    format!("expected -1 or 0 (off) or at least 1, but got {k}."),
                ));
            }
        },
    };
    let params = SamplingParams {
        temperature: o.number_in("temperature", 0.0, false, 2.0)?.unwrap_or(1.0) as f32,
        top_p: o.number_in("top_p", 0.0, true, 1.0)?.unwrap_or(1.0) as f32,
        top_k,
        min_p: o.number_in("min_p", 0.0, false, 1.0)?.unwrap_or(0.0) as f32,
        repetition_penalty: o
            .number_in("repetition_penalty", 0.0, true, f64::INFINITY)?
            .unwrap_or(1.0) as f32,
        // Any 64-bit seed; a negative one is the same 64 bits read unsigned.
        seed: o.int_in("seed", i64::MIN, i64::MAX)?.map(|s| s as u64),
        ..SamplingParams::default()
    };
    // A float32 sampler cannot tell a repetition penalty of 1e300 from infinity.
    if !params.repetition_penalty.is_finite() {
        return Err(ApiError::invalid_value(
            "repetition_penalty",
            "expected a number above 0 that fits in 32 bits.",
        ));
    }
    let params = SamplingParams {
        presence_penalty: o
            .number_in("presence_penalty", -2.0, false, 2.0)?
            .unwrap_or(0.0) as f32,
        frequency_penalty: o
            .number_in("frequency_penalty", -2.0, false, 2.0)?
            .unwrap_or(0.0) as f32,
        logit_bias: logit_bias(o, rules.vocab_size)?,
        ..params
    };
    o.str("user")?;
    Ok(Generation {
        n: n as usize,
        params,
        max_tokens,
        stop: stop(o, rules.max_stop)?,
        stop_token_ids: stop_token_ids(o, rules)?,
        stream,
        include_usage,
        ignore_eos: o.bool("ignore_eos")?.unwrap_or(false),
        logprobs: None,
        grammar: grammar(o)?,
    })
}

fn stop(o: &Obj, max: usize) -> ApiResult<Vec<String>> {
    let list = match o.get("stop") {
        None => return Ok(vec![]),
        Some(Value::String(s)) => vec![("stop".to_string(), s)],
        Some(Value::Array(a)) => {
            if a.len() > max {
                return Err(ApiError::invalid_value(
                    "stop",
                    format!(
                        "{} stop strings; this server takes at most {max} (--max-stop-strings).",
                        a.len()
                    ),
                ));
            }
            let mut list = Vec::with_capacity(a.len());
            for (i, v) in a.iter().enumerate() {
                let param = format!("stop[{i}]");
                match v {
                    Value::String(s) => list.push((param, s)),
                    v => return Err(ApiError::invalid_type(&param, "a string", v)),
                }
            }
            list
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "stop",
                "a string or an array of strings",
                v,
            ));
        }
    };
    list.into_iter()
        .map(|(param, s)| {
            if s.is_empty() {
                Err(ApiError::invalid_value(
                    &param,
                    "an empty stop string would end every completion before it starts.",
                ))
            } else {
                Ok(s.clone())
            }
        })
        .collect()
}

fn stop_token_ids(o: &Obj, rules: &Rules) -> ApiResult<Vec<u32>> {
    let a = match o.get("stop_token_ids") {
        None => return Ok(vec![]),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid_type(
                "stop_token_ids",
                "an array of token ids",
                v,
            ));
        }
    };
    if a.len() > rules.max_stop {
        return Err(ApiError::invalid_value(
            "stop_token_ids",
            format!(
                "{} stop token ids; this server takes at most {} (--max-stop-strings).",
                a.len(),
                rules.max_stop
            ),
        ));
    }
    a.iter()
        .enumerate()
        .map(|(i, v)| token_id(&format!("stop_token_ids[{i}]"), v, rules.vocab_size))
        .collect()
}

fn logit_bias(o: &Obj, vocab_size: usize) -> ApiResult<Vec<(u32, f32)>> {
    let map = match o.get("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid_type(
                "logit_bias",
                "an object from token ids to numbers",
                v,
            ));
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let token = k
            .parse::<i64>()
            .ok()
            .filter(|&t| t >= 0 && (t as u64) < vocab_size as u64);
        let Some(token) = token else {
            return Err(ApiError::invalid_value(
                "logit_bias",
                format!(
                    "the key {} is not a token id from 0 to {}.",
                    quote(k),
                    vocab_size - 1
                ),
            ));
        };
        let b = number("logit_bias", v)?;
        if !(-100.0..=100.0).contains(&b) {
            return Err(ApiError::invalid_value(
                "logit_bias",
                format!("the bias for token {k} is {v}; expected a number from -100 to 100."),
            ));
        }
        out.push((token as u32, b as f32));
    }
    Ok(out)
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of lists of token ids
/// (the lists of several are a batch).
fn prompts(o: &Obj, vocab_size: usize) -> ApiResult<Vec<Prompt>> {
    const WANT: &str =
        "a string, an array of strings, an array of token ids or an array of arrays of token ids";
    let a = match o.get("prompt") {
        None => return Err(ApiError::missing("prompt")),
        Some(Value::String(s)) => return Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::invalid_type("prompt", WANT, v)),
    };
    let ids = |param: &str, a: &[Value]| {
        a.iter()
            .enumerate()
            .map(|(i, v)| token_id(&format!("{param}[{i}]"), v, vocab_size))
            .collect::<ApiResult<Vec<u32>>>()
    };
    match a.first() {
        None => Err(ApiError::invalid_value(
            "prompt",
            "the array is empty; give a string, strings, token ids or arrays of token ids.",
        )),
        Some(Value::String(_)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                v => Err(ApiError::invalid_type(
                    &format!("prompt[{i}]"),
                    "a string",
                    v,
                )),
            })
            .collect(),
        Some(Value::Number(_)) => Ok(vec![Prompt::Tokens(ids("prompt", a)?)]),
        Some(Value::Array(_)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let param = format!("prompt[{i}]");
                match v {
                    Value::Array(inner) if inner.is_empty() => Err(ApiError::invalid_value(
                        &param,
                        "the array is empty; give at least one token id.",
                    )),
                    Value::Array(inner) => Ok(Prompt::Tokens(ids(&param, inner)?)),
                    v => Err(ApiError::invalid_type(&param, "an array of token ids", v)),
                }
            })
            .collect(),
        Some(v) => Err(ApiError::invalid_type(
            "prompt[0]",
            "a string, a token id or an array of token ids",
            v,
        )),
    }
}

/// A token id, checked against the vocabulary as a 64-bit integer before it is narrowed.
fn token_id(param: &str, v: &Value, vocab_size: usize) -> ApiResult<u32> {
    let t = integer(param, v).map_err(|e| match e.code {
        Some("invalid_type") => ApiError::invalid_type(param, "an integer token id", v),
        _ => e,
    })?;
    if t < 0 || t as u64 >= vocab_size as u64 {
        return Err(ApiError::invalid_value(
            param,
            format!(
                "token id {t} is outside the vocabulary (0 to {}).",
                vocab_size - 1
            ),
        ));
    }
    Ok(t as u32)
}

fn messages(o: &Obj, max: usize) -> ApiResult<Vec<Message>> {
    let a = match o.get("messages") {
        None => return Err(ApiError::missing("messages")),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid_type(
                "messages",
                "an array of messages",
                v,
            ));
        }
    };
    if a.is_empty() {
        return Err(ApiError::invalid_value(
            "messages",
            "the array is empty; give at least one message.",
        ));
    }
    if a.len() > max {
        return Err(ApiError::invalid_value(
            "messages",
            format!(
                "{} messages; this server takes at most {max} (--max-messages).",
                a.len()
            ),
        ));
    }
    a.iter()
        .enumerate()
        .map(|(i, m)| message(format!("messages[{i}]"), m))
        .collect()
}

fn message(path: String, v: &Value) -> ApiResult<Message> {
    let Value::Object(m) = v else {
        return Err(ApiError::invalid_type(&path, "an object", v));
    };
    let o = Obj::nested(m, path);
    let role = match o.get("role") {
        None => return Err(ApiError::missing(&o.path("role"))),
        Some(Value::String(s)) => Role::NAMES
            .iter()
            .find(|(name, _)| name == s)
            .map(|&(_, r)| r)
            .ok_or_else(|| {
                ApiError::invalid_value(
                    &o.path("role"),
                    format!(
                        "{} is not a role; expected one of 'system', 'developer', 'user', 'assistant', 'tool'.",
                        quote(s)
                    ),
                )
            })?,
        Some(v) => return Err(ApiError::invalid_type(&o.path("role"), "a string", v)),
    };
    match role {
        Role::System | Role::Developer | Role::User => o.only(&[&["role", "content", "name"]])?,
        Role::Assistant => o.only(&[&[
            "role",
            "content",
            "name",
            "refusal",
            "tool_calls",
            "function_call",
            "audio",
        ]])?,
        Role::Tool => o.only(&[&["role", "content", "tool_call_id"]])?,
    }
    if o.get("name").is_some() {
        o.str("name")?;
        return Err(ApiError::unsupported(
            &o.path("name"),
            "is not supported: the chat template does not show participant names",
        ));
    }
    if role == Role::Assistant {
        if o.str("refusal")?.is_some() {
            return Err(ApiError::unsupported(
                &o.path("refusal"),
                "is not supported: give the refusal as 'content'",
            ));
        }
        for key in ["function_call", "audio"] {
            if o.get(key).is_some() {
                return Err(ApiError::unsupported(&o.path(key), "is not supported"));
            }
        }
    }
    let tool_call_id = o.str("tool_call_id")?.map(str::to_string);
    if role == Role::Tool && tool_call_id.is_none() {
        return Err(ApiError::missing(&o.path("tool_call_id")));
    }
    let tool_calls = if role == Role::Assistant {
        tool_calls(&o)?
    } else {
        Vec::new()
    };
    // An assistant turn that calls tools may have no content (OpenAI sends `null`).
    let content = if !tool_calls.is_empty() && o.get("content").is_none() {
        String::new()
    } else {
        content(&o)?
    };
    Ok(Message {
        role,
        content,
        tool_calls,
        tool_call_id,
    })
}

/// A function or tool name as OpenAI allows it.
fn name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `tools`: `[{"type": "function", "function": {"name", "description", "parameters",
/// "strict"}}]`.
fn tools(o: &Obj) -> ApiResult<Vec<Tool>> {
    let a = match o.get("tools") {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::invalid_type("tools", "an array of tools", v)),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(a.len());
    for (i, v) in a.iter().enumerate() {
        let path = format!("tools[{i}]");
        let Value::Object(m) = v else {
            return Err(ApiError::invalid_type(&path, "a tool object", v));
        };
        let t = Obj::nested(m, path);
        t.only(&[&["type", "function"]])?;
        match t.str("type")? {
            None => return Err(ApiError::missing(&t.path("type"))),
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::invalid_value(
                    &t.path("type"),
                    format!("{} is not a tool type; expected 'function'.", quote(other)),
                ));
            }
        }
        let f = match t.get("function") {
            None => return Err(ApiError::missing(&t.path("function"))),
            Some(Value::Object(m)) => Obj::nested(m, t.path("function")),
            Some(v) => return Err(ApiError::invalid_type(&t.path("function"), "an object", v)),
        };
        f.only(&[&["name", "description", "parameters", "strict"]])?;
        let name = match f.str("name")? {
            None => return Err(ApiError::missing(&f.path("name"))),
            Some(n) if !name_ok(n) => {
                return Err(ApiError::invalid_value(
                    &f.path("name"),
                    format!(
                        "{} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'.",
                        quote(n)
                    ),
                ));
            }
            Some(n) => n.to_string(),
        };
        if out.iter().any(|t| t.name == name) {
            return Err(ApiError::invalid_value(
                &f.path("name"),
                format!("{} names two tools.", quote(&name)),
            ));
        }
        f.str("description")?;
        f.bool("strict")?;
        let parameters = match f.get("parameters") {
            None => serde_json::json!({"type": "object", "properties": {}}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => {
                return Err(ApiError::invalid_type(
                    &f.path("parameters"),
                    "a JSON schema object",
                    v,
                ));
            }
        };
        out.push(Tool {
            name,
            spec: v.clone(),
            parameters,
        });
    }
    Ok(out)
}

fn tool_choice(o: &Obj, tools: &[Tool]) -> ApiResult<ToolChoice> {
    let choice = match o.get("tool_choice") {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            s => {
                return Err(ApiError::invalid_value(
                    "tool_choice",
                    format!("{} is not one of 'none', 'auto', 'required'.", quote(s)),
                ));
            }
        },
        Some(Value::Object(m)) => {
            let c = Obj::nested(m, "tool_choice".into());
            c.only(&[&["type", "function"]])?;
            if c.str("type")? != Some("function") {
                return Err(ApiError::invalid_value(
                    "tool_choice.type",
                    "expected 'function'.",
                ));
            }
            let f = match c.get("function") {
                Some(Value::Object(m)) => Obj::nested(m, "tool_choice.function".into()),
                Some(v) => {
                    return Err(ApiError::invalid_type(
                        "tool_choice.function",
                        "an object",
                        v,
                    ));
                }
                None => return Err(ApiError::missing("tool_choice.function")),
            };
            f.only(&[&["name"]])?;
            match f.str("name")? {
                None => return Err(ApiError::missing("tool_choice.function.name")),
                Some(n) => ToolChoice::Function(n.to_string()),
            }
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "tool_choice",
                "a string or a function object",
                v,
            ));
        }
    };
    match &choice {
        ToolChoice::Auto | ToolChoice::Required if tools.is_empty() => {
            Err(ApiError::invalid_value("tool_choice", "it needs 'tools'."))
        }
        ToolChoice::Function(n) if !tools.iter().any(|t| &t.name == n) => {
            Err(ApiError::invalid_value(
                "tool_choice.function.name",
                format!("{} is not one of the request's tools.", quote(n)),
            ))
        }
        _ => Ok(choice),
    }
}

/// An assistant message's `tool_calls`: `[{"id", "type": "function", "function": {"name",
/// "arguments"}}]`, the arguments a JSON string.
fn tool_calls(o: &Obj) -> ApiResult<Vec<(String, ToolCall)>> {
    let a = match o.get("tool_calls") {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid_type(
                &o.path("tool_calls"),
                "an array of tool calls",
                v,
            ));
        }
    };
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            let path = o.path(&format!("tool_calls[{i}]"));
            let Value::Object(m) = v else {
                return Err(ApiError::invalid_type(&path, "a tool call object", v));
            };
            let c = Obj::nested(m, path);
            c.only(&[&["id", "type", "function"]])?;
            let id = c
                .str("id")?
                .ok_or_else(|| ApiError::missing(&c.path("id")))?
                .to_string();
            if c.str("type")?.is_some_and(|t| t != "function") {
                return Err(ApiError::invalid_value(
                    &c.path("type"),
                    "expected 'function'.",
                ));
            }
            let f = match c.get("function") {
                Some(Value::Object(m)) => Obj::nested(m, c.path("function")),
                Some(v) => return Err(ApiError::invalid_type(&c.path("function"), "an object", v)),
                None => return Err(ApiError::missing(&c.path("function"))),
            };
            f.only(&[&["name", "arguments"]])?;
            let name = f
                .str("name")?
                .ok_or_else(|| ApiError::missing(&f.path("name")))?
                .to_string();
            let arguments = f
                .str("arguments")?
                .ok_or_else(|| ApiError::missing(&f.path("arguments")))?
                .to_string();
            Ok((id, ToolCall { name, arguments }))
        })
        .collect()
}

/// A message's `content`: a string, or an array of text parts (joined with newlines, as vLLM
/// does). Every role needs one here: the roles that may go without (an assistant turn with
/// tool calls) need features nibble does not have.
fn content(o: &Obj) -> ApiResult<String> {
    let param = o.path("content");
    let parts = match o.get("content") {
        None => return Err(ApiError::missing(&param)),
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid_type(
                &param,
                "a string or an array of content parts",
                v,
            ));
        }
    };
    if parts.is_empty() {
        return Err(ApiError::invalid_value(
            &param,
            "the array is empty; give a string or at least one text part.",
        ));
    }
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let path = format!("{param}[{j}]");
        let Value::Object(m) = part else {
            return Err(ApiError::invalid_type(&path, "a content part object", part));
        };
        let p = Obj::nested(m, path);
        match p.str("type")? {
            None => return Err(ApiError::missing(&p.path("type"))),
            Some("text") => {}
            Some(t @ ("image_url" | "input_audio" | "file" | "refusal")) => {
                return Err(ApiError::unsupported(
                    &p.path("type"),
                    &format!("'{t}' is not supported: this model reads text only"),
                ));
            }
            Some(t) => {
                return Err(ApiError::invalid_value(
                    &p.path("type"),
                    format!("{} is not a content part type; expected 'text'.", quote(t)),
                ));
            }
        }
        p.only(&[&["type", "text"]])?;
        match p.str("text")? {
            Some(t) => texts.push(t),
            None => return Err(ApiError::missing(&p.path("text"))),
        }
    }
    Ok(texts.join("\n"))
}

/// The structured output asked for: `response_format` (OpenAI's), or one of vLLM's
/// `guided_json`, `guided_regex`, `guided_grammar`; at most one of them.
fn grammar(o: &Obj) -> ApiResult<Option<(&'static str, GrammarSpec)>> {
    let mut found: Vec<(&'static str, GrammarSpec)> = Vec::new();
    if let Some(spec) = response_format(o)? {
        found.push(("response_format", spec));
    }
    match o.get("guided_json") {
        None => {}
        Some(Value::Object(_)) => found.push((
            "guided_json",
            GrammarSpec::JsonSchema(o.get("guided_json").cloned().unwrap_or_default()),
        )),
        // vLLM also takes the schema as a JSON string.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ (Value::Object(_) | Value::Bool(_))) => {
                found.push(("guided_json", GrammarSpec::JsonSchema(v)))
            }
            _ => {
                return Err(ApiError::invalid_value(
                    "guided_json",
                    "the string is not a JSON schema (a JSON object).",
                ));
            }
        },
        Some(v) => {
            return Err(ApiError::invalid_type(
                "guided_json",
                "a JSON schema object",
                v,
            ));
        }
    }
    if let Some(rx) = o.str("guided_regex")? {
        found.push(("guided_regex", GrammarSpec::Regex(rx.to_string())));
    }
    if let Some(g) = o.str("guided_grammar")? {
        found.push(("guided_grammar", GrammarSpec::Lark(g.to_string())));
    }
    if found.len() > 1 {
        return Err(ApiError::invalid_value(
            found[1].0,
            format!(
                "only one structured output may be asked for, and '{}' already is.",
                found[0].0
            ),
        ));
    }
    Ok(found.pop())
}

fn response_format(o: &Obj) -> ApiResult<Option<GrammarSpec>> {
    let m = match o.get("response_format") {
        None => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(ApiError::invalid_type("response_format", "an object", v)),
    };
    let f = Obj::nested(m, "response_format".into());
    match f.str("type")? {
        None => Err(ApiError::missing("response_format.type")),
        Some("text") => f.only(&[&["type"]]).map(|()| None),
        Some("json_object") => f.only(&[&["type"]]).map(|()| Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            f.only(&[&["type", "json_schema"]])?;
            let js = match f.get("json_schema") {
                None => return Err(ApiError::missing("response_format.json_schema")),
                Some(Value::Object(m)) => Obj::nested(m, "response_format.json_schema".into()),
                Some(v) => {
                    return Err(ApiError::invalid_type(
                        "response_format.json_schema",
                        "an object",
                        v,
                    ));
                }
            };
            js.only(&[&["name", "description", "schema", "strict"]])?;
            // OpenAI's rule for the name: it appears in no output, but a client that breaks it
            // would be refused there too.
            match js.str("name")? {
                None => return Err(ApiError::missing("response_format.json_schema.name")),
                Some(n)
                    if n.is_empty()
                        || n.len() > 64
                        || !n
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
                {
                    return Err(ApiError::invalid_value(
                        "response_format.json_schema.name",
                        format!(
                            "{} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'.",
                            quote(n)
                        ),
                    ));
                }
                Some(_) => {}
            }
            js.str("description")?;
            // `strict: false` asks for less than nibble does: the schema is always enforced.
            js.bool("strict")?;
            match js.get("schema") {
                // OpenAI's schema is optional; without one, any JSON object.
                None => Ok(Some(GrammarSpec::JsonObject)),
                Some(v @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(GrammarSpec::JsonSchema(v.clone())))
                }
                Some(v) => Err(ApiError::invalid_type(
                    "response_format.json_schema.schema",
                    "a JSON schema object",
                    v,
                )),
            }
        }
        Some(t) => Err(ApiError::invalid_value(
            "response_format.type",
            format!(
                "{} is not one of 'text', 'json_object', 'json_schema'.",
                quote(t)
            ),
        )),
    }
}

#[cfg(test)]
#[path = "validate_tests.rs"]
mod tests;
