//! Manifests: LLaVA / Qwen-VL style JSONL, one record per line, or LLaVA's JSON files, one
//! array of the same records (told apart by the first characters that are not white space: `[` then `{`).
//!
//! ```json
//! {"id": "vqa-1", "image": "s3://bucket/images/1.png",
//!  "conversations": [{"from": "human", "value": "<image>\nwhat shape?"}, {"from": "gpt", "value": "circle"}]}
//! {"id": "doc-2", "images": ["a.jpg", "b.jpg"], "conversations": [...]}
//! {"id": "txt-3", "text": "plain text, trained on in full"}
//! ```
//!
//! Image references are `s3://bucket/key` or file paths, relative ones resolved against the
//! manifest's folder (or the image root the reader is given: see [`crate::input::LocalFiles`]).
//! A bad record never stops the run: [`Manifest`] yields a [`Reject`] with the record's line
//! number (in an array, its position in it, from 1), the id when it could be read, and the
//! reason, and goes on with the next one. An array is read one record at a time, never whole;
//! an array whose structure breaks (text after it, a missing comma, a file cut short) ends the
//! manifest there, saying where, as a read failure does.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chat::{Message, Role};

pub use crate::source::ImageSource;

/// What a record trains on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// A conversation; only the assistant's replies count in the loss.
    Conversation(Vec<Message>),
    /// Plain text; every token counts.
    Text(String),
}

/// One good record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// 1-based line number in the manifest.
    pub line: u64,
    /// The record's id.
    pub id: String,
    /// Images, in the order of their `<image>` placeholders.
    pub images: Vec<ImageSource>,
    /// What to train on.
    pub content: Content,
    /// Tool definitions the chat template lists (the record's `"tools"`), as
    /// `apply_chat_template(..., tools=...)` takes them.
    pub tools: Option<serde_json::Value>,
    /// Where it was read, where its line does not say: a shard's sample (`SHARD: sample KEY
    /// (from byte N)`), named in its rejects at every stage.
    pub origin: Option<Box<str>>,
}

/// A sample that will not be produced, as written to the rejects JSONL file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reject {
    /// 1-based line number in the manifest.
    pub line: u64,
    /// The record's id, when it could be read.
    pub id: Option<String>,
    /// The pipeline stage that refused it (`manifest`, `shard`, `fetch`, `decode`, `tokenize`, `write`).
    pub stage: String,
    /// Why, in words.
    pub reason: String,
}

impl Reject {
    fn manifest(line: u64, id: Option<String>, reason: impl Into<String>) -> Reject {
        Reject {
            line,
            id,
            stage: "manifest".into(),
            reason: reason.into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(
    expecting = "a JSON object with \"id\" and \"conversations\" (or \"messages\" or \"text\")"
)]
struct RawRecord {
    id: Option<serde_json::Value>,
    image: Option<serde_json::Value>,
    images: Option<serde_json::Value>,
    conversations: Option<Vec<RawTurn>>,
    messages: Option<Vec<RawMessage>>,
    text: Option<String>,
    tools: Option<serde_json::Value>,
}

/// A turn in the chat form (`{"role", "content"}`), its content text or a list of parts
/// (`{"type": "text", "text"}`, `{"type": "image"}`), as `apply_chat_template` takes it.
#[derive(Deserialize)]
struct RawMessage {
    role: String,
    #[serde(default)]
    content: serde_json::Value,
    tool_calls: Option<serde_json::Value>,
}

impl RawMessage {
    /// The same turn in LLaVA's form: parts joined, an image part a placeholder.
    fn into_turn(self) -> Result<RawTurn, String> {
        let value = match self.content {
            serde_json::Value::String(text) => text,
            serde_json::Value::Null => String::new(),
            serde_json::Value::Array(parts) => {
                let mut text = String::new();
                for part in parts {
                    match part.get("type").and_then(|t| t.as_str()) {
                        Some("image" | "image_url") => {
                            text.push_str(crate::chat::IMAGE_PLACEHOLDER)
                        }
                        Some("text") => match part.get("text") {
                            Some(serde_json::Value::String(t)) => text.push_str(t),
                            _ => return Err("a \"text\" part without a string \"text\"".into()),
                        },
                        _ => {
                            return Err(format!(
                                "a {:?} message's part is neither {{\"type\": \"text\"}} nor \
                                 {{\"type\": \"image\"}}: {}",
                                self.role,
                                feedstore_proto::truncate(&part.to_string(), 200)
                            ));
                        }
                    }
                }
                text
            }
            other => {
                return Err(format!(
                    "a {:?} message's \"content\" is neither text nor a list of parts: {}",
                    self.role,
                    feedstore_proto::truncate(&other.to_string(), 200)
                ));
            }
        };
        Ok(RawTurn {
            from: self.role,
            value: serde_json::Value::String(value),
            tool_calls: self.tool_calls,
        })
    }
}

#[derive(Deserialize)]
struct RawTurn {
    from: String,
    value: serde_json::Value,
    tool_calls: Option<serde_json::Value>,
}
/// The image references of a record's `image` (one) and `images` (a list) fields.
fn image_refs(
    image: Option<serde_json::Value>,
    images: Option<serde_json::Value>,
) -> Result<Vec<String>, String> {
    let mut refs = Vec::new();
    for (field, value) in [("image", image), ("images", images)] {
        match value {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) if field == "image" => refs.push(s),
            Some(serde_json::Value::Array(items)) if field == "images" => {
                for item in items {
                    match item {
                        serde_json::Value::String(s) => refs.push(s),
                        other => return Err(format!("\"images\" holds a non-string {other}")),
                    }
                }
            }
            Some(other) => return Err(format!("field \"{field}\" has the wrong type: {other}")),
        }
    }
    Ok(refs)
}

/// A record's content: its `conversations` (checked turn by turn), or its `text` (a record
/// with no images).
fn content(
    conversations: Option<Vec<RawTurn>>,
    messages: Option<Vec<RawMessage>>,
    text: Option<String>,
    images: usize,
) -> Result<Content, String> {
    let conversations = match (conversations, messages) {
        (Some(_), Some(_)) => {
            return Err("record has both \"conversations\" and \"messages\"".into());
        }
        (None, Some(messages)) => Some(
            messages
                .into_iter()
                .map(RawMessage::into_turn)
                .collect::<Result<Vec<_>, String>>()?,
        ),
        (conversations, None) => conversations,
    };
    match (conversations, text) {
        (Some(turns), None) => {
            if turns.is_empty() {
                return Err("\"conversations\" is empty".into());
            }
            if turns.len() > crate::chat::MAX_TURNS {
                return Err(format!(
                    "\"conversations\" has {} turns; at most {} are taken",
                    turns.len(),
                    crate::chat::MAX_TURNS
                ));
            }
            let messages = turns
                .into_iter()
                .map(message)
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Content::Conversation(messages))
        }
        (None, Some(_)) if images > 0 => Err(format!(
            "a \"text\" record cannot have images ({images} given)"
        )),
        (None, Some(text)) => Ok(Content::Text(text)),
        (Some(_), Some(_)) => Err("record has both \"conversations\" and \"text\"".into()),
        (None, None) => Err("missing field \"conversations\" (or \"messages\" or \"text\")".into()),
    }
}

/// One turn of a record. `function_call` (ShareGPT's tool call) is an assistant turn whose value
/// is the call as JSON (`{"name": ..., "arguments": {...}}`); a turn's own `tool_calls` are taken
/// as they are.
fn message(turn: RawTurn) -> Result<Message, String> {
    if turn.from == "function_call" {
        // The call as JSON text (ShareGPT's form) or as an object.
        let call = match turn.value {
            serde_json::Value::String(text) => serde_json::from_str(&text).ok(),
            object => Some(object),
        }
        .filter(|c: &serde_json::Value| c.get("name").is_some_and(|n| n.is_string()))
        .ok_or_else(|| {
            "a \"function_call\" turn's value is not a JSON object with a \"name\"".to_owned()
        })?;
        return Ok(Message {
            role: Role::Assistant,
            content: String::new(),
            tool_calls: Some(serde_json::json!([{"type": "function", "function": call}])),
        });
    }
    let role = Role::from_llava(&turn.from).ok_or_else(|| {
        format!(
            "unknown speaker \"from\": {:?} (expected human, gpt, system, tool, observation or \
             function_call)",
            turn.from
        )
    })?;
    match &turn.tool_calls {
        Some(_) if role != Role::Assistant => {
            return Err(format!(
                "\"tool_calls\" on a {:?} turn (only assistant turns make calls)",
                turn.from
            ));
        }
        Some(calls) if !calls.is_array() => {
            return Err("\"tool_calls\" is not a list".into());
        }
        _ => {}
    }
    let serde_json::Value::String(content) = turn.value else {
        let value = turn.value.to_string();
        return Err(format!(
            "a {:?} turn's \"value\" is not a string: {}",
            turn.from,
            feedstore_proto::truncate(&value, 200)
        ));
    };
    Ok(Message {
        role,
        content,
        tool_calls: turn.tool_calls,
    })
}

/// The record in `text`, one JSON object, as record `line`; `default_id` stands for a missing
/// `"id"` (a shard's sample key). `images` turns the record's image references (at most
/// [`MAX_IMAGES_PER_RECORD`]) into its sources.
pub(crate) fn record_from_json(
    line: u64,
    text: &str,
    default_id: Option<&str>,
    images: impl FnOnce(&[String]) -> Result<Vec<ImageSource>, String>,
) -> Result<Record, Reject> {
    let raw: RawRecord = serde_json::from_str(text).map_err(|e| {
        Reject::manifest(
            line,
            default_id.map(str::to_owned),
            format!("malformed JSON: {e}"),
        )
    })?;
    let id = match (raw.id, default_id) {
        (Some(serde_json::Value::String(s)), _) if !s.is_empty() => s,
        (Some(serde_json::Value::Number(n)), _) => n.to_string(),
        (Some(_), _) => {
            return Err(Reject::manifest(
                line,
                default_id.map(str::to_owned),
                "field \"id\" must be a non-empty string or a number",
            ));
        }
        (None, Some(id)) => id.to_owned(),
        (None, None) => return Err(Reject::manifest(line, None, "missing field \"id\"")),
    };
    let reject = |reason: String| Reject::manifest(line, Some(id.clone()), reason);
    let refs = image_refs(raw.image, raw.images).map_err(reject)?;
    if refs.len() > MAX_IMAGES_PER_RECORD {
        return Err(reject(format!(
            "{} images; a record may have at most {MAX_IMAGES_PER_RECORD}",
            refs.len()
        )));
    }
    let images = images(&refs).map_err(reject)?;
    let content =
        content(raw.conversations, raw.messages, raw.text, images.len()).map_err(reject)?;
    if let Some(tools) = &raw.tools {
        if !tools.is_array() {
            return Err(reject(format!("\"tools\" is not a list: {tools}")));
        }
        if matches!(content, Content::Text(_)) {
            return Err(reject("a \"text\" record cannot have \"tools\"".into()));
        }
    }
    Ok(Record {
        line,
        id,
        images,
        content,
        tools: raw.tools,
        origin: None,
    })
}

/// The most images one record may name: a record's images are fetched and held together.
pub const MAX_IMAGES_PER_RECORD: usize = 128;

/// The longest line read; longer ones are rejected without being held in memory whole.
pub const MAX_LINE_BYTES: u64 = 16 << 20;

/// Reads a manifest, yielding a record or a reject per non-blank line (or element of an
/// array). A failure to read the manifest itself ends it: the failure is yielded once as a
/// reject (stage `manifest`, reason "cannot read the manifest: ...") and kept in
/// [`Manifest::failure`] for the caller to end the run with.
pub struct Manifest<R> {
    reader: BufReader<R>,
    base: PathBuf,
    /// The last record's line number (in an array, its position).
    line: u64,
    buf: Vec<u8>,
    /// Byte offset of the next line, and of the line last read.
    offset: u64,
    line_start: u64,
    /// `None` for JSONL; for an array, where the reader stands in it.
    array: Option<InArray>,
    /// Whether a line that is not blank was read.
    content_seen: bool,
    failure: ReadFailure,
}

/// Where a reader of a JSON array stands: what the next character (past white space) may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InArray {
    /// Before the opening `[` (a byte-order mark may come first).
    Open,
    /// Just after `[`: a record or `]`.
    First,
    /// After a record: `,` or `]`.
    Between,
    /// After `,`: a record.
    Next,
    /// Past `]`: only white space.
    Closed,
}

/// What reading the next line (or array element) into the buffer found.
enum Unit {
    /// A line or element is in the buffer.
    Read,
    /// The manifest ended.
    End,
    /// A line or element longer than [`MAX_LINE_BYTES`], of this many bytes, was skipped.
    TooLong(u64),
    /// The array's structure broke (in or after the record of this number): the manifest
    /// ends, saying why.
    Broken(String, u64),
}

/// Whether `reader`'s first characters past white space (and a byte-order mark) open a JSON
/// array of records, `[` then `{` (or `]`): LLaVA's `.json` form, not JSONL, whose lines are
/// objects (a JSONL file whose first line is some other array reads as JSONL, that line a
/// reject). Looks no further than what one buffer holds.
fn opens_array<R: Read>(reader: &mut BufReader<R>) -> std::io::Result<bool> {
    let head = reader.fill_buf()?;
    let head = head.strip_prefix(b"\xef\xbb\xbf").unwrap_or(head);
    let mut chars = head.iter().filter(|b| !b.is_ascii_whitespace());
    Ok(chars.next() == Some(&b'[') && matches!(chars.next(), Some(b'{' | b']')))
}

/// Where a [`Manifest`] keeps the error that ended it; a clone stays readable after the
/// manifest was handed to the pipeline.
#[derive(Debug, Clone, Default)]
pub struct ReadFailure(std::sync::Arc<std::sync::OnceLock<String>>);

impl ReadFailure {
    /// The error that ended the manifest, if one did.
    pub fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

impl Manifest<std::fs::File> {
    /// Opens a manifest file (a regular file: a directory, FIFO or device is refused, saying
    /// so); relative image paths resolve against its folder, made absolute.
    pub fn open(path: &Path) -> std::io::Result<Manifest<std::fs::File>> {
        let file = crate::input::open_regular(path)?;
        let base = std::path::absolute(path)?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        Ok(Manifest::new(file, base))
    }
}

impl<R: Read> Manifest<R> {
    /// Reads a manifest from any reader; relative image paths resolve against `base`.
    pub fn new(reader: R, base: PathBuf) -> Manifest<R> {
        let mut manifest = Manifest::starting_at(reader, base, 0, 0, 1 << 20, None);
        // (A read error here is met again by the first read, which reports it.)
        if opens_array(&mut manifest.reader).unwrap_or(false) {
            manifest.array = Some(InArray::Open);
        }
        manifest
    }

    /// A reader positioned at byte `offset`, which is the start of line `line + 1` (or, in an
    /// array, `at` its element `line + 1`).
    fn starting_at(
        reader: R,
        base: PathBuf,
        offset: u64,
        line: u64,
        buffer: usize,
        array: Option<InArray>,
    ) -> Manifest<R> {
        Manifest {
            reader: BufReader::with_capacity(buffer, reader),
            base,
            line,
            buf: Vec::new(),
            offset,
            line_start: offset,
            array,
            // (A reader started inside the file is past its start.)
            content_seen: offset > 0,
            failure: ReadFailure::default(),
        }
    }

    /// A handle on the error that ends this manifest early, for after the run.
    pub fn failure(&self) -> ReadFailure {
        self.failure.clone()
    }

    /// Reads the next line (or array element) into `buf`. Over-long ones are consumed and
    /// reported with their length without keeping more than the limit.
    fn next_unit(&mut self) -> std::io::Result<Unit> {
        if self.array.is_some() {
            return self.next_element();
        }
        Ok(match self.next_line()? {
            Ok(true) => Unit::Read,
            Ok(false) => Unit::End,
            Err(len) => Unit::TooLong(len),
        })
    }

    /// Reads the next array element into `buf`: an object as a JSONL line holds one (or any
    /// other value, which parsing then refuses), found by its brackets and strings, not parsed.
    fn next_element(&mut self) -> std::io::Result<Unit> {
        self.buf.clear();
        let mut element = Element::default();
        let mut len = 0u64;
        loop {
            let chunk = self.reader.fill_buf()?;
            if chunk.is_empty() {
                let state = self.array.unwrap_or(InArray::Closed);
                return Ok(match (element.started, state) {
                    (false, InArray::Closed) => Unit::End,
                    (true, _) => self.broken(
                        format!(
                            "the file ends inside record {} of the JSON array (cut short?)",
                            self.line
                        ),
                        self.line,
                    ),
                    _ => self.broken(
                        "the JSON array ends without its closing ']' (the file was cut short?)"
                            .into(),
                        self.line + 1,
                    ),
                });
            }
            let mut used = 0;
            let mut done = None;
            let mut kept_from = 0;
            for (i, &b) in chunk.iter().enumerate() {
                if !element.started {
                    used = i + 1;
                    let at = self.offset + i as u64;
                    let state = self.array.unwrap_or(InArray::Closed);
                    if b.is_ascii_whitespace() || (state == InArray::Open && at < 3 && b >= 0xbb) {
                        continue;
                    }
                    match (state, b) {
                        (InArray::Open, b'[') => self.array = Some(InArray::First),
                        (InArray::First | InArray::Between, b']') => {
                            self.array = Some(InArray::Closed);
                        }
                        (InArray::Between, b',') => self.array = Some(InArray::Next),
                        (InArray::First | InArray::Next, _) if Element::starts(b) => {
                            element.started = true;
                            self.line += 1;
                            self.line_start = at;
                            kept_from = i;
                        }
                        _ => {
                            let expected = match (state, b) {
                                (InArray::Open, _) => "'['",
                                (InArray::Between, _) => "',' or ']'",
                                (InArray::Closed, _) => "nothing after the array's closing ']'",
                                (InArray::Next, b']') => "a record after ',' (a trailing ',')",
                                (InArray::First | InArray::Next, _) => "a record",
                            };
                            self.array = Some(InArray::Closed);
                            done = Some(Unit::Broken(
                                format!(
                                    "byte {at} of the file is {}, where {expected} belongs \
                                     (after record {})",
                                    shown(b),
                                    self.line
                                ),
                                self.line + 1,
                            ));
                            break;
                        }
                    }
                    if !element.started {
                        continue;
                    }
                }
                match element.push(b) {
                    Ok(None) => used = i + 1,
                    // The element ends with this byte, or (a bare value) before it.
                    Ok(Some(with)) => {
                        used = i + usize::from(with);
                        done = Some(Unit::Read);
                        break;
                    }
                    Err(opened) => {
                        used = i + 1;
                        self.array = Some(InArray::Closed);
                        done = Some(Unit::Broken(
                            format!(
                                "byte {} of the file is {}, which does not close the {} before \
                                 it (record {})",
                                self.offset + i as u64,
                                shown(b),
                                shown(opened),
                                self.line
                            ),
                            self.line,
                        ));
                        break;
                    }
                }
            }
            if element.started {
                let kept = &chunk[kept_from..used];
                len += kept.len() as u64;
                let room = (MAX_LINE_BYTES as usize).saturating_sub(self.buf.len());
                self.buf.extend_from_slice(&kept[..kept.len().min(room)]);
            }
            self.offset += used as u64;
            self.reader.consume(used);
            if let Some(unit) = done {
                if matches!(unit, Unit::Read) {
                    self.array = Some(InArray::Between);
                    if len > MAX_LINE_BYTES {
                        return Ok(Unit::TooLong(len));
                    }
                }
                return Ok(unit);
            }
        }
    }

    /// Ends the manifest: the array broke where `why` says, in record `line`.
    fn broken(&mut self, why: String, line: u64) -> Unit {
        self.array = Some(InArray::Closed);
        Unit::Broken(why, line)
    }

    /// Reads the next line into `buf`; `Ok(false)` at the end. Over-long lines are consumed and
    /// reported as `Err(length)` without keeping more than the limit.
    fn next_line(&mut self) -> std::io::Result<Result<bool, u64>> {
        self.buf.clear();
        self.line_start = self.offset;
        let n = (&mut self.reader)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut self.buf)?;
        self.offset += n as u64;
        if n == 0 {
            return Ok(Ok(false));
        }
        self.line += 1;
        if n as u64 > MAX_LINE_BYTES && self.buf.last() != Some(&b'\n') {
            let mut skipped = n as u64;
            loop {
                self.buf.clear();
                let m = (&mut self.reader)
                    .take(1 << 20)
                    .read_until(b'\n', &mut self.buf)?;
                skipped += m as u64;
                self.offset += m as u64;
                if m == 0 || self.buf.last() == Some(&b'\n') {
                    break;
                }
            }
            return Ok(Err(skipped));
        }
        Ok(Ok(true))
    }

    fn parse(&self) -> Result<Option<Record>, Reject> {
        let line = self.line;
        let mut text = std::str::from_utf8(&self.buf)
            .map_err(|e| Reject::manifest(line, None, format!("not UTF-8: {e}")))?;
        if line == 1 {
            text = text.trim_start_matches('\u{feff}');
        }
        let text = text.trim();
        if text.is_empty() {
            return Ok(None);
        }
        record_from_json(line, text, None, |refs| {
            refs.iter().map(|r| self.image_source(r)).collect()
        })
        .map(Some)
    }

    fn image_source(&self, reference: &str) -> Result<ImageSource, String> {
        image_source(&self.base, reference)
    }
}

/// The source an image reference in a record names: `s3://bucket/key`, or a path (relative
/// ones against `base`, the manifest's folder, unless the reader is given another image root).
pub(crate) fn image_source(base: &Path, reference: &str) -> Result<ImageSource, String> {
    if reference.trim().is_empty() {
        return Err("empty image reference".into());
    }
    if let Some(rest) = reference.strip_prefix("s3://") {
        return match rest.split_once('/') {
            Some((bucket, key)) if !bucket.is_empty() && !key.is_empty() => Ok(ImageSource::S3 {
                bucket: bucket.into(),
                key: key.into(),
            }),
            _ => Err(format!(
                "image reference {reference:?} is not s3://bucket/key"
            )),
        };
    }
    if let Some((scheme, _)) = reference.split_once("://") {
        return Err(format!(
            "image reference {reference:?}: scheme {scheme}:// is not supported (use s3:// or a path)"
        ));
    }
    Ok(ImageSource::local(base, reference))
}

/// A manifest indexed for random access: record `i` is the `i`-th non-blank line (good or not;
/// in an array, its `i`-th element), which is how a stream numbers records. The index holds 16
/// bytes per record.
#[derive(Debug)]
pub struct IndexedManifest {
    file: std::fs::File,
    base: PathBuf,
    /// (byte offset, line number - 1) of each record's line (or array element).
    lines: Vec<(u64, u64)>,
    /// Whether the manifest is a JSON array.
    array: bool,
}

impl IndexedManifest {
    /// Reads the manifest once to find where every record starts.
    pub fn open(path: &Path) -> std::io::Result<IndexedManifest> {
        let mut manifest = Manifest::open(path)?;
        let mut lines = Vec::new();
        while manifest.next().is_some() {
            if let Some(failure) = manifest.failure.get() {
                return Err(std::io::Error::other(failure.to_owned()));
            }
            lines.push((manifest.line_start, manifest.line - 1));
        }
        Ok(IndexedManifest {
            array: manifest.array.is_some(),
            // The descriptor indexed, read again by position: not the path, which may have
            // been replaced since.
            file: manifest.reader.into_inner(),
            base: manifest.base,
            lines,
        })
    }

    /// Records in the manifest.
    pub fn len(&self) -> u64 {
        self.lines.len() as u64
    }

    /// Whether it has no records.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Record `i`, read and parsed again from the file (positioned reads on the one open
    /// descriptor, so threads may read at once).
    pub fn get(&self, i: u64) -> Result<Record, Reject> {
        let &(offset, line) = self.lines.get(i as usize).ok_or_else(|| {
            Reject::manifest(0, None, format!("record {i} is past the manifest's end"))
        })?;
        let at = ReadAt {
            file: &self.file,
            offset,
        };
        let array = self.array.then_some(InArray::Next);
        Manifest::starting_at(at, self.base.clone(), offset, line, 64 << 10, array)
            .next()
            .unwrap_or_else(|| {
                Err(Reject::manifest(
                    line + 1,
                    None,
                    "cannot read the manifest: it ended early (changed since it was indexed?)",
                ))
            })
    }
}

/// Reads a file from an offset with `pread`, leaving the descriptor's position alone.
struct ReadAt<'a> {
    file: &'a std::fs::File,
    offset: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(buf, self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// One element of a JSON array, followed byte by byte to its end: nested brackets and
/// strings (with their escapes) counted, nothing else checked (parsing does that).
#[derive(Debug, Default)]
struct Element {
    started: bool,
    /// Open brackets (`{`, `[`) not yet closed, and the outermost [`MAX_TRACKED_DEPTH`] of
    /// them (deeper ones are counted only: parsing refuses such nesting anyway).
    depth: u64,
    open: Vec<u8>,
    in_string: bool,
    escaped: bool,
    /// A bare value (a number, `true`, ...): it ends at the first byte no such value has.
    bare: bool,
    seen: bool,
}

/// Brackets whose kind an [`Element`] remembers, to tell a `}` closing a `[` (and the
/// reverse) from a good close.
const MAX_TRACKED_DEPTH: usize = 1024;

/// A byte as a message shows it: the character when it is printable ASCII, else its value.
fn shown(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("'{}'", char::from(b))
    } else {
        format!("byte {b:#04x}")
    }
}

impl Element {
    /// Whether a JSON value may begin with `b`.
    fn starts(b: u8) -> bool {
        matches!(
            b,
            b'{' | b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n'
        )
    }

    /// Takes the element's next byte: `Ok(Some(true))` when it ends with this byte,
    /// `Ok(Some(false))` when it ended just before it (a bare value's end), `Ok(None)` while it
    /// goes on; `Err(opening)` when `b` closes a bracket of the other kind.
    fn push(&mut self, b: u8) -> Result<Option<bool>, u8> {
        let first = !self.seen;
        self.seen = true;
        if self.in_string {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => {
                    self.in_string = false;
                    if self.depth == 0 {
                        return Ok(Some(true)); // a bare string
                    }
                }
                _ => {}
            }
            return Ok(None);
        }
        if self.bare {
            let goes_on = b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.');
            return Ok((!goes_on).then_some(false));
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => {
                if self.depth < MAX_TRACKED_DEPTH as u64 {
                    self.open.push(b);
                }
                self.depth += 1;
            }
            b'}' | b']' if self.depth > 0 => {
                if self.depth <= MAX_TRACKED_DEPTH as u64 {
                    let opening = self.open.pop().unwrap_or(b'[');
                    if (opening == b'{') != (b == b'}') {
                        return Err(opening);
                    }
                }
                self.depth -= 1;
                if self.depth == 0 {
                    return Ok(Some(true));
                }
            }
            _ if first => self.bare = true,
            _ => {}
        }
        Ok(None)
    }
}

impl<R: Read> Iterator for Manifest<R> {
    type Item = Result<Record, Reject>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failure.get().is_some() {
            return None;
        }
        loop {
            let failed = |this: &mut Self, reason: String, line: u64| {
                let _ = this.failure.0.set(reason.clone());
                Some(Err(Reject::manifest(line, None, reason)))
            };
            match self.next_unit() {
                Err(e) => {
                    let line = self.line + 1;
                    return failed(self, format!("cannot read the manifest: {e}"), line);
                }
                Ok(Unit::Broken(why, line)) => {
                    return failed(self, format!("cannot read the manifest: {why}"), line);
                }
                Ok(Unit::End) => return None,
                Ok(Unit::TooLong(len)) => {
                    let what = if self.array.is_some() {
                        "record"
                    } else {
                        "line"
                    };
                    return Some(Err(Reject::manifest(
                        self.line,
                        None,
                        format!("{what} of {len} bytes exceeds the limit of {MAX_LINE_BYTES}"),
                    )));
                }
                Ok(Unit::Read) => {
                    if !self.content_seen {
                        let text = String::from_utf8_lossy(&self.buf);
                        let text = text.trim_start_matches('\u{feff}').trim();
                        self.content_seen = !text.is_empty();
                        if self.array.is_none() && text == "{" {
                            // One JSON document over many lines: not a record per line. Said
                            // once, not as a reject of every line.
                            let reason = "cannot read the manifest: its first line is a lone \
                                          '{', one JSON object over many lines; a manifest is a \
                                          record per line (JSONL) or a JSON array of records"
                                .to_string();
                            let line = self.line;
                            return failed(self, reason, line);
                        }
                    }
                    match self.parse() {
                        Ok(None) => continue,
                        Ok(Some(record)) => return Some(Ok(record)),
                        Err(reject) => return Some(Err(reject)),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<Result<Record, Reject>> {
        Manifest::new(text.as_bytes(), PathBuf::from("/data/set")).collect()
    }

    #[test]
    fn good_records_of_every_shape() {
        let out = read(concat!(
            "\u{feff}{\"id\": \"a\", \"image\": \"s3://bkt/img/1.png\", \"conversations\": [{\"from\": \"human\", \"value\": \"<image>\\nq\"}, {\"from\": \"gpt\", \"value\": \"r\"}]}\r\n",
            "\n",
            "{\"id\": 7, \"images\": [\"x/1.jpg\", \"/abs/2.jpg\"], \"conversations\": [{\"from\": \"system\", \"value\": \"s\"}, {\"from\": \"human\", \"value\": \"<image><image>\"}, {\"from\": \"gpt\", \"value\": \"ok\"}]}\n",
            "{\"id\": \"t\", \"text\": \"hello world\"}",
        ));
        assert_eq!(out.len(), 3);
        let a = out[0].as_ref().unwrap();
        assert_eq!((a.line, a.id.as_str()), (1, "a"));
        assert_eq!(
            a.images,
            vec![ImageSource::S3 {
                bucket: "bkt".into(),
                key: "img/1.png".into()
            }]
        );
        let b = out[1].as_ref().unwrap();
        assert_eq!((b.line, b.id.as_str()), (3, "7"));
        assert_eq!(
            b.images,
            vec![
                ImageSource::local("/data/set", "x/1.jpg"),
                ImageSource::local("/data/set", "/abs/2.jpg")
            ]
        );
        assert!(
            matches!(&b.content, Content::Conversation(m) if m.len() == 3 && m[0].role == Role::System)
        );
        assert_eq!(
            out[2].as_ref().unwrap().content,
            Content::Text("hello world".into())
        );
    }

    /// Chat `messages` (text, or parts with image parts where the images go) are the same
    /// record as LLaVA's `conversations`.
    #[test]
    fn chat_messages_are_the_same_record_as_conversations() {
        let out = read(concat!(
            "{\"id\": \"a\", \"image\": \"1.png\", \"conversations\": [{\"from\": \"system\", \"value\": \"s\"}, {\"from\": \"human\", \"value\": \"<image>\\nq\"}, {\"from\": \"gpt\", \"value\": \"r\", \"tool_calls\": [{\"name\": \"f\"}]}]}\n",
            "{\"id\": \"a\", \"image\": \"1.png\", \"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": [{\"type\": \"image\"}, {\"type\": \"text\", \"text\": \"\\nq\"}]}, {\"role\": \"assistant\", \"content\": \"r\", \"tool_calls\": [{\"name\": \"f\"}]}]}\n",
            "{\"id\": \"b\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"video\"}]}]}\n",
            "{\"id\": \"c\", \"messages\": [{\"role\": \"user\", \"content\": 5}]}\n",
            "{\"id\": \"d\", \"messages\": [], \"conversations\": []}\n",
            "{\"id\": \"e\", \"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}\n",
        ));
        let (a, b) = (out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
        assert_eq!((&a.content, &a.images), (&b.content, &b.images));
        for (line, want) in [
            (2, "neither {\"type\": \"text\"}"),
            (3, "neither text nor a list of parts"),
            (4, "both \"conversations\" and \"messages\""),
            (5, "unknown speaker"),
        ] {
            let reason = &out[line].as_ref().unwrap_err().reason;
            assert!(reason.contains(want), "line {}: {reason}", line + 1);
        }
    }

    #[test]
    fn every_kind_of_bad_line_is_a_reject_with_its_line_and_reason() {
        let cases: &[(&str, &str)] = &[
            (
                "{\"id\": \"a\", \"image\": \"1.png\", \"conversations\": [",
                "malformed JSON",
            ),
            ("not json at all", "malformed JSON"),
            (
                "{\"image\": \"1.png\", \"conversations\": []}",
                "missing field \"id\"",
            ),
            (
                "{\"id\": \"b\", \"image\": \"1.png\"}",
                "missing field \"conversations\"",
            ),
            ("{\"id\": \"c\", \"conversations\": []}", "is empty"),
            (
                "{\"id\": \"d\", \"conversations\": [{\"from\": \"robot\", \"value\": \"x\"}]}",
                "unknown speaker",
            ),
            (
                "{\"id\": \"e\", \"image\": 5, \"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}",
                "wrong type",
            ),
            (
                "{\"id\": \"f\", \"image\": \"http://x/1.png\", \"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}",
                "not supported",
            ),
            (
                "{\"id\": \"g\", \"image\": \"s3://bucket-only\", \"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}",
                "not s3://bucket/key",
            ),
            (
                "{\"id\": \"h\", \"image\": \" \", \"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}",
                "empty image reference",
            ),
            (
                "{\"id\": \"i\", \"text\": \"t\", \"image\": \"1.png\"}",
                "cannot have images",
            ),
            ("{\"id\": [1], \"text\": \"t\"}", "\"id\" must be"),
            (
                "{\"id\": \"j\", \"conversations\": [{\"from\": \"function_call\", \"value\": \"get(1)\"}]}",
                "not a JSON object with a \"name\"",
            ),
            (
                "{\"id\": \"k\", \"conversations\": [{\"from\": \"human\", \"value\": \"x\", \"tool_calls\": []}]}",
                "only assistant turns make calls",
            ),
            (
                "{\"id\": \"l\", \"tools\": {\"name\": \"f\"}, \"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}",
                "\"tools\" is not a list",
            ),
        ];
        let text: String = cases.iter().map(|(l, _)| format!("{l}\n")).collect();
        let out = read(&text);
        assert_eq!(out.len(), cases.len());
        for (i, ((_, want), got)) in cases.iter().zip(&out).enumerate() {
            let reject = got.as_ref().unwrap_err();
            assert_eq!(reject.line, i as u64 + 1);
            assert_eq!(reject.stage, "manifest");
            assert!(
                reject.reason.contains(want),
                "line {}: {:?} lacks {want:?}",
                i + 1,
                reject.reason
            );
        }
        assert_eq!(out[1].as_ref().unwrap_err().id, None);
        assert_eq!(out[3].as_ref().unwrap_err().id.as_deref(), Some("b"));
    }

    /// A JSON document over many lines (`{"data": [...]}` pretty-printed) is refused once,
    /// saying what a manifest is, not rejected line by line.
    #[test]
    fn one_object_over_many_lines_is_not_a_manifest() {
        let text = "\n{\n  \"data\": [\n    {\"id\": \"a\", \"text\": \"x\"}\n  ]\n}\n";
        let mut manifest = Manifest::new(text.as_bytes(), PathBuf::from("/d"));
        let out: Vec<_> = manifest.by_ref().collect();
        assert_eq!(out.len(), 1, "{out:?}");
        let failure = manifest.failure().get().unwrap_or_default().to_string();
        assert!(failure.contains("a lone '{'"), "{failure}");
        assert_eq!(out[0].as_ref().unwrap_err().line, 2);
    }

    #[test]
    fn a_line_that_is_not_an_object_says_what_a_record_is() {
        let out = read("[1,2,3]\n\"text\"\n");
        for reject in out.iter().map(|r| r.as_ref().unwrap_err()) {
            assert!(
                reject.reason.contains("expected a JSON object with \"id\"")
                    && !reject.reason.contains("RawRecord"),
                "{}",
                reject.reason
            );
        }
    }

    #[test]
    fn a_read_error_ends_the_manifest_once() {
        struct Broken;
        impl Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(std::io::Error::from_raw_os_error(
                    nix::errno::Errno::EIO as i32,
                ))
            }
        }
        let manifest = Manifest::new(Broken, PathBuf::from("/data"));
        let failure = manifest.failure();
        let out: Vec<_> = manifest.take(10).collect();
        assert_eq!(out.len(), 1, "one reject, then the end");
        assert!(
            out[0]
                .as_ref()
                .unwrap_err()
                .reason
                .contains("cannot read the manifest")
        );
        assert!(
            failure
                .get()
                .is_some_and(|e| e.contains("Input/output error")),
            "{failure:?}"
        );
    }

    #[test]
    fn a_manifest_must_be_a_regular_file() {
        let dir =
            std::env::temp_dir().join(format!("feedstore-manifest-kinds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.jsonl");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        for (path, what) in [
            (dir.as_path(), "is a directory"),
            (fifo.as_path(), "is a FIFO"),
            (Path::new("/dev/zero"), "is a character device"),
        ] {
            let err = Manifest::open(path).err().expect("refused").to_string();
            assert!(err.contains(what), "{path:?}: {err}");
            let err = IndexedManifest::open(path).unwrap_err().to_string();
            assert!(err.contains(what), "{path:?}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_over_long_line_is_rejected_and_the_next_one_read() {
        let long = format!(
            "{{\"id\": \"big\", \"text\": \"{}\"}}\n",
            "x".repeat(MAX_LINE_BYTES as usize + 10)
        );
        let text = format!("{long}{{\"id\": \"next\", \"text\": \"ok\"}}\n");
        let out = read(&text);
        assert_eq!(out.len(), 2);
        assert!(
            out[0]
                .as_ref()
                .unwrap_err()
                .reason
                .contains("exceeds the limit")
        );
        assert_eq!(out[1].as_ref().unwrap().id, "next");
        assert_eq!(out[1].as_ref().unwrap().line, 2);
    }

    /// Records as LLaVA's JSON files hold them, one array (compact, pretty-printed, with a
    /// byte-order mark): the same records and rejects, by position, as the same lines of JSONL.
    #[test]
    fn a_json_array_reads_as_the_same_records_as_jsonl() {
        let records = [
            r#"{"id": "a", "image": "x.png", "conversations": [{"from": "human", "value": "<image>\nsay \"[}\" and \\"}, {"from": "gpt", "value": "ok ]"}]}"#,
            r#"{"id": 7, "text": "seven, with a comma"}"#,
            r#"{"id": "no-content"}"#,
            r#"{"id": "last", "text": "end"}"#,
        ];
        let jsonl = read(&records.join("\n"));
        assert_eq!(jsonl.iter().filter(|r| r.is_ok()).count(), 3);
        let values: Vec<serde_json::Value> = records
            .iter()
            .map(|r| serde_json::from_str(r).unwrap())
            .collect();
        for array in [
            format!("[{}]", records.join(",")),
            format!("\u{feff}  [\n  {}\n]\n", records.join(" ,\n  ")),
            serde_json::to_string_pretty(&values).unwrap(),
        ] {
            assert_eq!(read(&array), jsonl, "{array}");
        }
        // Values that are not records are rejects at their position; the rest reads on.
        let out = read(r#"[{}, 1, "two]", [3, {}], -4.5e1 ,{"id": "five", "text": "5"}]"#);
        assert_eq!(out.len(), 6);
        assert!(out[..5].iter().all(Result::is_err), "{out:?}");
        let five = out[5].as_ref().unwrap();
        assert_eq!((five.id.as_str(), five.line), ("five", 6));
        assert!(read("[]").is_empty() && read(" [ ]\n\n").is_empty());
        // An over-long record is skipped, not held whole, and the next one read.
        let long = format!(
            "[{{\"id\": \"big\", \"text\": \"{}\"}}, {{\"id\": \"next\", \"text\": \"ok\"}}]",
            "x".repeat(MAX_LINE_BYTES as usize + 10)
        );
        let out = read(&long);
        assert!(out[0].as_ref().unwrap_err().reason.contains("record of"));
        assert_eq!(out[1].as_ref().unwrap().line, 2);
    }

    /// An array whose structure breaks ends the manifest there, saying where, after the
    /// records before the break.
    #[test]
    fn a_broken_array_ends_the_manifest_saying_where() {
        for (text, says) in [
            (
                r#"[{"id": "a", "text": "x"} {"id": "b", "text": "y"}]"#,
                "where ',' or ']' belongs (after record 1)",
            ),
            (
                r#"[{"id": "a", "text": "x"}, {"id": "b", "te"#,
                "ends inside record 2",
            ),
            (r#"[{"id": "a", "text": "x"},"#, "without its closing ']'"),
            (
                r#"[{"id": "a", "text": "x"}] {"id": "b"}"#,
                "nothing after the array's closing ']'",
            ),
            (r#"[{"id": "a", "text": "x"},]"#, "(a trailing ',')"),
            (
                r#"[{"id": "a", "text": "x"},,{"id": "b", "text": "y"}]"#,
                "byte 26 of the file is ',', where a record belongs",
            ),
            (
                r#"[{"id": "a", "text": "x"}, {"b": [1, 2}, {"id": "c"}]"#,
                "byte 38 of the file is '}', which does not close the '['",
            ),
        ] {
            let mut manifest = Manifest::new(text.as_bytes(), PathBuf::from("/d"));
            let out: Vec<_> = manifest.by_ref().collect();
            assert_eq!(out[0].as_ref().map(|r| r.id.as_str()), Ok("a"), "{text}");
            assert_eq!(out.len(), 2, "{text}");
            let failure = manifest.failure().get().unwrap_or_default().to_string();
            assert!(failure.contains(says), "{text}: {failure}");
            let reject = out[1].as_ref().unwrap_err();
            assert!(reject.reason.contains(says));
            assert_eq!(reject.line, 2, "{text}: the record it broke in or after");
        }
        // Text inside a string never becomes a record: a value that runs into a quote breaks
        // the array there.
        let text = r#"[{"id": "a", "text": "x"}, 1"oops, {"id": "evil", "text": "y"}"]"#;
        let mut manifest = Manifest::new(text.as_bytes(), PathBuf::from("/d"));
        let out: Vec<_> = manifest.by_ref().collect();
        assert!(out.iter().flatten().all(|r| r.id != "evil"), "{out:?}");
        let failure = manifest.failure().get().unwrap_or_default().to_string();
        assert!(failure.contains("byte 28 of the file is '\"'"), "{failure}");
    }

    #[test]
    fn indexed_records_equal_the_sequential_ones() {
        let dir = std::env::temp_dir().join(format!("feedstore-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.jsonl");
        let text = concat!(
            "\u{feff}{\"id\": \"a\", \"image\": \"x.png\", \"conversations\": [{\"from\": \"human\", \"value\": \"<image>\"}]}\n",
            "\n",
            "   \n",
            "{\"id\": \"broken\", \n",
            "{\"id\": 7, \"text\": \"seven\"}\r\n",
            "\n",
            "{\"id\": \"last\", \"text\": \"no newline at the end\"}",
        );
        std::fs::write(&path, text).unwrap();
        let sequential: Vec<_> = Manifest::open(&path).unwrap().collect();
        let indexed = IndexedManifest::open(&path).unwrap();
        assert_eq!(indexed.len(), 4);
        assert_eq!(sequential.len(), 4);
        for (i, item) in sequential.iter().enumerate() {
            assert_eq!(&indexed.get(i as u64), item, "record {i}");
        }
        assert_eq!(indexed.get(3).unwrap().line, 7);
        assert!(indexed.get(4).is_err());
        // The same of an array, pretty-printed: record i is its i-th element.
        let array = dir.join("m.json");
        let text = "[\n  {\"id\": \"a\",\n   \"text\": \"x\"},\n  {\"id\": 2},\n  {\"id\": \"c\", \"text\": \"[{\"}\n]\n";
        std::fs::write(&array, text).unwrap();
        let sequential: Vec<_> = Manifest::open(&array).unwrap().collect();
        let indexed = IndexedManifest::open(&array).unwrap();
        assert_eq!((indexed.len(), sequential.len()), (3, 3));
        for (i, item) in sequential.iter().enumerate() {
            assert_eq!(&indexed.get(i as u64), item, "record {i}");
        }
        assert_eq!(indexed.get(2).unwrap().id, "c");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
