"""Regenerates qwen3_goldens.json: token ids produced by Hugging Face's `tokenizers` package for
conversations rendered with the Qwen3 chat template from tokenizer_config.json (by jinja2, as
transformers' apply_chat_template does), with each <image> expanded Qwen-VL style.

    pip install tokenizers==0.23.3 jinja2
    python3 producer/tests/data/make_goldens.py ../shared/data/tokenizers/qwen3 \
        > producer/tests/data/qwen3_goldens.json
"""
import json
import sys

import jinja2
from tokenizers import Tokenizer

src = sys.argv[1]
tok = Tokenizer.from_file(f"{src}/tokenizer.json")
template = json.load(open(f"{src}/tokenizer_config.json"))["chat_template"]
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False)


def raise_exception(msg):
    raise ValueError(msg)


render = env.from_string(template)


def expand(text, image_tokens):
    out, it = [], iter(image_tokens)
    parts = text.split("<image>")
    for i, part in enumerate(parts):
        out.append(part)
        if i + 1 < len(parts):
            out.append("<|vision_start|>" + "<|image_pad|>" * next(it) + "<|vision_end|>")
    return "".join(out)


# (name, LLaVA-style conversation, image token counts)
cases = [
    ("easy-vqa train 0", [("human", "<image>\nwhat is the blue shape?"), ("gpt", "rectangle")], [4]),
    ("easy-vqa train 1", [("human", "<image>\nwhat color is the shape?"), ("gpt", "blue")], [4]),
    ("easy-vqa yes/no", [("human", "<image>\nis there a triangle in the image?"), ("gpt", "no")], [4]),
    ("image after text", [("human", "Describe this picture:\n<image>"), ("gpt", "A red circle on white.")], [64]),
    ("two images", [("human", "<image>\n<image>\nWhich image is brighter?"), ("gpt", "The second one.")], [16, 1024]),
    ("multi-turn", [("human", "<image>\nWhat is it?"), ("gpt", "A motorcycle."),
                    ("human", "What colour is it?"), ("gpt", "Mostly red, with black tyres.")], [9]),
    ("system prompt", [("system", "You are a careful visual assistant."), ("human", "<image>\nCount the shapes."),
                       ("gpt", "There are 3 shapes.")], [36]),
    ("reasoning in reply", [("human", "<image>\nIs it night?"),
                            ("gpt", "<think>\nThe sky is dark and stars are visible.\n</think>\n\nYes, it is night.")], [4]),
    ("text only", [("human", "Translate 'hello' into French."), ("gpt", "Bonjour.")], []),
    ("unicode and spacing", [("human", "<image>\n  ¿Qué   hay aquí?  \t\n"), ("gpt", "  Un gato 🐱 sobre la mesa.  ")], [4]),
]

roles = {"human": "user", "gpt": "assistant", "system": "system"}
out = []
for name, conv, image_tokens in cases:
    messages = [{"role": roles[f], "content": v} for f, v in conv]
    text = render.render(messages=messages, add_generation_prompt=False, raise_exception=raise_exception)
    text = expand(text, image_tokens)
    ids = tok.encode(text, add_special_tokens=False).ids
    out.append({"name": name, "conversation": [{"from": f, "value": v} for f, v in conv],
                "image_tokens": image_tokens, "text": text, "ids": ids})
json.dump({"tokenizers": __import__("tokenizers").__version__, "cases": out}, sys.stdout, ensure_ascii=False, indent=1)
