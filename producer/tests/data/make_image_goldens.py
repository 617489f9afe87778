"""Regenerates resized/*.png and resize_goldens.json: Pillow's bicubic resize of the test photos
(what a PyTorch/PIL preprocessing pipeline produces), the same after `Image.draft` for JPEGs (the
DCT-scaled decode), and Qwen-VL's smart_resize target sizes.

    pip install pillow==13.0.0
    python3 producer/tests/data/make_image_goldens.py producer/tests/data
"""
import json
import math
import os
import sys

from PIL import Image

root = sys.argv[1]


def round_by_factor(n, f):
    return round(n / f) * f  # Python's round: half to even, as Qwen's processor uses


def smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 1280):
    """Qwen2-VL's image processor rule: both sides a multiple of `factor`, area within bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("aspect ratio over 200")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


sizes = []
# smart_resize over many shapes (no pixels needed), to pin the rounding rules.
for h in (1, 27, 28, 29, 42, 56, 99, 224, 300, 427, 600, 1000, 1411, 2048, 4000):
    for w in (1, 28, 70, 256, 451, 640, 1024, 3000):
        for lo, hi in ((56 * 56, 14 * 14 * 4 * 1280), (256 * 28 * 28, 512 * 28 * 28), (4 * 28 * 28, 64 * 28 * 28)):
            try:
                th, tw = smart_resize(h, w, 28, lo, hi)
            except ValueError:
                th, tw = None, None
            sizes.append({"height": h, "width": w, "min_pixels": lo, "max_pixels": hi, "out_height": th, "out_width": tw})

resized = []
os.makedirs(f"{root}/resized", exist_ok=True)
for name in ("grace_hopper.jpg", "rocket.jpg", "chelsea.png"):
    im = Image.open(f"{root}/photos/{name}").convert("RGB")
    w, h = im.size
    qh, qw = smart_resize(h, w, 28, 4 * 28 * 28, 256 * 28 * 28)
    targets = [("qwen", (qw, qh)), ("224", (224, 224))]
    if name.endswith(".jpg"):
        # Small enough for DCT scales 4 and 8.
        targets += [("112", (112, 112)), ("56", (56, 56))]
    for tag, (tw, th) in targets:
        out = f"resized/{name.rsplit('.', 1)[0]}-{tag}.png"
        im.resize((tw, th), Image.BICUBIC).save(f"{root}/{out}")
        resized.append({"photo": f"photos/{name}", "width": tw, "height": th, "golden": out})
        if name.endswith(".jpg"):
            # What a careful Pillow user writes: `draft` first, so libjpeg decodes at the largest
            # DCT scale (1/2, 1/4, 1/8) that keeps the image at least the output size.
            drafted = Image.open(f"{root}/photos/{name}")
            drafted.draft("RGB", (tw, th))
            out = f"resized/{name.rsplit('.', 1)[0]}-{tag}-draft.png"
            drafted.convert("RGB").resize((tw, th), Image.BICUBIC).save(f"{root}/{out}")
            scale = w // drafted.width
            resized.append({"photo": f"photos/{name}", "width": tw, "height": th, "golden": out, "draft_scale": scale})

json.dump({"pillow": Image.__version__, "smart_resize": sizes, "resized": resized}, open(f"{root}/resize_goldens.json", "w"), indent=1)
