//! Token ids equal what Hugging Face `transformers` makes of the same records under four
//! families' chat templates: Qwen3's (the built-in one), and Qwen2.5-VL's, LLaVA-1.5's and Llama
//! 3.1's as fixtures; labels equal those the golden script finds with each family's own turn
//! markers, written out there (goldens from `tests/data/chat/make_chat_goldens.py`). The records
//! go through the manifest reader, so its reading of tool calls and tool results is checked too.

use std::path::Path;

use feedstore_producer::chat::{ChatError, ChatTokenizer, Encoded, Message, Role};
use feedstore_producer::manifest::{Content, Manifest};
use feedstore_producer::template::{ChatTemplate, SpecialTokens, TemplateError};
mod common;

use common::{DATA, tokenizer, tokenizer_json};

fn goldens() -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{DATA}/chat/goldens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The Qwen3 tokenizer with a family's extra special tokens, added as the golden script adds
/// them.
fn tokenizer_json_for(family: &serde_json::Value) -> Vec<u8> {
    let mut json: serde_json::Value = serde_json::from_slice(&tokenizer_json()).unwrap();
    for token in family["extra"].as_array().unwrap() {
        let added = json["added_tokens"].as_array_mut().unwrap();
        let id = added
            .iter()
            .map(|t| t["id"].as_u64().unwrap())
            .max()
            .unwrap()
            + 1;
        added.push(
            serde_json::json!({"id": id, "content": token, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    serde_json::to_vec(&json).unwrap()
}

fn chat_tokenizer(name: &str, family: &serde_json::Value) -> ChatTokenizer {
    let template = if name == "qwen3" {
        ChatTemplate::qwen3()
    } else {
        let special = SpecialTokens {
            bos: family["bos"].as_str().map(str::to_owned),
            eos: family["eos"].as_str().map(str::to_owned),
        };
        ChatTemplate::from_file(Path::new(&format!("{DATA}/chat/{name}.jinja")), special).unwrap()
    };
    ChatTokenizer::with_template(&tokenizer_json_for(family), template, 1 << 20).unwrap()
}

/// A golden case's record, read as a manifest line (with as many images as it has image
/// counts).
fn read_record(case: &serde_json::Value) -> (Vec<Message>, Option<serde_json::Value>) {
    let mut record = case["record"].clone();
    record["id"] = "case".into();
    let images = case["image_tokens"].as_array().unwrap().len();
    record["images"] = (0..images).map(|i| format!("{i}.png")).collect();
    let line = record.to_string();
    let mut manifest = Manifest::new(line.as_bytes(), "/data".into());
    let record = manifest.next().unwrap().unwrap();
    match record.content {
        Content::Conversation(messages) => (messages, record.tools),
        Content::Text(_) => unreachable!(),
    }
}

fn numbers<T: serde::de::DeserializeOwned>(v: &serde_json::Value) -> Vec<T> {
    serde_json::from_value(v.clone()).unwrap()
}

/// A golden case's record, read and encoded; with its name for messages.
fn encode_case(tok: &ChatTokenizer, family: &str, case: &serde_json::Value) -> (String, Encoded) {
    let what = format!("{family} / {}", case["name"]);
    let (messages, tools) = read_record(case);
    let encoded = tok
        .encode_with_tools(
            &messages,
            tools.as_ref(),
            &numbers::<usize>(&case["image_tokens"]),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    (what, encoded)
}

#[test]
fn ids_and_labels_match_transformers_for_four_families() {
    let goldens = goldens();
    let families = goldens["families"].as_object().unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    assert!(cases.len() >= 39, "{} cases", cases.len());
    for (name, family) in families {
        let tok = chat_tokenizer(name, family);
        let mine: Vec<_> = cases.iter().filter(|c| c["template"] == **name).collect();
        assert!(mine.len() >= 5, "{name}: {} cases", mine.len());
        for case in mine {
            let (what, encoded) = encode_case(&tok, name, case);
            assert_eq!(encoded.ids, numbers::<u32>(&case["ids"]), "{what}: ids");
            assert_eq!(
                encoded.labels,
                numbers::<i32>(&case["labels"]),
                "{what}: labels"
            );
        }
    }
}

/// Replies found by the template's markers alone (as in conversations of more than
/// `MAX_RENDERED_REPLIES` replies) get the same labels as by prefix renders, for every family
/// whose template writes an end of turn (LLaVA-1.5's writes none, so its replies are always
/// found by rendering).
#[test]
fn replies_found_by_markers_get_the_same_labels() {
    let goldens = goldens();
    for name in ["qwen3", "qwen2_5_vl", "llama3_1"] {
        let tok = chat_tokenizer(name, &goldens["families"][name]).find_replies_by_markers();
        for case in goldens["cases"].as_array().unwrap() {
            if case["template"] != name {
                continue;
            }
            let (what, encoded) = encode_case(&tok, name, case);
            assert_eq!(encoded.labels, numbers::<i32>(&case["labels"]), "{what}");
        }
    }
}

#[test]
fn the_built_in_template_is_qwen3s_own() {
    // The shared copy of Qwen3's tokenizer_config.json, where the project has it beside it.
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/tokenizers/qwen3/tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&config) else {
        eprintln!("skipped: {} is not here", config.display());
        return;
    };
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        json["chat_template"].as_str().unwrap(),
        feedstore_producer::template::QWEN3
    );
}

#[test]
fn the_template_beside_the_tokenizer_is_used() {
    let dir = std::env::temp_dir().join(format!("feedstore-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let goldens = goldens();
    let family = &goldens["families"]["llama3_1"];
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json_for(family)).unwrap();
    let source = std::fs::read_to_string(format!("{DATA}/chat/llama3_1.jinja")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": source, "bos_token": {"content": "<|begin_of_text|>"},
            "eos_token": "<|eot_id|>"})
        .to_string(),
    )
    .unwrap();
    let case = goldens["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["template"] == "llama3_1" && c["name"] == "tool call and result")
        .unwrap();
    let (messages, tools) = read_record(case);
    let tok = ChatTokenizer::from_file(&dir.join("tokenizer.json"), 1 << 20).unwrap();
    assert!(tok.template().origin().ends_with("tokenizer_config.json"));
    let encoded = tok
        .encode_with_tools(&messages, tools.as_ref(), &[])
        .unwrap();
    assert_eq!(encoded.ids, numbers::<u32>(&case["ids"]));

    // A chat_template.jinja beside it comes first, and --chat-template before that.
    std::fs::write(
        dir.join("chat_template.jinja"),
        std::fs::read(format!("{DATA}/chat/qwen2_5_vl.jinja")).unwrap(),
    )
    .unwrap();
    let tok = ChatTokenizer::from_file(&dir.join("tokenizer.json"), 1 << 20).unwrap();
    assert!(tok.template().origin().ends_with("chat_template.jinja"));
    let tok =
        ChatTokenizer::load(&dir.join("tokenizer.json"), Some(Path::new("qwen3")), 100).unwrap();
    assert!(tok.template().origin().contains("built in"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_template_error_rejects_the_record_with_the_templates_words() {
    let tok = ChatTokenizer::with_template(
        &tokenizer_json(),
        ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}\
             {% endif %}{{ m.content }}{% endfor %}",
            SpecialTokens::default(),
            "test template",
        )
        .unwrap(),
        1000,
    )
    .unwrap();
    let conv = [
        Message::new(Role::User, "q"),
        Message::new(Role::Tool, "r"),
        Message::new(Role::Assistant, "a"),
    ];
    let e = tok.encode(&conv, &[]).unwrap_err().to_string();
    assert!(
        e.contains("no tools here") && e.contains("test template"),
        "{e}"
    );
    assert!(matches!(
        ChatTemplate::new("{% if %}", SpecialTokens::default(), "broken"),
        Err(TemplateError::Template(_))
    ));
}

/// A record chooses its tools and turns: one written to make a template write gigabytes (tools
/// nested 120 deep, which Llama 3.1's template writes with `tojson(indent=4)`) is rejected for
/// its size, mid-render; one with more turns than taken is rejected when the manifest is read.
#[test]
fn a_hostile_record_is_rejected_before_it_costs_much() {
    let goldens = goldens();
    let family = &goldens["families"]["llama3_1"];
    let template = ChatTemplate::from_file(
        Path::new(&format!("{DATA}/chat/llama3_1.jinja")),
        SpecialTokens::default(),
    )
    .unwrap();
    let tok = ChatTokenizer::with_template(&tokenizer_json_for(family), template, 8192).unwrap();
    // 64 lists nested 120 deep: 16 KB of JSON that Python writes as 3.6 MB with indent=4.
    let deep = (0..120).fold(serde_json::json!(0), |v, _| serde_json::json!([v]));
    let wide: Vec<serde_json::Value> = (0..64).map(|_| deep.clone()).collect();
    let conv = [
        Message::new(Role::User, "q"),
        Message::new(Role::Assistant, "a"),
    ];
    let e = tok
        .encode_with_tools(&conv, Some(&serde_json::Value::from(wide)), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than 2097152 bytes"), "{e}");

    let turns: Vec<serde_json::Value> = (0..1025)
        .map(
            |i| serde_json::json!({"from": if i % 2 == 0 { "human" } else { "gpt" }, "value": "x"}),
        )
        .collect();
    let line = serde_json::json!({"id": "many", "conversations": turns}).to_string();
    let reject = Manifest::new(line.as_bytes(), "/data".into())
        .next()
        .unwrap()
        .unwrap_err();
    assert!(reject.reason.contains("1025 turns"), "{}", reject.reason);
}

#[test]
fn over_long_conversations_are_rejected() {
    let tok = tokenizer(100);
    let conv = [
        Message::new(Role::User, "<image>\nhi"),
        Message::new(Role::Assistant, "hello"),
    ];
    assert!(matches!(
        tok.encode(&conv, &[1000]),
        Err(ChatError::TooLong { .. })
    ));
    assert!(matches!(
        tok.encode(&conv, &[90]),
        Err(ChatError::TooLong { max: 100, .. })
    ));
    assert!(tok.encode(&conv, &[4]).is_ok());
}
