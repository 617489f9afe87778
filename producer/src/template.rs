//! The model's own chat template, rendered as Hugging Face's `apply_chat_template` renders it.
//!
//! A template is the Jinja source a model ships in `tokenizer_config.json` (`chat_template`),
//! `chat_template.json` or `chat_template.jinja`. [`ChatTemplate`] compiles it once with
//! `minijinja` in the environment transformers builds for it: `trim_blocks` and `lstrip_blocks`,
//! Python's string and dict methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...,
//! from `minijinja-contrib`'s `pycompat`), a `tojson` that writes what Python's
//! `json.dumps(...)` writes (`ensure_ascii`, `indent`, `separators`, `sort_keys`),
//! `raise_exception`, loop controls, and the tokenizer's `bos_token` / `eos_token`. transformers'
//! `{% generation %}` blocks (its assistant-mask extension) render as `{% if true %}` blocks, which
//! is what they are for the text; the labels come from the rendered turns instead (see
//! [`crate::chat`]). `strftime_now` is not defined, so a template's date falls back to the date it
//! writes in itself (Llama 3's "26 Jul 2024"): a sample's bytes never depend on the day it is made.
//! A config's named templates give `default`, and `tool_use` for a record with tools, as
//! transformers picks them.
//!
//! Rendering is bounded per record, since a record (its turns, its tools) is whoever wrote the
//! manifest's to choose: a [`Budget`] caps each render's output, the bytes all of a record's
//! renders write, and the instructions they run (`fuel`).

use std::io::Read;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};

/// Why a chat template, or a file beside the tokenizer, could not be loaded or rendered. The
/// tokenizer's own error ([`crate::chat::ChatError`]) takes it in as its `Load` and `Template`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// A template or tokenizer config file could not be read.
    #[error("cannot load {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// The template failed to compile or to render.
    #[error("chat template {0}")]
    Template(String),
}

/// Qwen3's chat template, as its `tokenizer_config.json` ships it: the template used when the
/// tokenizer has Qwen's `<|im_start|>` and no template is found beside it.
pub const QWEN3: &str = include_str!("../templates/qwen3.jinja");

/// The largest template or `tokenizer_config.json` read (16 MiB).
pub const MAX_TEMPLATE_FILE_BYTES: u64 = 16 << 20;

/// Instructions one render may run: far above what any model's template takes for a long
/// conversation (Qwen3's takes about 60 per turn), far below a loop that never ends.
const RENDER_FUEL: u64 = 10_000_000;

/// How many full-length texts a record's renders may write together.
const RECORD_RENDERS: usize = 32;

/// What all of one record's renders may take together.
#[derive(Debug, Clone)]
pub struct Budget {
    /// The longest text one render may write.
    pub render_bytes: usize,
    /// Bytes all renders may write together.
    pub total_bytes: usize,
    /// Instructions all renders may run together (each also stops at its own 10 M).
    pub fuel: u64,
}

impl Budget {
    /// A budget for conversations of at most `max_tokens` tokens: 256 bytes of rendered text per
    /// token (at least 1 MiB; no tokenizer's tokens are longer on average), 32 such texts in all,
    /// 40 M instructions.
    pub fn for_tokens(max_tokens: usize) -> Budget {
        let render_bytes = max_tokens.saturating_mul(256).max(1 << 20);
        Budget {
            render_bytes,
            total_bytes: render_bytes.saturating_mul(RECORD_RENDERS),
            fuel: 4 * RENDER_FUEL,
        }
    }
}

/// An output that refuses to grow past `limit` bytes.
struct Bounded {
    out: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.limit {
            return Err(std::io::Error::other("output limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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
    /// A `tool_use` template beside the default one, for records with tools.
    tool_use: bool,
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
    ) -> Result<ChatTemplate, TemplateError> {
        Self::named(source, None, special, origin)
    }

    /// Compiles a default template and, when given, a `tool_use` one rendered for records with
    /// tools.
    pub fn named(
        source: &str,
        tool_use: Option<&str>,
        special: SpecialTokens,
        origin: impl Into<String>,
    ) -> Result<ChatTemplate, TemplateError> {
        let origin = origin.into();
        let source = generation_blocks_as_ifs(source);
        let tool_source = tool_use.map(generation_blocks_as_ifs);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |message: String| -> Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        // Each optional part as a tag byte and its text, so `None` and `Some("")` differ.
        let tagged = |s: Option<&str>| -> Vec<u8> {
            match s {
                None => vec![0],
                Some(s) => [&[1u8][..], s.as_bytes()].concat(),
            }
        };
        let identity = feedstore_proto::stream::sample_key(&[
            source.as_bytes(),
            &tagged(tool_source.as_deref()),
            &tagged(special.bos.as_deref()),
            &tagged(special.eos.as_deref()),
        ]);
        env.add_template_owned("chat_template", source)
            .map_err(|e| TemplateError::Template(format!("{origin}: {e}")))?;
        if let Some(tool_source) = tool_source {
            env.add_template_owned("tool_use", tool_source)
                .map_err(|e| TemplateError::Template(format!("{origin} (tool_use): {e}")))?;
        }
        let origin = if tool_use.is_some() {
            format!("{origin} (its \"tool_use\" template for records with tools)")
        } else {
            origin
        };
        Ok(ChatTemplate {
            env,
            tool_use: tool_use.is_some(),
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
    /// a list of named templates: `default`, and `tool_use` for records with tools), any other
    /// file is the Jinja source itself.
    pub fn from_file(path: &Path, special: SpecialTokens) -> Result<ChatTemplate, TemplateError> {
        let text = read_small(path)?;
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        {
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                TemplateError::Template(format!("{}: not JSON: {e}", path.display()))
            })?;
            return match templates_in(&json, path)? {
                Some((source, tool_use)) => ChatTemplate::named(
                    &source,
                    tool_use.as_deref(),
                    special,
                    path.display().to_string(),
                ),
                None => Err(TemplateError::Template(format!(
                    "{}: has no \"chat_template\"",
                    path.display()
                ))),
            };
        }
        ChatTemplate::new(&text, special, path.display().to_string())
    }

    /// The template a model ships beside its `tokenizer.json`, looked for as transformers looks:
    /// `chat_template.jinja`, then `chat_template.json`, then `tokenizer_config.json`'s
    /// `chat_template`. `None` when there is none. The special tokens come from
    /// `tokenizer_config.json` when it is there.
    pub fn beside(tokenizer: &Path) -> Result<Option<ChatTemplate>, TemplateError> {
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
            Some(json) => match templates_in(&json, &config)? {
                Some((source, tool_use)) => ChatTemplate::named(
                    &source,
                    tool_use.as_deref(),
                    special,
                    config.display().to_string(),
                )
                .map(Some),
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
    /// the end when `generation_prompt` is set, charging `budget`.
    pub(crate) fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        generation_prompt: bool,
        budget: &mut Budget,
    ) -> Result<String, TemplateError> {
        let name = if tools.is_some() && self.tool_use {
            "tool_use"
        } else {
            "chat_template"
        };
        let template = self.env.get_template(name).expect("added at construction");
        let context = minijinja::context! {
            messages => Value::from(messages.to_vec()),
            tools => tools.cloned().unwrap_or(Value::from(())),
            add_generation_prompt => generation_prompt,
            bos_token => self.special.bos.as_deref().unwrap_or(""),
            eos_token => self.special.eos.as_deref().unwrap_or(""),
        };
        let limit = budget.render_bytes.min(budget.total_bytes);
        let mut out = Bounded {
            out: Vec::new(),
            limit,
        };
        let rendered = {
            let _limit = TojsonLimit::set(limit);
            template.render_captured_to(context, &mut out)
        };
        let fail = |what: String| TemplateError::Template(format!("{}: {what}", self.origin));
        let captured = match rendered {
            Ok(captured) => captured,
            Err(e) if e.kind() == ErrorKind::WriteFailure => {
                return Err(fail(if limit < budget.render_bytes {
                    format!(
                        "renders this conversation's turns to more than the {} bytes a \
                         record's renders may write together",
                        RECORD_RENDERS * budget.render_bytes
                    )
                } else {
                    format!("renders this conversation to more than {limit} bytes")
                }));
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(fail(format!(
                    "takes more than {RENDER_FUEL} instructions to render this conversation"
                )));
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        let used = captured.state().fuel_levels().map_or(0, |(used, _)| used);
        budget.fuel = budget.fuel.checked_sub(used).ok_or_else(|| {
            fail("takes too many instructions to render this conversation".into())
        })?;
        budget.total_bytes -= out.out.len();
        String::from_utf8(out.out).map_err(|_| fail("rendered text that is not UTF-8".into()))
    }
}

impl SpecialTokens {
    /// The special tokens of the `tokenizer_config.json` beside `tokenizer`, if there is one.
    pub fn beside(tokenizer: &Path) -> Result<SpecialTokens, TemplateError> {
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        Ok(read_config(&dir.join("tokenizer_config.json"))?
            .map(|json| SpecialTokens::from_config(&json))
            .unwrap_or_default())
    }
}

/// The `chat_template` of a config: a string, or a list of named templates of which `default`
/// is the template and `tool_use`, when there, the one for records with tools.
fn templates_in(
    json: &serde_json::Value,
    path: &Path,
) -> Result<Option<(String, Option<String>)>, TemplateError> {
    match &json["chat_template"] {
        serde_json::Value::String(s) => Ok(Some((s.clone(), None))),
        serde_json::Value::Array(named) => {
            let find = |name: &str| {
                named
                    .iter()
                    .find(|t| t["name"] == name)
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_owned)
            };
            match find("default") {
                Some(default) => Ok(Some((default, find("tool_use")))),
                None => Err(TemplateError::Template(format!(
                    "{}: has named chat templates but no \"default\"",
                    path.display()
                ))),
            }
        }
        _ => Ok(None),
    }
}

/// A `tokenizer_config.json`, or `None` when there is no such file.
fn read_config(path: &Path) -> Result<Option<serde_json::Value>, TemplateError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_small(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TemplateError::Template(format!("{}: not JSON: {e}", path.display())))
}

/// Reads a regular file of at most [`MAX_TEMPLATE_FILE_BYTES`] as UTF-8.
pub(crate) fn read_small(path: &Path) -> Result<String, TemplateError> {
    read_bounded(path, MAX_TEMPLATE_FILE_BYTES).and_then(|bytes| {
        String::from_utf8(bytes).map_err(|_| TemplateError::Load {
            path: path.display().to_string(),
            message: "not UTF-8 text".into(),
        })
    })
}

/// Reads a regular file (nothing else is opened for reading) of at most `max` bytes.
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, TemplateError> {
    let fail = |message: String| TemplateError::Load {
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

/// Turns transformers' `{% generation %}` / `{% endgeneration %}` into `{% if true %}` /
/// `{% endif %}`, keeping their delimiters and whitespace control: a block tag like them, so the
/// text around them is trimmed as jinja2 trims it.
fn generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        let tag = &rest[at + 2..];
        let inner = tag.trim_start_matches(['-', '+']);
        let inner = inner.trim_start();
        let word_end = inner
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(inner.len());
        let word = &inner[..word_end];
        let replacement = match word {
            "generation" => "if true",
            "endgeneration" => "endif",
            _ => "",
        };
        let closes = inner[word_end..]
            .trim_start()
            .trim_start_matches(['-', '+'])
            .starts_with("%}");
        if replacement.is_empty() || !closes {
            out.push_str(&rest[..at + 2]);
            rest = tag;
            continue;
        }
        // `{%`, its whitespace control and spaces as written, the new words, the rest as written.
        let word_at = at + 2 + (tag.len() - inner.len());
        out.push_str(&rest[..word_at]);
        out.push_str(replacement);
        rest = &rest[word_at + word_end..];
    }
    out.push_str(rest);
    out
}

thread_local! {
    /// The most bytes a `tojson` call may write: the limit of the render it is part of.
    static TOJSON_LIMIT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// Sets [`TOJSON_LIMIT`] for one render, and puts it back however the render ends.
struct TojsonLimit;

impl TojsonLimit {
    fn set(limit: usize) -> TojsonLimit {
        TOJSON_LIMIT.with(|l| l.set(limit));
        TojsonLimit
    }
}

impl Drop for TojsonLimit {
    fn drop(&mut self) {
        TOJSON_LIMIT.with(|l| l.set(usize::MAX));
    }
}

/// How `tojson` writes, as Python's `json.dumps` takes it.
struct JsonStyle {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
    ensure_ascii: bool,
    limit: usize,
}

/// `tojson` as transformers defines it: Python's `json.dumps(value, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` with those arguments, so `{"a": 1, "b": [1,
/// 2]}` with its spaces, keys in their order, non-ASCII text as it is unless `ensure_ascii`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let invalid = |what: &str| minijinja::Error::new(ErrorKind::InvalidOperation, what.to_owned());
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.clamp(0, 1024) as usize)),
            (None, Some(s)) => Some(s.to_owned()),
            _ => return Err(invalid("tojson: indent must be a number or a string")),
        },
    };
    // Python's defaults: ", " and ": ", or "," and ": " with an indent.
    let (item_separator, key_separator) = match separators {
        None => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
        Some(v) if v.is_none() => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match &parts[..] {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.to_string(), b.to_string())
                }
                _ => return Err(invalid("tojson: separators must be two strings")),
            }
        }
    };
    let style = JsonStyle {
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        limit: TOJSON_LIMIT.with(|l| l.get()),
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    value: &Value,
    style: &JsonStyle,
    depth: usize,
    out: &mut String,
) -> Result<(), minijinja::Error> {
    if out.len() > style.limit {
        return Err(minijinja::Error::new(
            ErrorKind::WriteFailure,
            "tojson: output past the render's limit",
        ));
    }
    if depth > 256 {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nested too deeply",
        ));
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(unit) = &style.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(unit);
            }
        }
    };
    match value.kind() {
        ValueKind::Undefined => {
            // Python cannot serialise jinja2's Undefined either.
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: the value is undefined",
            ));
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(value)),
        ValueKind::String => {
            write_json_string(value.as_str().unwrap_or(""), style.ensure_ascii, out)
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, depth + 1);
                // Python writes non-string keys as their JSON text, quoted.
                let text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or("").to_owned(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                    ValueKind::Number => json_number(key),
                    _ => key.to_string(),
                };
                write_json_string(&text, style.ensure_ascii, out);
                out.push_str(&style.key_separator);
                write_json(&value.get_item(key)?, style, depth + 1, out)?;
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
                    out.push_str(&style.item_separator);
                }
                newline(out, depth + 1);
                write_json(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_string(&value.to_string(), style.ensure_ascii, out),
    }
    Ok(())
}

/// A number as Python's `json.dumps` writes it.
fn json_number(value: &Value) -> String {
    if value.is_integer() {
        value.to_string()
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => python_float(f),
            Err(_) => value.to_string(),
        }
    }
}

/// A string as Python's `json.dumps` writes it (`\uXXXX`, surrogate pairs beyond the BMP, for
/// every non-ASCII character when `ensure_ascii`).
fn write_json_string(s: &str, ensure_ascii: bool, out: &mut String) {
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
            // Python escapes what is not printable ASCII (` ` to `~`) when `ensure_ascii`.
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
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

    /// The error rendering `source` with no messages gives.
    fn render_error(source: &str) -> String {
        let t = ChatTemplate::new(source, SpecialTokens::default(), "test").unwrap();
        t.render(&[], None, false, &mut Budget::for_tokens(10))
            .unwrap_err()
            .to_string()
    }

    fn render(source: &str, ctx: Value) -> String {
        let t = ChatTemplate::new(source, SpecialTokens::default(), "test").unwrap();
        t.env
            .get_template("chat_template")
            .unwrap()
            .render(ctx)
            .unwrap()
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
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true, separators=[',', ':']) }}",
                minijinja::context! { v => Value::from_serialize(serde_json::json!({"k": "é😀", "n": [1, 2]})) }
            ),
            r#"{"k":"\u00e9\ud83d\ude00","n":[1,2]}"#
        );
        assert!(render_error("{{ x | tojson }}").contains("undefined"));
        assert_eq!(python_float(1.5e-7), "1.5e-07");
    }

    #[test]
    fn generation_blocks_render_as_jinja2_renders_them() {
        assert_eq!(
            generation_blocks_as_ifs("a{% generation %}b{%- endgeneration -%}c{% if x %}"),
            "a{% if true %}b{%- endif -%}c{% if x %}"
        );
        assert_eq!(generation_blocks_as_ifs("{%"), "{%");
        assert_eq!(
            generation_blocks_as_ifs("{% generations %}"),
            "{% generations %}"
        );
        // As jinja2 renders them with transformers' extension (its whitespace handling kept).
        let ctx = minijinja::context! { m => "hi" };
        assert_eq!(
            render(
                "<|a|>\n    {% generation %}\n    {{ m }}\n    {% endgeneration %}\n",
                ctx.clone()
            ),
            "<|a|>\n    hi\n"
        );
        assert_eq!(
            render(
                "<|a|>{%- generation -%} {{ m }} {%- endgeneration -%} !",
                ctx
            ),
            "<|a|>hi!"
        );
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
        let e = render_error("{{ raise_exception('only user and assistant') }}");
        assert!(e.contains("only user and assistant"), "{e}");
        assert_eq!(
            render(
                "{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}",
                minijinja::context! {}
            ),
            "13"
        );
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let e = render_error(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        );
        assert!(e.contains("instructions"), "{e}");
    }

    #[test]
    fn output_past_the_budget_is_refused_mid_render() {
        let mut budget = Budget::for_tokens(10);
        budget.render_bytes = 1000;
        // A loop of writes, and one tojson call that would write far more than the limit.
        for source in [
            "{% for i in range(100000) %}xxxxxxxxxx{% endfor %}",
            "{{ tools | tojson(indent=1000) }}",
        ] {
            let t = ChatTemplate::new(source, SpecialTokens::default(), "t").unwrap();
            let deep = (0..100).fold(serde_json::json!(0), |v, _| serde_json::json!([v]));
            let tools = Value::from_serialize(deep);
            let e = t
                .env
                .get_template("chat_template")
                .map(|_| t.render(&[], Some(&tools), false, &mut budget.clone()))
                .unwrap()
                .unwrap_err()
                .to_string();
            assert!(e.contains("more than 1000 bytes"), "{source}: {e}");
        }
    }
}
