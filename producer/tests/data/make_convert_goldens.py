"""Regenerates convert/: inputs of the kinds Pillow converts specially (EXIF orientation, 16-bit
grey and colour, palette, grey with alpha, CMYK, an animated GIF; a greyscale and a progressive
JPEG), derived from the test photos,
and what Pillow makes of each: `ImageOps.exif_transpose(Image.open(f)).convert("RGB")`, the
preprocessing a vision-language pipeline applies. The producer's decode must match these.

    python3 producer/tests/data/make_convert_goldens.py producer/tests/data

(Made with Debian's python3-pil 9.4; `goldens.json` records the version.)
"""
import json
import os
import struct
import sys
import zlib

import numpy as np
from PIL import Image, ImageOps

root = sys.argv[1]
out = f"{root}/convert"
os.makedirs(out, exist_ok=True)

hopper = Image.open(f"{root}/photos/grace_hopper.jpg").convert("RGB").crop((180, 120, 276, 184))
chelsea = Image.open(f"{root}/photos/chelsea.png").convert("RGB").crop((150, 60, 246, 124))


def exif(orientation):
    e = Image.Exif()
    e[0x0112] = orientation
    return e


def png16(path, pixels, colour_type, trns=None):
    """A 16-bit PNG written by hand (Pillow writes 16-bit grey only): big-endian samples,
    filter 0 on every row, and a tRNS chunk when given."""
    h, w = pixels.shape[:2]
    raw = b"".join(b"\0" + pixels[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)))
        if trns is not None:
            f.write(chunk(b"tRNS", struct.pack(">H", trns)))
        f.write(chunk(b"IDAT", zlib.compress(raw)))
        f.write(chunk(b"IEND", b""))


cases = []

hopper.save(f"{out}/exif6.jpg", quality=92, exif=exif(6))
cases.append(("exif6.jpg", "a JPEG whose EXIF orientation is 6 (rotate 90 clockwise)"))
chelsea.save(f"{out}/exif8.png", exif=exif(8))
cases.append(("exif8.png", "a PNG whose eXIf orientation is 8 (rotate 90 counter-clockwise)"))
chelsea.transpose(Image.FLIP_LEFT_RIGHT).save(f"{out}/exif2.png", exif=exif(2))
cases.append(("exif2.png", "a PNG whose eXIf orientation is 2 (mirrored)"))

# 16-bit grey with values above 255 (as 10- to 16-bit sensors and medical images have): Pillow
# opens it as 32-bit integers and clips to 255 when converting.
grey = np.asarray(chelsea.convert("L")).astype(np.uint16) * 3
Image.fromarray(grey).save(f"{out}/grey16.png")
cases.append(("grey16.png", "16-bit grey, values 0-765"))
png16(f"{out}/grey16trns.png", grey, 0, trns=int(grey[0, 0]))
cases.append(("grey16trns.png", "16-bit grey with a tRNS transparent value (still clipped)"))
# 16-bit colour and grey with alpha: Pillow reads the high byte of each sample.
wide = np.asarray(chelsea).astype(np.uint16) * 257 + np.arange(96, dtype=np.uint16)[None, :, None]
png16(f"{out}/rgb16.png", wide, 2)
cases.append(("rgb16.png", "16-bit RGB"))
la = np.stack([grey * 80, np.full_like(grey, 40000)], axis=-1)
png16(f"{out}/la16.png", la, 4)
cases.append(("la16.png", "16-bit grey with alpha"))

chelsea.convert("P", palette=Image.ADAPTIVE, colors=32).save(f"{out}/palette.png")
cases.append(("palette.png", "a 32-colour palette PNG"))
alpha = Image.linear_gradient("L").resize(chelsea.size)
la8 = chelsea.convert("L")
la8.putalpha(alpha)
la8.save(f"{out}/la8.png")
cases.append(("la8.png", "8-bit grey with an alpha gradient (alpha dropped, not composited)"))
chelsea.convert("CMYK").save(f"{out}/cmyk.jpg", quality=95)
cases.append(("cmyk.jpg", "a CMYK JPEG"))
chelsea.convert("L").save(f"{out}/grey.jpg", quality=90)
cases.append(("grey.jpg", "a greyscale JPEG"))
Image.open(f"{root}/photos/grace_hopper.jpg").save(f"{out}/progressive.jpg", quality=85, progressive=True)
cases.append(("progressive.jpg", "a progressive JPEG (several scans)"))

frames = [chelsea, hopper, chelsea.transpose(Image.FLIP_TOP_BOTTOM)]
frames[0].save(f"{out}/animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
cases.append(("animated.gif", "an animated GIF of three frames (the first one is used)"))

goldens = []
for name, what in cases:
    im = ImageOps.exif_transpose(Image.open(f"{out}/{name}")).convert("RGB")
    golden = name.rsplit(".", 1)[0] + ".rgb.png"
    im.info = {}  # the pixels only (a carried-over tRNS value cannot be saved with RGB)
    im.save(f"{out}/{golden}")
    goldens.append({"input": f"convert/{name}", "what": what, "golden": f"convert/{golden}",
                    "width": im.size[0], "height": im.size[1]})

json.dump({"pillow": Image.__version__, "cases": goldens}, open(f"{out}/goldens.json", "w"),
          indent=1)
