//! Conversations to token ids and labels, the way the model's own chat template makes them.
//!
//! A LLaVA/Qwen-VL style record is a list of turns (`human`/`gpt`/`system`/`tool`, tool calls,
//! a record's `tools`). [`ChatTokenizer`] renders it with the model's chat template
//! ([`crate::template`]: Jinja, as Hugging Face's `apply_chat_template` renders it), expands each
//! image into the image tokens the model's processor would put there, tokenizes the whole text once
//! (as Hugging Face does, so merges across turn boundaries come out the same) and masks every
//! token outside the assistant's turns in the labels.
//!
//! **Images.** A template either takes a message's content as text, where the record's `<image>`
//! placeholders stay as written (Qwen3's, Llama's), or as a list of parts (`{"type": "image"}`,
//! `{"type": "text", "text": ...}`) from which it writes its own image marker (Qwen2.5-VL's,
//! LLaVA's). Which one is found by rendering a probe once. Each image then becomes N image tokens
//! (N from the resized image's patch grid): `<|vision_start|>` + N × `<|image_pad|>` +
//! `<|vision_end|>` for a Qwen-VL tokenizer given placeholders, N × the marker's token for a
//! template that writes its own.
//!
//! **Labels.** An assistant turn trains from where the template's generation prompt ends
//! (`render(messages[..i], add_generation_prompt=True)` is a prefix of the whole text) to the end
//! of the turn: the end of `render(messages[..=i])` without its trailing whitespace, which keeps
//! the end-of-turn token (`<|im_end|>`, `<|eot_id|>`) and drops the newline after it. Where a
//! template writes an earlier turn differently once later turns follow (Qwen3's reasoning block
//! goes on the last reply only), and for every reply of a conversation with more than
//! [`MAX_RENDERED_REPLIES`] of them (the renders grow with the square of the turns), the turn is
//! found by the template's own markers instead: its generation prompt, and the end-of-turn text
//! it writes after a reply.
//!
//! Checked against goldens made by `transformers` for four families' templates
//! (`tests/data/chat/`).

use std::ops::Range;
use std::path::Path;

use feedstore_proto::sample::IGNORE_INDEX;
use minijinja::Value;

use crate::template::{Budget, ChatTemplate, SpecialTokens, TemplateError};

/// Who speaks a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Instructions before the conversation.
    System,
    /// The human side (`"from": "human"`).
    User,
    /// The model's reply (`"from": "gpt"`), the part trained on.
    Assistant,
    /// A tool's result (`"from": "tool"` or `"observation"`).
    Tool,
}

impl Role {
    /// Maps a LLaVA / ShareGPT `from` field (`function_call` is an assistant turn too, read by
    /// the manifest with its call).
    pub fn from_llava(from: &str) -> Option<Role> {
        match from {
            "human" | "user" => Some(Role::User),
            "gpt" | "assistant" => Some(Role::Assistant),
            "system" => Some(Role::System),
            "tool" | "observation" => Some(Role::Tool),
            _ => None,
        }
    }

    /// The role's name in a template's `messages`.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Speaker.
    pub role: Role,
    /// Text, with `<image>` where an image goes.
    pub content: String,
    /// An assistant's tool calls, as the template reads them
    /// (`[{"type": "function", "function": {"name": ..., "arguments": {...}}}]`).
    pub tool_calls: Option<serde_json::Value>,
}

impl Message {
    /// A turn with no tool calls.
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
            tool_calls: None,
        }
    }
}

/// The placeholder LLaVA-style records put where an image goes.
pub const IMAGE_PLACEHOLDER: &str = "<image>";

/// The most turns a conversation may have (its replies are found by rendering it up to each, for
/// up to [`MAX_RENDERED_REPLIES`] of them, and for every one with a template that writes no end
/// of turn: work that grows with the square of the turns, within the record's render budget).
pub const MAX_TURNS: usize = 1024;

/// Replies found by rendering the conversation up to each (exact whatever the template does;
/// two renders per reply, so the work grows with the square of the turns). Beyond this many, a
/// conversation's replies are found by the markers the template writes around a plain reply
/// (its generation prompt and end of turn), in one pass.
pub const MAX_RENDERED_REPLIES: usize = 32;

/// The largest `tokenizer.json` read (256 MiB; large vocabularies take about 30).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Why a conversation could not be tokenized. Each rejects one sample, not the run (except
/// [`ChatError::Load`] and a template that does not compile, which end it before it starts).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// A tokenizer or template file could not be read.
    #[error("cannot load {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// The chat template failed to compile or to render.
    #[error("chat template {0}")]
    Template(String),
    /// The conversation has images but the tokenizer has no token to put them in.
    #[error("the tokenizer has no image token (<|image_pad|> or <image>)")]
    NoImageToken,
    /// Nothing to train on.
    #[error("conversation has no assistant reply")]
    NoAssistantReply,
    /// More than [`MAX_TURNS`] turns.
    #[error("conversation has {0} turns; at most {MAX_TURNS} are taken")]
    TooManyTurns(usize),
    /// `<image>` placeholders and images disagree.
    #[error("conversation has {placeholders} image placeholders but {images} images")]
    ImageCountMismatch {
        /// `<image>` placeholders in the records' text, or image markers the template wrote.
        placeholders: usize,
        /// Images supplied.
        images: usize,
    },
    /// Longer than the configured maximum.
    #[error("{tokens} tokens exceed the maximum of {max}")]
    TooLong {
        /// Tokens after expansion.
        tokens: usize,
        /// The maximum.
        max: usize,
    },
    /// The tokenizer failed on the text.
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

impl From<TemplateError> for ChatError {
    fn from(e: TemplateError) -> Self {
        match e {
            TemplateError::Load { path, message } => ChatError::Load { path, message },
            TemplateError::Template(message) => ChatError::Template(message),
        }
    }
}

/// Token ids and labels of one conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// One per id: the id where the assistant speaks, [`IGNORE_INDEX`] elsewhere.
    pub labels: Vec<i32>,
}

/// How images appear in what the template renders, and what each becomes.
#[derive(Debug, Clone)]
struct Images {
    /// What stands for one image in the rendered text: `<image>` in a placeholder template, the
    /// marker token in a parts template.
    marker: String,
    /// The token repeated once per image token, and what goes around the run.
    pad: String,
    open: String,
    close: String,
}

/// A tokenizer with the model's chat template.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: ChatTemplate,
    /// The template takes content as a list of parts (and writes its own image markers).
    parts: bool,
    /// `None`: the tokenizer has no image token; conversations with images are refused.
    images: Option<Images>,
    /// The template's generation prompt and the text it ends a reply with (trimmed): the turn
    /// markers used where the prefix renders do not line up.
    generation_prompt: String,
    turn_end: String,
    markers_only: bool,
    max_tokens: usize,
    /// A digest of the `tokenizer.json` bytes and the template: part of a sample's cache key.
    identity: u128,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("template", &self.template.origin())
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTokenizer {
    /// Loads a `tokenizer.json` with the chat template beside it
    /// ([`ChatTemplate::beside`]); with none there, Qwen3's built-in template for a tokenizer
    /// that has Qwen's `<|im_start|>`, and an error for any other. Conversations longer than
    /// `max_tokens` are rejected.
    pub fn from_file(path: &Path, max_tokens: usize) -> Result<ChatTokenizer, ChatError> {
        Self::load(path, None, max_tokens)
    }

    /// Loads a `tokenizer.json` with the template in `template` (a `.jinja` file, or a `.json`
    /// one holding `chat_template`; the name `qwen3` is the built-in one), or, when `None`, the
    /// one found as [`ChatTokenizer::from_file`] finds it.
    pub fn load(
        path: &Path,
        template: Option<&Path>,
        max_tokens: usize,
    ) -> Result<ChatTokenizer, ChatError> {
        let json = crate::template::read_bounded(path, MAX_TOKENIZER_BYTES)?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&json).map_err(|e| ChatError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let template = match template {
            Some(t) if t == Path::new("qwen3") => ChatTemplate::qwen3(),
            Some(t) => ChatTemplate::from_file(t, SpecialTokens::beside(path)?)?,
            None => match ChatTemplate::beside(path)? {
                Some(t) => t,
                None if tokenizer.token_to_id("<|im_start|>").is_some() => ChatTemplate::qwen3(),
                None => {
                    let looked: Vec<String> = crate::template::looked_for(path)
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect();
                    return Err(ChatError::Template(format!(
                        "not found (looked for {}); name one with --chat-template",
                        looked.join(", ")
                    )));
                }
            },
        };
        Self::new(tokenizer, template, max_tokens, &json)
    }

    /// Loads a `tokenizer.json` from memory, with Qwen3's built-in template.
    pub fn from_bytes(json: &[u8], max_tokens: usize) -> Result<ChatTokenizer, ChatError> {
        Self::with_template(json, ChatTemplate::qwen3(), max_tokens)
    }

    /// Loads a `tokenizer.json` from memory with `template`.
    pub fn with_template(
        json: &[u8],
        template: ChatTemplate,
        max_tokens: usize,
    ) -> Result<ChatTokenizer, ChatError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(json).map_err(|e| ChatError::Load {
            path: "<memory>".into(),
            message: e.to_string(),
        })?;
        Self::new(tokenizer, template, max_tokens, json)
    }

    fn new(
        tokenizer: tokenizers::Tokenizer,
        template: ChatTemplate,
        max_tokens: usize,
        json: &[u8],
    ) -> Result<ChatTokenizer, ChatError> {
        let probe = Probe::run(&template, &tokenizer);
        let identity =
            feedstore_proto::stream::sample_key(&[json, &template.identity().to_le_bytes()]);
        Ok(ChatTokenizer {
            tokenizer,
            template,
            parts: probe.parts,
            images: probe.images,
            generation_prompt: probe.generation_prompt,
            turn_end: probe.turn_end,
            markers_only: false,
            max_tokens,
            identity,
        })
    }

    /// What distinguishes this tokenizer's output from another's: a digest of its
    /// `tokenizer.json` and template, and the token limit.
    pub fn identity(&self) -> (u128, usize) {
        (self.identity, self.max_tokens)
    }

    /// The chat template in use.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Renders, expands, tokenizes and labels a conversation. `image_tokens[i]` is the number of
    /// image tokens image `i` takes (its merged patch count).
    pub fn encode(
        &self,
        messages: &[Message],
        image_tokens: &[usize],
    ) -> Result<Encoded, ChatError> {
        self.encode_with_tools(messages, None, image_tokens)
    }

    /// [`ChatTokenizer::encode`] with the tool definitions the template lists (`tools`, as
    /// `apply_chat_template(..., tools=...)` takes them).
    pub fn encode_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        image_tokens: &[usize],
    ) -> Result<Encoded, ChatError> {
        if !messages.iter().any(|m| m.role == Role::Assistant) {
            return Err(ChatError::NoAssistantReply);
        }
        if messages.len() > MAX_TURNS {
            return Err(ChatError::TooManyTurns(messages.len()));
        }
        let placeholders: usize = messages
            .iter()
            .map(|m| m.content.matches(IMAGE_PLACEHOLDER).count())
            .sum();
        if placeholders != image_tokens.len() {
            return Err(ChatError::ImageCountMismatch {
                placeholders,
                images: image_tokens.len(),
            });
        }
        let images = match (&self.images, image_tokens.is_empty()) {
            (Some(images), _) => Some(images),
            (None, true) => None,
            (None, false) => return Err(ChatError::NoImageToken),
        };
        let expanded_len: usize = image_tokens.iter().sum();
        // Cheap early refusal before tokenizing megabytes of pad tokens.
        if expanded_len > self.max_tokens {
            return Err(ChatError::TooLong {
                tokens: expanded_len,
                max: self.max_tokens,
            });
        }
        let values: Vec<Value> = messages
            .iter()
            .map(|m| message_value(m, self.parts))
            .collect();
        let tools = tools.map(Value::from_serialize);
        let mut budget = Budget::for_tokens(self.max_tokens);
        // Text a template drops (earlier replies' reasoning, say) still costs every render a
        // scan: a record longer than one render may write is refused before any.
        let record_bytes: usize = messages
            .iter()
            .map(|m| m.content.len() + m.tool_calls.as_ref().map_or(0, |c| c.to_string().len()))
            .sum::<usize>()
            + tools.as_ref().map_or(0, |t| t.to_string().len());
        if record_bytes > budget.render_bytes {
            return Err(ChatError::Template(format!(
                "{}: the conversation's text is {record_bytes} bytes, more than the {} bytes \
                 one render may write for --max-tokens {}",
                self.template.origin(),
                budget.render_bytes,
                self.max_tokens
            )));
        }
        // The whole text first, tokenized and held to the token limit, before the renders that
        // find the replies (two per reply) are spent on it.
        let text = self
            .template
            .render(&values, tools.as_ref(), false, &mut budget)?;
        let (expanded, moved) = match images {
            Some(images) => expand(images, &text, image_tokens)?,
            None => (text.clone(), Vec::new()),
        };
        let encoding = self.tokenize(&expanded)?;
        let spans: Vec<Range<usize>> = self
            .replies(messages, &values, tools.as_ref(), &text, &mut budget)?
            .into_iter()
            .map(|s| moved_to(&moved, s.start)..moved_to(&moved, s.end))
            .collect();
        Ok(label(&encoding, |start, end| {
            spans.iter().any(|s| s.start <= start && end <= s.end)
        }))
    }

    /// Finds each assistant turn's trained byte range in `text`, the whole conversation as the
    /// template renders it: by prefix renders for up to [`MAX_RENDERED_REPLIES`] replies, by the
    /// template's markers beyond (or where a prefix render does not line up).
    fn replies(
        &self,
        messages: &[Message],
        values: &[Value],
        tools: Option<&Value>,
        text: &str,
        budget: &mut Budget,
    ) -> Result<Vec<Range<usize>>, ChatError> {
        let replies: Vec<usize> = (0..messages.len())
            .filter(|&i| messages[i].role == Role::Assistant)
            .collect();
        let by_markers = self.markers_only
            || (replies.len() > MAX_RENDERED_REPLIES
                && !self.generation_prompt.is_empty()
                && !self.turn_end.is_empty());
        // By markers, every generation prompt in the text must be a reply's: a user's text that
        // writes one would shift every later span.
        if by_markers
            && find_after(text, 0, &self.generation_prompt).is_some()
            && text.matches(self.generation_prompt.as_str()).count() != replies.len()
        {
            return Err(ChatError::Template(format!(
                "{}: the text has {} assistant headers for {} replies (does a turn's text \
                 write one?)",
                self.template.origin(),
                text.matches(self.generation_prompt.as_str()).count(),
                replies.len()
            )));
        }
        let mut spans = Vec::with_capacity(replies.len());
        let mut cursor = 0;
        for i in replies {
            let before = match by_markers {
                true => None,
                // An empty prefix may not render at all (templates index `messages[0]`).
                false if i == 0 => self.template.render(&[], tools, true, budget).ok(),
                false => Some(self.template.render(&values[..i], tools, true, budget)?),
            };
            let start = match before {
                // A prefix counts when it ends where the template's generation prompt does
                // (an empty render, or a bare BOS, would be a prefix of anything).
                Some(before)
                    if text.starts_with(&before)
                        && before.len() >= cursor
                        && before.ends_with(self.generation_prompt.as_str()) =>
                {
                    before.len()
                }
                _ => find_after(text, cursor, &self.generation_prompt)
                    .map(|at| at + self.generation_prompt.len())
                    .ok_or_else(|| unfound(i, "starts"))?,
            };
            let through = match by_markers {
                true => None,
                false => Some(self.template.render(&values[..=i], tools, false, budget)?),
            };
            let end = match through {
                Some(through) if text.starts_with(&through) && through.trim_end().len() > start => {
                    through.trim_end().len()
                }
                _ => {
                    let end = find_after(text, start, &self.turn_end)
                        .map(|at| at + self.turn_end.len())
                        .ok_or_else(|| unfound(i, "ends"))?;
                    // Found by a marker: it must not run on into the next assistant turn.
                    if find_after(&text[..end], start, &self.generation_prompt).is_some() {
                        return Err(unfound(i, "ends"));
                    }
                    end
                }
            };
            spans.push(start..end);
            cursor = end;
        }
        Ok(spans)
    }

    /// Finds every reply by the template's markers alone, as conversations of more than
    /// [`MAX_RENDERED_REPLIES`] replies are (for tests: the two ways agree).
    #[doc(hidden)]
    pub fn find_replies_by_markers(mut self) -> ChatTokenizer {
        self.markers_only = true;
        self
    }

    /// Tokenizes plain text; every token counts in the loss.
    pub fn encode_text(&self, text: &str) -> Result<Encoded, ChatError> {
        Ok(label(&self.tokenize(text)?, |_, _| true))
    }

    /// Tokenizes `text` once and refuses it past the maximum.
    fn tokenize(&self, text: &str) -> Result<tokenizers::Encoding, ChatError> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ChatError::Encode(e.to_string()))?;
        if encoding.get_ids().len() > self.max_tokens {
            return Err(ChatError::TooLong {
                tokens: encoding.get_ids().len(),
                max: self.max_tokens,
            });
        }
        Ok(encoding)
    }
}

/// Ids and labels: each token labelled by whether its byte range is `trained`.
fn label(encoding: &tokenizers::Encoding, trained: impl Fn(usize, usize) -> bool) -> Encoded {
    let ids = encoding.get_ids().to_vec();
    let labels = ids
        .iter()
        .zip(encoding.get_offsets())
        .map(|(&id, &(start, end))| {
            if trained(start, end) {
                id as i32
            } else {
                IGNORE_INDEX
            }
        })
        .collect();
    Encoded { ids, labels }
}

fn unfound(message: usize, what: &str) -> ChatError {
    ChatError::Template(format!(
        "cannot tell where message {message} (an assistant turn) {what}: the template renders \
         it differently once later turns follow, and the generation prompt or end of turn it \
         writes after a plain reply does not find it"
    ))
}

fn find_after(text: &str, from: usize, needle: &str) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    text.get(from..)?.find(needle).map(|at| from + at)
}

/// A message as a template reads it: `role`, `content` (text, or a list of parts when the
/// template takes parts) and `tool_calls` when it has some (no key otherwise: templates test
/// `'tool_calls' in message`).
fn message_value(m: &Message, parts: bool) -> Value {
    let content = if parts {
        let mut list = Vec::new();
        for (i, text) in m.content.split(IMAGE_PLACEHOLDER).enumerate() {
            if i > 0 {
                list.push(Value::from_iter([("type", Value::from("image"))]));
            }
            if !text.is_empty() {
                list.push(Value::from_iter([
                    ("type", Value::from("text")),
                    ("text", Value::from(text)),
                ]));
            }
        }
        Value::from(list)
    } else {
        Value::from(m.content.as_str())
    };
    let mut fields = vec![("role", Value::from(m.role.name())), ("content", content)];
    if let Some(calls) = &m.tool_calls {
        fields.push(("tool_calls", Value::from_serialize(calls)));
    }
    Value::from_iter(fields)
}

/// Where text after a replaced marker moved: (the marker's end in the rendered text, how far
/// later text moved), one per marker in order.
type Moves = Vec<(usize, isize)>;

/// Replaces each image marker in `text` with its image tokens; returns the text and how it moved.
fn expand(
    images: &Images,
    text: &str,
    image_tokens: &[usize],
) -> Result<(String, Moves), ChatError> {
    let markers: Vec<usize> = text
        .match_indices(images.marker.as_str())
        .map(|(at, _)| at)
        .collect();
    if markers.len() != image_tokens.len() {
        return Err(ChatError::ImageCountMismatch {
            placeholders: markers.len(),
            images: image_tokens.len(),
        });
    }
    let extra: usize = image_tokens
        .iter()
        .map(|n| images.open.len() + n * images.pad.len() + images.close.len())
        .sum();
    let mut out = String::with_capacity(text.len() + extra);
    let mut moved = Vec::with_capacity(markers.len());
    let mut last = 0;
    for (&at, &n) in markers.iter().zip(image_tokens) {
        out.push_str(&text[last..at]);
        out.push_str(&images.open);
        for _ in 0..n {
            out.push_str(&images.pad);
        }
        out.push_str(&images.close);
        last = at + images.marker.len();
        moved.push((last, out.len() as isize - last as isize));
    }
    out.push_str(&text[last..]);
    Ok((out, moved))
}

/// Where `pos` in the rendered text is in the expanded one.
fn moved_to(moved: &Moves, pos: usize) -> usize {
    let shift = moved
        .iter()
        .take_while(|(end, _)| *end <= pos)
        .last()
        .map_or(0, |(_, by)| *by);
    pos.saturating_add_signed(shift)
}

/// What a template does, found once by rendering small conversations.
struct Probe {
    parts: bool,
    images: Option<Images>,
    generation_prompt: String,
    turn_end: String,
}

impl Probe {
    fn run(template: &ChatTemplate, tokenizer: &tokenizers::Tokenizer) -> Probe {
        let has = |t: &str| tokenizer.token_to_id(t).is_some();
        const REPLY: &str = "feedstore probe reply";
        const QUESTION: &str = "feedstore probe question";
        let user = |parts: bool, image: bool| {
            let content = if image { "<image>" } else { "" }.to_owned() + QUESTION;
            let m = Message::new(Role::User, content);
            message_value(&m, parts)
        };
        let render = |messages: &[Value], prompt: bool| {
            template
                .render(messages, None, prompt, &mut Budget::for_tokens(0))
                .ok()
        };
        // A template writes its own image marker when an image part changes what it renders.
        let with = render(&[user(true, true)], false);
        let without = render(&[user(true, false)], false);
        // ... and writes a text part's text, not the list itself (a text template that prints
        // `message.content` whole differs too, with the parts' keys in it).
        let parts = matches!((&with, &without), (Some(with), Some(without))
            if with != without
                && !without.contains("'type'")
                && !without.contains("\"type\"")
                && without.contains(QUESTION));
        let written = match (&with, &without) {
            (Some(with), Some(without)) if parts => ["<|image_pad|>", "<image>", "<|image|>"]
                .into_iter()
                .find(|t| has(t) && with.matches(t).count() == 1 + without.matches(t).count()),
            _ => None,
        };
        let images = match written {
            Some(marker) => Some(Images {
                marker: marker.into(),
                pad: marker.into(),
                open: String::new(),
                close: String::new(),
            }),
            // A parts template whose marker the tokenizer lacks: text-only records still work.
            None if parts => None,
            None if has("<|image_pad|>") => {
                let (open, close) = if has("<|vision_start|>") && has("<|vision_end|>") {
                    ("<|vision_start|>", "<|vision_end|>")
                } else {
                    ("", "")
                };
                Some(Images {
                    marker: IMAGE_PLACEHOLDER.into(),
                    pad: "<|image_pad|>".into(),
                    open: open.into(),
                    close: close.into(),
                })
            }
            None if has(IMAGE_PLACEHOLDER) => Some(Images {
                marker: IMAGE_PLACEHOLDER.into(),
                pad: IMAGE_PLACEHOLDER.into(),
                open: String::new(),
                close: String::new(),
            }),
            None => None,
        };
        let asked = [user(parts, false)];
        let generation_prompt = match (render(&asked, false), render(&asked, true)) {
            (Some(a), Some(b)) => b.strip_prefix(a.as_str()).unwrap_or("").to_owned(),
            _ => String::new(),
        };
        let answered = [
            user(parts, false),
            message_value(&Message::new(Role::Assistant, REPLY), parts),
        ];
        let turn_end = render(&answered, false)
            .and_then(|t| {
                t.rsplit_once(REPLY)
                    .map(|(_, end)| end.trim_end().to_owned())
            })
            .unwrap_or_default();
        Probe {
            parts,
            images,
            generation_prompt,
            turn_end,
        }
    }
}

/// Number of image tokens for an image resized to `height` × `width` pixels: one per
/// `merge × merge` block of `patch × patch` patches (Qwen2/2.5-VL: patch 14, merge 2, so one
/// token per 28 × 28 pixels; Qwen3-VL: patch 16; LLaVA-1.5: patch 14, merge 1 at 336 px, 576).
pub fn image_pad_tokens(height: u32, width: u32, patch: u32, merge: u32) -> usize {
    ((height / patch) as usize * (width / patch) as usize) / (merge as usize * merge as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_moves_the_spans_with_the_text() {
        let images = Images {
            marker: "<image>".into(),
            pad: "P".into(),
            open: "[".into(),
            close: "]".into(),
        };
        let text = "u<image>v<image>|reply|";
        let (out, moved) = expand(&images, text, &[3, 1]).unwrap();
        assert_eq!(out, "u[PPP]v[P]|reply|");
        assert_eq!(&out[moved_to(&moved, 17)..moved_to(&moved, 22)], "reply");
        assert_eq!(moved_to(&moved, 1), 1);
        // No image tokens at all: later text moves back.
        let (out, moved) = expand(&images, text, &[0, 0]).unwrap();
        assert_eq!(&out[moved_to(&moved, 17)..moved_to(&moved, 22)], "reply");
        assert!(matches!(
            expand(&images, text, &[1]),
            Err(ChatError::ImageCountMismatch {
                placeholders: 2,
                images: 1
            })
        ));
    }

    #[test]
    fn parts_split_at_placeholders_and_skip_empty_text() {
        let v = message_value(&Message::new(Role::User, "<image>\nq<image>"), true);
        assert_eq!(
            v.to_string(),
            r#"{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nq"}, {"type": "image"}]}"#
        );
    }

    #[test]
    fn pad_tokens_follow_the_patch_grid() {
        assert_eq!(image_pad_tokens(448, 448, 14, 2), 256);
        assert_eq!(image_pad_tokens(56, 28, 14, 2), 2);
        assert_eq!(image_pad_tokens(512, 768, 16, 2), 384);
        assert_eq!(image_pad_tokens(336, 336, 14, 1), 576);
    }
}
