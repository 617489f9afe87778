"""Regenerates goldens.json: what Hugging Face transformers makes of LLaVA-style records under four
chat templates, token ids and loss labels, for feedstore's `chat` module to match.

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install transformers==5.24.0 jinja2
    /tmp/tf/bin/python producer/tests/data/chat/make_chat_goldens.py > producer/tests/data/chat/goldens.json

The templates: Qwen3's (shipped in `producer/templates/qwen3.jinja`, from the Qwen3
tokenizer_config.json) and, as fixtures in this folder, Qwen2.5-VL's multimodal template, LLaVA-1.5's
(llava-hf) and Llama 3.1's. Every family is run with the Qwen3 tokenizer (the others' tokenizers
cannot be downloaded here; with `<image>` added as a special token for LLaVA): what is compared is the
rendering, the image expansion and the labels, not a vocabulary.

- ids: the text rendered by `tokenizer.apply_chat_template` (jinja2, as transformers runs it), each
  image expanded as the model's processor does (Qwen-VL: one `<|image_pad|>` per merged patch;
  LLaVA: `<image>` repeated), tokenized without added special tokens. For every case the script
  checks that `apply_chat_template(..., tokenize=True)` gives the ids of the unexpanded text.
- labels: -100 except for the tokens inside an assistant turn, found with each family's own turn
  markers written out below (independent of how feedstore finds them): from after the assistant
  header to the end-of-turn token included (trailing whitespace excluded).
"""
import copy
import gzip
import json
import pathlib
import re
import sys
import tempfile

import transformers
from transformers import PreTrainedTokenizerFast

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE.parent
TEMPLATES = {
    "qwen3": (DATA.parent.parent / "templates/qwen3.jinja").read_text(),
    "qwen2_5_vl": (HERE / "qwen2_5_vl.jinja").read_text(),
    "llava_1_5": (HERE / "llava_1_5.jinja").read_text(),
    "llama3_1": (HERE / "llama3_1.jinja").read_text(),
}
# Per family: content as a string with <image> kept (and expanded afterwards) or as a list of parts,
# the special tokens the template sees, extra special tokens, and the assistant turn's markers.
FAMILIES = {
    "qwen3": dict(parts=False, bos=None, eos="<|im_end|>", extra=[],
                  turn=r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)"),
    "qwen2_5_vl": dict(parts=True, bos=None, eos="<|im_end|>", extra=[],
                       turn=r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)"),
    "llava_1_5": dict(parts=True, bos="<s>", eos="</s>", extra=["<image>"],
                      turn=r"ASSISTANT:(.*?)\s*(?=USER: |$)"),
    "llama3_1": dict(parts=False, bos="<|begin_of_text|>", eos="<|eot_id|>", extra=[],
                     turn=r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)"),
}

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]

# (name, record, image token counts, families it runs under)
ALL = list(FAMILIES)
VISION = ["qwen3", "qwen2_5_vl", "llava_1_5"]
CASES = [
    ("easy-vqa", {"conversations": [{"from": "human", "value": "<image>\nwhat is the blue shape?"},
                                    {"from": "gpt", "value": "rectangle"}]}, [4], VISION),
    ("image after text", {"conversations": [{"from": "human", "value": "Describe this picture:\n<image>"},
                                            {"from": "gpt", "value": "A red circle on white."}]}, [64], VISION),
    ("two images", {"conversations": [{"from": "human", "value": "<image>\n<image>\nWhich image is brighter?"},
                                      {"from": "gpt", "value": "The second one."}]}, [16, 196], VISION),
    ("multi-turn with an image", {"conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A motorcycle."},
        {"from": "human", "value": "What colour is it?"}, {"from": "gpt", "value": "Mostly red, with black tyres."}]},
     [9], VISION),
    ("images in two turns", {"conversations": [
        {"from": "system", "value": "Compare carefully."},
        {"from": "human", "value": "<image>\nRemember this one."}, {"from": "gpt", "value": "Noted."},
        {"from": "human", "value": "And this one: <image> Same animal?"}, {"from": "gpt", "value": "No: a cat, then a dog."}]},
     [12, 20], VISION),
    ("system prompt", {"conversations": [{"from": "system", "value": "You are a careful visual assistant."},
                                         {"from": "human", "value": "<image>\nCount the shapes."},
                                         {"from": "gpt", "value": "There are 3 shapes."}]}, [36], VISION),
    ("reasoning in reply", {"conversations": [
        {"from": "human", "value": "<image>\nIs it night?"},
        {"from": "gpt", "value": "<think>\nThe sky is dark and stars are visible.\n</think>\n\nYes, it is night."}]},
     [4], VISION),
    ("unicode and spacing", {"conversations": [{"from": "human", "value": "<image>\n  ¿Qué   hay aquí?  \t\n"},
                                               {"from": "gpt", "value": "  Un gato 🐱 sobre la mesa.  "}]}, [4], VISION),
    ("text only", {"conversations": [{"from": "human", "value": "Translate 'hello' into French."},
                                     {"from": "gpt", "value": "Bonjour."}]}, [], ALL),
    ("multi-turn text with a system prompt", {"conversations": [
        {"from": "system", "value": "Answer in one word."},
        {"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."},
        {"from": "human", "value": "And of Italy?"}, {"from": "gpt", "value": "Rome."}]}, [], ALL),
    ("two replies in a row", {"conversations": [
        {"from": "human", "value": "Say two things."}, {"from": "gpt", "value": "One."},
        {"from": "gpt", "value": "Two."}]}, [], ["qwen3", "qwen2_5_vl", "llama3_1"]),
    ("reply first", {"conversations": [
        {"from": "gpt", "value": "Hello, I am the bot."}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "Hi! What can I do?"}]}, [], ["qwen3", "qwen2_5_vl", "llama3_1"]),
    ("tool call and result", {"tools": WEATHER, "conversations": [
        {"from": "system", "value": "You help with travel."},
        {"from": "human", "value": "What's the weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})},
        {"from": "observation", "value": json.dumps({"temperature": 18, "sky": "cloudy"})},
        {"from": "gpt", "value": "It is 18 °C and cloudy in Paris."}]}, [], ["qwen3", "llama3_1"]),
    ("tool calls on a reply", {"tools": WEATHER, "conversations": [
        {"from": "human", "value": "Weather in Oslo, please."},
        {"from": "gpt", "value": "Let me look.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"from": "tool", "value": "{\"temperature\": -3, \"sky\": \"snow\"}"},
        {"from": "gpt", "value": "-3 °C with snow."}]}, [], ["qwen3", "llama3_1"]),
]

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system", "tool": "tool", "observation": "tool"}


def messages(record, parts):
    """A record's turns as transformers' messages (what feedstore's manifest reader builds)."""
    out = []
    for turn in record["conversations"]:
        if turn["from"] == "function_call":
            call = turn["value"] if isinstance(turn["value"], dict) else json.loads(turn["value"])
            role, value, calls = "assistant", "", [{"type": "function", "function": call}]
        else:
            role, value, calls = ROLES[turn["from"]], turn["value"], turn.get("tool_calls")
        if parts:
            content = []
            for i, text in enumerate(value.split("<image>")):
                if i:
                    content.append({"type": "image"})
                if text:
                    content.append({"type": "text", "text": text})
        else:
            content = value
        message = {"role": role, "content": content}
        if calls is not None:
            message["tool_calls"] = calls
        out.append(message)
    return out


def expand(text, family, image_tokens):
    """Each image as the model's processor expands it."""
    if FAMILIES[family]["parts"]:
        marker = "<image>" if family == "llava_1_5" else "<|image_pad|>"
        pad, open_, close = marker, "", ""
    else:
        marker, pad, open_, close = "<image>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
    pieces = text.split(marker)
    assert len(pieces) == len(image_tokens) + 1, (family, text)
    out = [pieces[0]]
    for n, piece in zip(image_tokens, pieces[1:]):
        out += [open_, pad * n, close, piece]
    return "".join(out)


def ids_of(encoded):
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


base = json.loads(gzip.decompress((DATA / "qwen3-tokenizer.json.gz").read_bytes()))
tokenizers = {}
for family, spec in FAMILIES.items():
    tokenizer_json = copy.deepcopy(base)
    for token in spec["extra"]:  # added the way feedstore's tests add it
        next_id = max(t["id"] for t in tokenizer_json["added_tokens"]) + 1
        tokenizer_json["added_tokens"].append({"id": next_id, "content": token, "single_word": False,
                                               "lstrip": False, "rstrip": False, "normalized": False,
                                               "special": True})
    path = pathlib.Path(tempfile.mkdtemp()) / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json))
    tokenizers[family] = PreTrainedTokenizerFast(tokenizer_file=str(path))

out = []
for name, record, image_tokens, families in CASES:
    for family in families:
        spec, tok = FAMILIES[family], tokenizers[family]
        msgs = messages(record, spec["parts"])
        kwargs = dict(chat_template=TEMPLATES[family], tools=record.get("tools"), bos_token=spec["bos"],
                      eos_token=spec["eos"])
        text = tok.apply_chat_template(msgs, tokenize=False, **kwargs)
        direct = ids_of(tok.apply_chat_template(msgs, tokenize=True, **kwargs))
        assert direct == tok(text, add_special_tokens=False)["input_ids"], (family, name)
        text = expand(text, family, image_tokens)
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [m.span(1) for m in re.finditer(spec["turn"], text, re.S)]
        replies = sum(1 for t in record["conversations"] if ROLES.get(t["from"], "assistant") == "assistant")
        assert len(spans) == replies, (family, name, spans, text)
        labels = [i if any(s <= a and b <= e for s, e in spans) else -100
                  for i, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])]
        out.append({"template": family, "name": name, "record": record, "image_tokens": image_tokens,
                    "text": text, "ids": encoded["input_ids"], "labels": labels})

json.dump({"transformers": transformers.__version__, "families": {
    f: {k: v for k, v in s.items() if k in ("parts", "bos", "eos", "extra")} for f, s in FAMILIES.items()},
    "cases": out}, sys.stdout, ensure_ascii=False, indent=1)
sys.stdout.write("\n")
