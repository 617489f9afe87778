//! The model's own chat template, rendered as Hugging Face's `apply_chat_template` renders it.
//!
//! A template is the Jinja source a model ships in `tokenizer_config.json` (`chat_template`),
//! `chat_template.json` or `chat_template.jinja`. [`ChatTemplate`] compiles it once with
//! `minijinja` in the environment transformers builds for it: `trim_blocks` and `lstrip_blocks`,
//! Python's string and dict methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...,
//! from `minijinja-contrib`'s `pycompat`), a `tojson` that writes what Python's
//! `json.dumps(..., ensure_ascii=False)` writes (`indent`, `sort_keys`), `raise_exception`, and
//! the tokenizer's `bos_token` / `eos_token`. `{% generation %}` markers (transformers' assistant
//! mask extension) are dropped: the labels come from the rendered turns instead (see
//! [`crate::chat`]). `strftime_now` is not defined, so a template's date falls back to the date it
//! writes in itself (Llama 3's "26 Jul 2024"): a sample's bytes never depend on the day it is made.
//!
//! Rendering is bounded: a template runs on a fixed instruction budget (`fuel`), so no record can
//! make it loop for long.

use std::io::Read;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};

use crate::chat::ChatError;

/// Qwen3's chat template, as its `tokenizer_config.json` ships it: the template used when the
/// tokenizer has Qwen's `<|im_start|>` and no template is found beside it.
pub const QWEN3: &str = include_str!("../templates/qwen3.jinja");

/// The largest template or `tokenizer_config.json` read (16 MiB).
pub const MAX_TEMPLATE_FILE_BYTES: u64 = 16 << 20;

/// Instructions one render may run: far above what any model's template takes for a long
/// conversation (Qwen3's takes about 60 per turn), far below a loop that never ends.
const FUEL: u64 = 20_000_000;

/// The special tokens a template may refer to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`, e.g. `<|begin_of_text|>`.
    pub bos: Option<String>,
    /// `eos_token`, e.g. `<|im_end|>`.
    pub eos: Option<String>,
}

impl SpecialTokens {
    /// The `bos_token` and `eos_token` of a `tokenizer_config.json` (a string, or an object with
    /// `content`).
    pub fn from_config(config: &serde_json::Value) -> SpecialTokens {
        let token = |key: &str| match &config[key] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
            _ => None,
        };
        SpecialTokens {
            bos: token("bos_token"),
            eos: token("eos_token"),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// A digest of the source and the special tokens: part of a sample's cache key.
    identity: u128,
    special: SpecialTokens,
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `origin` says where it came from in messages.
    pub fn new(
        source: &str,
        special: SpecialTokens,
        origin: impl Into<String>,
    ) -> Result<ChatTemplate, ChatError> {
        let origin = origin.into();
        let source = without_generation_markers(source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |message: String| -> Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        let identity = feedstore_proto::stream::sample_key(&[
            source.as_bytes(),
            special.bos.as_deref().unwrap_or("\0").as_bytes(),
            special.eos.as_deref().unwrap_or("\0").as_bytes(),
        ]);
        env.add_template_owned("chat", source)
            .map_err(|e| ChatError::Template(format!("{origin}: {e}")))?;
        Ok(ChatTemplate {
            env,
            identity,
            special,
            origin,
        })
    }

    /// Qwen3's template ([`QWEN3`]) with its special tokens.
    pub fn qwen3() -> ChatTemplate {
        let special = SpecialTokens {
            bos: None,
            eos: Some("<|im_end|>".into()),
        };
        ChatTemplate::new(QWEN3, special, "Qwen3's template (built in)")
            .expect("the built-in template compiles")
    }

    /// Reads a template from a file: a `.json` file holds it under `chat_template` (a string, or
    /// a list of named templates of which `default` is taken), any other file is the Jinja
    /// source itself.
    pub fn from_file(path: &Path, special: SpecialTokens) -> Result<ChatTemplate, ChatError> {
        let text = read_small(path)?;
        let source = if path.extension().is_some_and(|e| e == "json") {
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ChatError::Template(format!("{}: not JSON: {e}", path.display())))?;
            template_in(&json).ok_or_else(|| {
                ChatError::Template(format!("{}: has no \"chat_template\"", path.display()))
            })?
        } else {
            text
        };
        ChatTemplate::new(&source, special, path.display().to_string())
    }

    /// The template a model ships beside its `tokenizer.json`, looked for as transformers looks:
    /// `chat_template.jinja`, then `chat_template.json`, then `tokenizer_config.json`'s
    /// `chat_template`. `None` when there is none. The special tokens come from
    /// `tokenizer_config.json` when it is there.
    pub fn beside(tokenizer: &Path) -> Result<Option<ChatTemplate>, ChatError> {
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        let special = SpecialTokens::beside(tokenizer)?;
        for name in ["chat_template.jinja", "chat_template.json"] {
            let path = dir.join(name);
            if path.exists() {
                return ChatTemplate::from_file(&path, special).map(Some);
            }
        }
        let config = dir.join("tokenizer_config.json");
        match read_config(&config)? {
            Some(json) => match template_in(&json) {
                Some(source) => {
                    ChatTemplate::new(&source, special, config.display().to_string()).map(Some)
                }
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// A digest of the source and the special tokens.
    pub fn identity(&self) -> u128 {
        self.identity
    }

    /// Renders `messages` (and `tools`, when given), with the assistant's generation prompt at
    /// the end when `generation_prompt` is set.
    pub(crate) fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template("chat")
            .expect("added at construction");
        let context = minijinja::context! {
            messages => Value::from(messages.to_vec()),
            tools => tools.cloned().unwrap_or(Value::from(())),
            add_generation_prompt => generation_prompt,
            bos_token => self.special.bos.as_deref().unwrap_or(""),
            eos_token => self.special.eos.as_deref().unwrap_or(""),
        };
        template
            .render(context)
            .map_err(|e| ChatError::Template(format!("{}: {e}", self.origin)))
    }
}

impl SpecialTokens {
    /// The special tokens of the `tokenizer_config.json` beside `tokenizer`, if there is one.
    pub fn beside(tokenizer: &Path) -> Result<SpecialTokens, ChatError> {
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        Ok(read_config(&dir.join("tokenizer_config.json"))?
            .map(|json| SpecialTokens::from_config(&json))
            .unwrap_or_default())
    }
}

/// The `chat_template` of a config: a string, or the `default` of a list of named templates.
fn template_in(json: &serde_json::Value) -> Option<String> {
    match &json["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned),
        _ => None,
    }
}

/// A `tokenizer_config.json`, or `None` when there is no such file.
fn read_config(path: &Path) -> Result<Option<serde_json::Value>, ChatError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_small(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ChatError::Template(format!("{}: not JSON: {e}", path.display())))
}

/// Reads a regular file of at most [`MAX_TEMPLATE_FILE_BYTES`] as UTF-8.
pub(crate) fn read_small(path: &Path) -> Result<String, ChatError> {
    read_bounded(path, MAX_TEMPLATE_FILE_BYTES).and_then(|bytes| {
        String::from_utf8(bytes).map_err(|_| ChatError::Load {
            path: path.display().to_string(),
            message: "not UTF-8 text".into(),
        })
    })
}

/// Reads a regular file (nothing else is opened for reading) of at most `max` bytes.
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, ChatError> {
    let fail = |message: String| ChatError::Load {
        path: path.display().to_string(),
        message,
    };
    let file = crate::input::open_regular(path).map_err(|e| fail(e.to_string()))?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(e.to_string()))?;
    if bytes.len() as u64 > max {
        return Err(fail(format!("larger than {} MiB", max >> 20)));
    }
    Ok(bytes)
}

/// Removes transformers' `{% generation %}` / `{% endgeneration %}` markers (any whitespace
/// control), keeping what they enclose.
fn without_generation_markers(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        let tag = &rest[at + 2..];
        let inner = tag.trim_start_matches(['-', '+']).trim_start();
        let word_end = inner
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(inner.len());
        let word = &inner[..word_end];
        let close = inner[word_end..]
            .trim_start()
            .trim_start_matches(['-', '+'])
            .strip_prefix("%}");
        match close {
            Some(after) if word == "generation" || word == "endgeneration" => {
                out.push_str(&rest[..at]);
                rest = after;
            }
            _ => {
                out.push_str(&rest[..at + 2]);
                rest = tag;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `tojson` as transformers defines it: Python's `json.dumps(value, ensure_ascii=False,
/// indent=indent, sort_keys=sort_keys)`, so `{"a": 1, "b": [1, 2]}` with its spaces, keys in
/// their order, non-ASCII text as it is.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            None => Some(v.as_str().unwrap_or("").to_owned()),
        },
    };
    let mut out = String::new();
    write_json(
        value,
        indent.as_deref(),
        sort_keys.unwrap_or(false),
        0,
        &mut out,
    )?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    value: &Value,
    indent: Option<&str>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
) -> Result<(), minijinja::Error> {
    if depth > 256 {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nested too deeply",
        ));
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(unit) = indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(unit);
            }
        }
    };
    // Python's separators: ", " between items without an indent, "," (then a newline) with one.
    let separator = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                match f64::try_from(value.clone()) {
                    Ok(f) => out.push_str(&python_float(f)),
                    Err(_) => out.push_str(&value.to_string()),
                }
            }
        }
        ValueKind::String => write_json_string(value.as_str().unwrap_or(""), out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(s) => write_json_string(s, out),
                    None => write_json_string(&key.to_string(), out),
                }
                out.push_str(": ");
                write_json(&value.get_item(key)?, indent, sort_keys, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json(item, indent, sort_keys, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_string(&value.to_string(), out),
    }
    Ok(())
}

/// A string as Python's `json.dumps` writes it with `ensure_ascii=False`.
fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it for the common cases (`1.0`, `0.5`, `1e+20`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        format!("{f:.1}")
    } else if f.abs() >= 1e16 || f.abs() < 1e-4 {
        let s = format!("{f:e}");
        match s.split_once('e') {
            Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e:0>2}"),
            Some((m, e)) => format!("{m}e-{:0>2}", &e[1..]),
            None => s,
        }
    } else {
        f.to_string()
    }
}

/// Where a template file was looked for, for messages.
pub fn looked_for(tokenizer: &Path) -> Vec<PathBuf> {
    let dir = tokenizer.parent().unwrap_or(Path::new("."));
    [
        "chat_template.jinja",
        "chat_template.json",
        "tokenizer_config.json",
    ]
    .iter()
    .map(|n| dir.join(n))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let t = ChatTemplate::new(source, SpecialTokens::default(), "test").unwrap();
        t.env.get_template("chat").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_writes_what_python_writes() {
        let v = Value::from_serialize(serde_json::json!({
            "b": [1, 2.5, 3.0, "é\n\"x\"", null, true], "a": {}, "c": []
        }));
        assert_eq!(
            render("{{ v | tojson }}", minijinja::context! { v => v.clone() }),
            r#"{"b": [1, 2.5, 3.0, "é\n\"x\"", null, true], "a": {}, "c": []}"#
        );
        assert_eq!(
            render(
                "{{ v | tojson(indent=2, sort_keys=true) }}",
                minijinja::context! { v => v }
            ),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    3.0,\n    \"é\\n\\\"x\\\"\",\n    null,\n    true\n  ],\n  \"c\": []\n}"
        );
        assert_eq!(python_float(1e20), "1e+20");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
    }

    #[test]
    fn generation_markers_are_dropped() {
        assert_eq!(
            without_generation_markers("a{% generation %}b{%- endgeneration -%}c{% if x %}"),
            "abc{% if x %}"
        );
        assert_eq!(without_generation_markers("{%"), "{%");
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        assert_eq!(
            render(
                "{{ s.strip('\\n').split('</think>')[-1].lstrip() }}|{{ s.startswith('\\n') }}",
                minijinja::context! { s => "\nx</think> y\n" }
            ),
            "y|True"
        );
        let t = ChatTemplate::new(
            "{{ raise_exception('only user and assistant') }}",
            SpecialTokens::default(),
            "test",
        )
        .unwrap();
        let e = t.render(&[], None, false).unwrap_err().to_string();
        assert!(e.contains("only user and assistant"), "{e}");
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            SpecialTokens::default(),
            "test",
        )
        .unwrap();
        let e = t.render(&[], None, false).unwrap_err().to_string();
        assert!(e.contains("fuel"), "{e}");
    }
}
