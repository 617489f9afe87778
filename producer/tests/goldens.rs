//! Token ids equal those of Hugging Face's Python `tokenizers` on the same conversations, rendered
//! with the same Qwen3 chat template (goldens from `tests/data/make_goldens.py`), and labels
//! train on exactly the assistant's replies.

use feedstore_producer::chat::{ChatError, Message, Role};
mod common;

use common::{tokenizer, tokenizer_json};
use feedstore_proto::sample::IGNORE_INDEX;

fn image_tokens(case: &serde_json::Value) -> Vec<usize> {
    case["image_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect()
}

fn goldens() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/qwen3_goldens.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn conversation(case: &serde_json::Value) -> Vec<Message> {
    case["conversation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| Message {
            role: Role::from_llava(t["from"].as_str().unwrap()).unwrap(),
            content: t["value"].as_str().unwrap().to_owned(),
        })
        .collect()
}

#[test]
fn token_ids_match_hugging_face() {
    let tok = tokenizer(1 << 20);
    let goldens = goldens();
    let cases = goldens["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let images = image_tokens(case);
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let encoded = tok.encode(&conversation(case), &images).unwrap();
        assert_eq!(encoded.ids, expected, "case {name:?}");
        assert_eq!(encoded.labels.len(), encoded.ids.len());
    }
}

#[test]
fn labels_train_on_exactly_the_assistant_replies() {
    let tok = tokenizer(1 << 20);
    let goldens = goldens();
    let tk = tokenizers::Tokenizer::from_bytes(tokenizer_json()).unwrap();
    for case in goldens["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let images = image_tokens(case);
        let conv = conversation(case);
        let encoded = tok.encode(&conv, &images).unwrap();
        // The trained tokens, decoded, are the assistant replies each closed by <|im_end|>.
        let trained: Vec<u32> = encoded
            .labels
            .iter()
            .filter(|&&l| l != IGNORE_INDEX)
            .map(|&l| l as u32)
            .collect();
        let text = tk.decode(&trained, false).unwrap();
        let replies = conv.iter().filter(|m| m.role == Role::Assistant).count();
        assert_eq!(
            text.matches("<|im_end|>").count(),
            replies,
            "case {name:?}: {text:?}"
        );
        assert!(
            !text.contains("<|im_start|>") && !text.contains("<|image_pad|>"),
            "case {name:?}: {text:?}"
        );
        let last = conv
            .iter()
            .rev()
            .find(|m| m.role == Role::Assistant)
            .unwrap();
        let last_reply = last
            .content
            .rsplit("</think>")
            .next()
            .unwrap()
            .trim_start_matches('\n');
        assert!(
            text.contains(last_reply),
            "case {name:?}: {text:?} lacks {last_reply:?}"
        );
    }
}

#[test]
fn over_long_conversations_are_rejected() {
    let tok = tokenizer(100);
    let conv = [
        Message {
            role: Role::User,
            content: "<image>\nhi".into(),
        },
        Message {
            role: Role::Assistant,
            content: "hello".into(),
        },
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
