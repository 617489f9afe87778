//! Conversations to token ids and labels, the way Qwen-VL training expects them.
//!
//! A LLaVA/Qwen-VL style record is a list of turns (`human`/`gpt`/`system`). [`ChatTokenizer`]
//! renders it with Qwen3's chat template (reproduced from `tokenizer_config.json`'s Jinja source,
//! byte for byte, for system/user/assistant turns), expands each `<image>` placeholder into
//! `<|vision_start|>` + N × `<|image_pad|>` + `<|vision_end|>` with N from the resized image's
//! patch grid, tokenizes the whole text once — as Hugging Face does, so merges across turn
//! boundaries come out the same — and masks every token outside the assistant's replies in the
//! labels.
//!
//! The token ids are checked against goldens produced by Hugging Face's Python `tokenizers` on
//! text rendered by jinja2 from the same template (`tests/data/qwen3_goldens.json`).

use std::ops::Range;
use std::path::Path;

use feedstore_proto::sample::IGNORE_INDEX;

/// Who speaks a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Instructions before the conversation.
    System,
    /// The human side (`"from": "human"`).
    User,
    /// The model's reply (`"from": "gpt"`), the part trained on.
    Assistant,
}

impl Role {
    /// Maps a LLaVA `from` field.
    pub fn from_llava(from: &str) -> Option<Role> {
        match from {
            "human" | "user" => Some(Role::User),
            "gpt" | "assistant" => Some(Role::Assistant),
            "system" => Some(Role::System),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
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
}

/// The placeholder LLaVA-style records put where an image goes.
pub const IMAGE_PLACEHOLDER: &str = "<image>";

/// Why a conversation could not be tokenized. Each rejects one sample, not the run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The tokenizer file could not be loaded.
    #[error("cannot load tokenizer {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// The tokenizers crate's message.
        message: String,
    },
    /// The tokenizer lacks a token the template needs.
    #[error("tokenizer has no {0} token; is it a Qwen-VL tokenizer?")]
    MissingToken(&'static str),
    /// Nothing to train on.
    #[error("conversation has no assistant reply")]
    NoAssistantReply,
    /// `<image>` placeholders and images disagree.
    #[error("conversation has {placeholders} <image> placeholders but {images} images")]
    ImageCountMismatch {
        /// Placeholders in the text.
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

/// Token ids and labels of one conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// One per id: the id where the assistant speaks, [`IGNORE_INDEX`] elsewhere.
    pub labels: Vec<i32>,
}

/// A tokenizer with Qwen's chat template.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    max_tokens: usize,
    /// A digest of the `tokenizer.json` bytes: part of a sample's cache key.
    identity: u128,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("max_tokens", &self.max_tokens)
            .finish()
    }
}

const REQUIRED_TOKENS: [&str; 5] = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
];

impl ChatTokenizer {
    /// Loads a `tokenizer.json`; conversations longer than `max_tokens` are rejected.
    pub fn from_file(path: &Path, max_tokens: usize) -> Result<ChatTokenizer, ChatError> {
        let load = |message: String| ChatError::Load {
            path: path.display().to_string(),
            message,
        };
        let json = std::fs::read(path).map_err(|e| load(e.to_string()))?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&json).map_err(|e| load(e.to_string()))?;
        Self::new(tokenizer, max_tokens, &json)
    }

    /// Loads a `tokenizer.json` from memory.
    pub fn from_bytes(json: &[u8], max_tokens: usize) -> Result<ChatTokenizer, ChatError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(json).map_err(|e| ChatError::Load {
            path: "<memory>".into(),
            message: e.to_string(),
        })?;
        Self::new(tokenizer, max_tokens, json)
    }

    fn new(
        tokenizer: tokenizers::Tokenizer,
        max_tokens: usize,
        json: &[u8],
    ) -> Result<ChatTokenizer, ChatError> {
        for token in REQUIRED_TOKENS {
            if tokenizer.token_to_id(token).is_none() {
                return Err(ChatError::MissingToken(token));
            }
        }
        Ok(ChatTokenizer {
            tokenizer,
            max_tokens,
            identity: feedstore_proto::stream::sample_key(&[json]),
        })
    }

    /// What distinguishes this tokenizer's output from another's: a digest of its
    /// `tokenizer.json` and the token limit.
    pub fn identity(&self) -> (u128, usize) {
        (self.identity, self.max_tokens)
    }

    /// Renders, expands, tokenizes and labels a conversation. `image_tokens[i]` is the number of
    /// `<|image_pad|>` tokens image `i` takes (its merged patch count).
    pub fn encode(
        &self,
        messages: &[Message],
        image_tokens: &[usize],
    ) -> Result<Encoded, ChatError> {
        let (text, spans) = render(messages, image_tokens)?;
        let expanded_len: usize = image_tokens.iter().sum();
        // Cheap early refusal before tokenizing megabytes of pad tokens.
        if expanded_len > self.max_tokens {
            return Err(ChatError::TooLong {
                tokens: expanded_len,
                max: self.max_tokens,
            });
        }
        self.encode_with(&text, |start, end| {
            spans.iter().any(|s| s.start <= start && end <= s.end)
        })
    }

    /// Tokenizes plain text; every token counts in the loss.
    pub fn encode_text(&self, text: &str) -> Result<Encoded, ChatError> {
        self.encode_with(text, |_, _| true)
    }

    /// Tokenizes `text` once, refuses it past the maximum, and labels each token by whether its
    /// byte range is `trained`.
    fn encode_with(
        &self,
        text: &str,
        trained: impl Fn(usize, usize) -> bool,
    ) -> Result<Encoded, ChatError> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ChatError::Encode(e.to_string()))?;
        let ids = encoding.get_ids().to_vec();
        if ids.len() > self.max_tokens {
            return Err(ChatError::TooLong {
                tokens: ids.len(),
                max: self.max_tokens,
            });
        }
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
        Ok(Encoded { ids, labels })
    }
}

/// Number of `<|image_pad|>` tokens for an image resized to `height` × `width` pixels: one per
/// `merge × merge` block of `patch × patch` patches (Qwen2/2.5-VL: patch 14, merge 2, so one
/// token per 28 × 28 pixels; Qwen3-VL: patch 16).
pub fn image_pad_tokens(height: u32, width: u32, patch: u32, merge: u32) -> usize {
    ((height / patch) as usize * (width / patch) as usize) / (merge as usize * merge as usize)
}

/// Python's `str.strip('\n')` family, which the template uses.
fn strip_newlines(s: &str) -> &str {
    s.trim_matches('\n')
}

/// Renders Qwen3's chat template (system/user/assistant turns, no tools, no generation prompt)
/// with images expanded; returns the text and the byte ranges of the assistant's replies (their
/// content and closing `<|im_end|>`), which are the tokens trained on.
fn render(
    messages: &[Message],
    image_tokens: &[usize],
) -> Result<(String, Vec<Range<usize>>), ChatError> {
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        return Err(ChatError::NoAssistantReply);
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
    // The template's `last_query_index`: the last user turn (tool responses aside, which
    // LLaVA-style records do not have).
    let last_query = messages
        .iter()
        .rposition(|m| m.role == Role::User)
        .unwrap_or(messages.len() - 1);
    let mut images = image_tokens.iter();
    let mut expand = |content: &str, out: &mut String| {
        let mut parts = content.split(IMAGE_PLACEHOLDER).peekable();
        while let Some(part) = parts.next() {
            out.push_str(part);
            if parts.peek().is_some() {
                let n = *images.next().expect("placeholder count checked");
                out.push_str("<|vision_start|>");
                out.reserve(n * "<|image_pad|>".len());
                for _ in 0..n {
                    out.push_str("<|image_pad|>");
                }
                out.push_str("<|vision_end|>");
            }
        }
    };
    let mut text = String::new();
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        match m.role {
            Role::System | Role::User => {
                text.push_str("<|im_start|>");
                text.push_str(m.role.name());
                text.push('\n');
                expand(&m.content, &mut text);
                text.push_str("<|im_end|>\n");
            }
            Role::Assistant => {
                let (mut content, mut reasoning) = (m.content.as_str(), "");
                if let Some(at) = content.rfind("</think>") {
                    let before = &content[..content.find("</think>").expect("present")];
                    reasoning = before.trim_end_matches('\n');
                    reasoning = reasoning
                        .rsplit("<think>")
                        .next()
                        .unwrap_or("")
                        .trim_start_matches('\n');
                    content = content[at + "</think>".len()..].trim_start_matches('\n');
                }
                text.push_str("<|im_start|>assistant\n");
                let start = text.len();
                if i > last_query && (i + 1 == messages.len() || !reasoning.is_empty()) {
                    text.push_str("<think>\n");
                    text.push_str(strip_newlines(reasoning));
                    text.push_str("\n</think>\n\n");
                    expand(content.trim_start_matches('\n'), &mut text);
                } else {
                    expand(content, &mut text);
                }
                text.push_str("<|im_end|>");
                spans.push(start..text.len());
                text.push('\n');
            }
        }
    }
    Ok((text, spans))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.into(),
        }
    }

    #[test]
    fn earlier_replies_have_no_think_block_and_the_last_has_an_empty_one() {
        let (text, spans) = render(
            &[
                msg(Role::User, "a"),
                msg(Role::Assistant, "b"),
                msg(Role::User, "c"),
                msg(Role::Assistant, "d"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\nd<|im_end|>\n"
        );
        assert_eq!(&text[spans[0].clone()], "b<|im_end|>");
        assert_eq!(
            &text[spans[1].clone()],
            "<think>\n\n</think>\n\nd<|im_end|>"
        );
    }

    #[test]
    fn placeholders_must_match_images() {
        let conv = [
            msg(Role::User, "<image>\n<image>\nq"),
            msg(Role::Assistant, "a"),
        ];
        assert!(matches!(
            render(&conv, &[4]),
            Err(ChatError::ImageCountMismatch {
                placeholders: 2,
                images: 1
            })
        ));
        assert!(matches!(
            render(&[msg(Role::User, "q")], &[]),
            Err(ChatError::NoAssistantReply)
        ));
    }

    #[test]
    fn pad_tokens_follow_the_patch_grid() {
        assert_eq!(image_pad_tokens(448, 448, 14, 2), 256);
        assert_eq!(image_pad_tokens(56, 28, 14, 2), 2);
        assert_eq!(image_pad_tokens(512, 768, 16, 2), 384);
    }
}
