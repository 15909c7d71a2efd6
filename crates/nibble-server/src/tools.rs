//! Tool calling: the tools go to the model through its own chat template (or, for a template
//! that has no place for them, a system message in Hermes' words), and the model's reply is
//! parsed back into OpenAI's `tool_calls`.
//!
//! Two output formats, chosen by the template: Hermes / Qwen (`<tool_call>{"name": ...,
//! "arguments": {...}}</tool_call>`, one block per call), and Llama 3.1's JSON (`{"name": ...,
//! "parameters": {...}}`, after an optional `<|python_tag|>`). `tool_choice: "required"` or a
//! named function holds the reply to that format with a grammar over the functions' parameter
//! schemas (the structured-output machinery), so the call always parses.

use nibble_engine::structured::{GrammarSpec, json_layout};
use serde_json::{Value, json};

/// How the model writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
}

/// What the model's chat template knows of tools.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TemplateTools {
    pub format: ToolFormat,
    /// The template renders the `tools` variable itself; otherwise nibble describes the tools
    /// in a system message and renders calls and results as text.
    pub renders_tools: bool,
}

impl TemplateTools {
    pub fn detect(template: &str) -> Self {
        let renders_tools = template.contains("tools");
        let llama = template.contains("<|python_tag|>") || template.contains("ipython");
        let format = if renders_tools && llama && !template.contains("<tool_call>") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        };
        TemplateTools {
            format,
            renders_tools,
        }
    }
}

/// One function offered to the model, as the request gave it.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The request's `{"type": "function", "function": {...}}` object, for the template.
    pub spec: Value,
    /// The parameters' JSON schema (`{"type": "object"}` when the request gave none).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

/// A parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON string, as OpenAI sends them.
    pub arguments: String,
}

/// The system message that describes `tools` to a model whose template does not (Qwen 2.5's
/// words, which Hermes-style models are trained on).
pub fn system_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.spec.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// An assistant turn's calls as the model would have written them (for templates that do not
/// render `tool_calls`).
pub fn calls_as_text(calls: &[ToolCall]) -> String {
    calls
        .iter()
        .map(|c| {
            let args: Value =
                serde_json::from_str(&c.arguments).unwrap_or(Value::String(c.arguments.clone()));
            format!(
                "<tool_call>\n{}\n</tool_call>",
                json!({"name": c.name, "arguments": args})
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The grammar that holds a reply to one call of the functions `choice` allows, or `None`
/// when the reply is free.
pub fn grammar(format: ToolFormat, tools: &[Tool], choice: &ToolChoice) -> Option<GrammarSpec> {
    let allowed: Vec<&Tool> = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function(name) => tools.iter().filter(|t| &t.name == name).collect(),
    };
    let args_key = match format {
        ToolFormat::Hermes => "arguments",
        ToolFormat::Llama3Json => "parameters",
    };
    let one = |t: &Tool| {
        json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: t.parameters},
            "required": ["name", args_key],
            "additionalProperties": false,
        })
    };
    let schema = match allowed.as_slice() {
        [t] => one(t),
        many => json!({"anyOf": many.iter().map(|t| one(t)).collect::<Vec<_>>()}),
    };
    let schema = json_layout(schema);
    let lark = match format {
        ToolFormat::Hermes => {
            format!("start: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"")
        }
        ToolFormat::Llama3Json => format!("start: %json {schema}"),
    };
    Some(GrammarSpec::Lark(lark))
}

/// Where a tool call may begin in `text`: the byte offset from which the text must be held
/// back (a call, or the start of one not yet complete), or `None` when all of it is content.
pub fn call_start(format: ToolFormat, text: &str) -> Option<usize> {
    match format {
        ToolFormat::Hermes => {
            const TAG: &str = "<tool_call>";
            if let Some(i) = text.find(TAG) {
                return Some(i);
            }
            // A tail that could still become the tag.
            (1..TAG.len())
                .rev()
                .find(|&k| {
                    text.len() >= k
                        && text.is_char_boundary(text.len() - k)
                        && TAG.starts_with(&text[text.len() - k..])
                })
                .map(|k| text.len() - k)
        }
        ToolFormat::Llama3Json => {
            // A Llama call is the whole reply: hold it from its first character if that opens
            // JSON or the python tag.
            let trimmed = text.trim_start();
            let lead = text.len() - trimmed.len();
            if trimmed.is_empty()
                || trimmed.starts_with('{')
                || "<|python_tag|>".starts_with(trimmed)
                || trimmed.starts_with("<|python_tag|>")
            {
                Some(lead.min(text.len()))
            } else {
                None
            }
        }
    }
}

/// The reply split into content and calls; `None` when it holds no well-formed call (then
/// it is all content).
pub fn parse(format: ToolFormat, text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let call = |v: &Value, args_keys: &[&str]| -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?.to_string();
        let args = args_keys
            .iter()
            .find_map(|k| v.get(*k))
            .cloned()
            .unwrap_or_else(|| json!({}));
        let arguments = match args {
            Value::String(s) => s,
            other => other.to_string(),
        };
        Some(ToolCall { name, arguments })
    };
    match format {
        ToolFormat::Hermes => {
            let start = text.find("<tool_call>")?;
            let mut calls = Vec::new();
            let mut rest = &text[start..];
            while let Some(open) = rest.find("<tool_call>") {
                let body = &rest[open + "<tool_call>".len()..];
                let (inner, after) = match body.find("</tool_call>") {
                    Some(close) => (&body[..close], &body[close + "</tool_call>".len()..]),
                    // A reply cut off at the end of a call's JSON still holds the call.
                    None => (body, ""),
                };
                let v: Value = serde_json::from_str(inner.trim()).ok()?;
                calls.push(call(&v, &["arguments", "parameters"])?);
                rest = after;
            }
            let content = text[..start].trim();
            Some(((!content.is_empty()).then(|| content.to_string()), calls))
        }
        ToolFormat::Llama3Json => {
            let t = text.trim();
            let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim();
            if !t.starts_with('{') {
                return None;
            }
            // One call, or several separated by ';' as Llama 3.1 writes them.
            let mut calls = Vec::new();
            for v in serde_json::Deserializer::from_str(t).into_iter::<Value>() {
                let v = v.ok()?;
                calls.push(call(&v, &["parameters", "arguments"])?);
            }
            if calls.is_empty() {
                return None;
            }
            Some((None, calls))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_calls_parse_with_content_before() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Hermes, text).unwrap();
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                ToolCall {
                    name: "now".into(),
                    arguments: "{}".into()
                }
            ]
        );
        assert_eq!(parse(ToolFormat::Hermes, "no call here"), None);
        assert_eq!(
            parse(ToolFormat::Hermes, "<tool_call>{broken</tool_call>"),
            None
        );
    }

    #[test]
    fn llama_calls_parse() {
        let (content, calls) = parse(
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}",
        )
        .unwrap();
        assert_eq!(content, None);
        assert_eq!(calls[0].name, "f");
        assert_eq!(calls[0].arguments, "{\"x\":1}");
        assert_eq!(parse(ToolFormat::Llama3Json, "Hello {\"name\": 1}"), None);
    }

    #[test]
    fn held_back_text_starts_where_a_call_might() {
        assert_eq!(call_start(ToolFormat::Hermes, "Sure"), None);
        assert_eq!(call_start(ToolFormat::Hermes, "Sure <tool"), Some(5));
        assert_eq!(call_start(ToolFormat::Hermes, "a<tool_call>{"), Some(1));
        assert_eq!(call_start(ToolFormat::Hermes, "x <"), Some(2));
        assert_eq!(call_start(ToolFormat::Llama3Json, "Hi"), None);
        assert_eq!(call_start(ToolFormat::Llama3Json, " {\"na"), Some(1));
        assert_eq!(call_start(ToolFormat::Llama3Json, "<|pyth"), Some(0));
    }

    #[test]
    fn the_template_decides_the_format() {
        let qwen = "{% if tools %}<tools>{% endif %}<tool_call>";
        assert_eq!(
            TemplateTools::detect(qwen),
            TemplateTools {
                format: ToolFormat::Hermes,
                renders_tools: true
            }
        );
        let llama = "{% if tools %}...{% endif %}<|python_tag|> ipython";
        assert_eq!(TemplateTools::detect(llama).format, ToolFormat::Llama3Json);
        let plain = "{% for message in messages %}{{ message.content }}{% endfor %}";
        assert!(!TemplateTools::detect(plain).renders_tools);
    }
}
