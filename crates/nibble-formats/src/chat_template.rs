//! Chat templates: the model's own Jinja template rendered with minijinja, with the Python string
//! methods and helpers that Hugging Face templates call.

use minijinja::{Environment, ErrorKind, Value, context};
use nibble_core::{Error, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        // Hugging Face renders with these two flags; templates are written for them.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it for a "today's date" line; a fixed date keeps prompts reproducible.
            "01 Jan 2026".to_string()
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::Template(format!("cannot parse the model's chat template: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat").expect("added in new()");
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| Error::Template(format!("rendering failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  Hi there ")], true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", " ok ")], false)
                .unwrap(),
            "OK"
        );
        let e = t
            .render(&[ChatMessage::new("system", "x")], false)
            .unwrap_err();
        assert!(e.to_string().contains("first must be user"), "{e}");
    }

    #[test]
    fn broken_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
