"""Tests for speceyes.images: loading, smart_resize parity, box mapping and zoom crops."""

from __future__ import annotations

import io
import math
import random
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFile

from speceyes import limits
from speceyes.images import (
    BoxError,
    ImageError,
    ImageHeader,
    View,
    box_to_original,
    checked_crop_box,
    clamp_box,
    crop,
    image_from_data_uri,
    load_image,
    parse_box,
    read_header,
    resize_for_model,
    smart_resize,
    to_data_uri,
    zoom_crop,
)

DEEPEYES = dict(factor=28, min_pixels=4 * 28 * 28, max_pixels=16384 * 28 * 28)


def _gradient(w: int = 64, h: int = 48) -> Image.Image:
    x = np.linspace(0, 255, w, dtype=np.uint8)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h, dtype=np.uint8)[:, None].repeat(w, 1)
    return Image.fromarray(np.stack([x, y, 255 - x], axis=-1), "RGB")


def _jpeg_bytes(w: int = 200, h: int = 150) -> bytes:
    buf = io.BytesIO()
    _gradient(w, h).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# smart_resize


def test_module_imports_without_torch_or_transformers() -> None:
    import subprocess

    code = (
        "import sys, speceyes.images; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("factor", [28, 32])
def test_smart_resize_matches_transformers(factor: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    rng = random.Random(1234 + factor)
    settings = [
        dict(min_pixels=4 * 28 * 28, max_pixels=16384 * 28 * 28),  # DeepEyes
        dict(min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 1280),  # transformers default
        dict(min_pixels=256 * 28 * 28, max_pixels=1280 * 28 * 28),  # common Qwen2.5-VL config
        dict(min_pixels=64 * 32 * 32, max_pixels=4096 * 32 * 32),
    ]
    sizes = [(factor, factor), (1000, 600), (600, 1000), (4000, 3000), (28 * 200, 28)]
    for _ in range(2000):
        kind = rng.random()
        if kind < 0.4:
            sizes.append((rng.randint(factor, 800), rng.randint(factor, 800)))
        elif kind < 0.8:
            sizes.append((rng.randint(factor, 6000), rng.randint(factor, 6000)))
        else:
            h = rng.randint(factor, 400)
            sizes.append((h, min(h * rng.randint(1, 200), 20000)))
    checked = 0
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for s in settings:
            assert smart_resize(h, w, factor=factor, **s) == ref(h, w, factor=factor, **s), (h, w)
            checked += 1
    assert checked > 5000


def test_smart_resize_properties() -> None:
    for h, w in [(1, 1), (10, 1000), (27, 27), (600, 1000), (8000, 8000), (3, 500)]:
        rh, rw = smart_resize(h, w, **DEEPEYES)
        assert rh % 28 == 0 and rw % 28 == 0
        assert rh >= 28 and rw >= 28
        assert 4 * 28 * 28 <= rh * rw <= 16384 * 28 * 28
    assert smart_resize(600, 1000, **DEEPEYES) == (588, 1008)


def test_smart_resize_tiny_side_keeps_factor() -> None:
    # qwen-vl-utils keeps a side at >= factor where transformers' copy rounds it to 0 first.
    assert smart_resize(10, 1000, **DEEPEYES) == (28, 1008)


def test_smart_resize_aspect_ratio_error() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(3000, 14)
    assert smart_resize(28, 28 * 200)  # exactly 200 is allowed
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 100)


def test_resize_for_model_view_and_identity() -> None:
    img = _gradient(1000, 600)
    out, view = resize_for_model(img)
    assert out.size == (1008, 588)
    assert view == View(1000, 600, 1008, 588)
    assert math.isclose(view.scale_x, 1000 / 1008) and math.isclose(view.scale_y, 600 / 588)
    same, view2 = resize_for_model(out)
    assert same is out
    assert view2.scale_x == 1.0 and view2.scale_y == 1.0
    out32, _ = resize_for_model(img, factor=32, min_pixels=32 * 32, max_pixels=256 * 32 * 32)
    assert out32.width % 32 == 0 and out32.height % 32 == 0
    assert out32.width * out32.height <= 256 * 32 * 32


# ---------------------------------------------------------------------------------------------
# load_image


def test_load_png_and_jpeg_from_path(tmp_path) -> None:
    src = _gradient(64, 48)
    png = tmp_path / "a.png"
    src.save(png)
    out = load_image(png)
    assert out.mode == "RGB" and out.size == (64, 48)
    assert np.array_equal(np.asarray(out), np.asarray(src))
    assert load_image(str(png)).size == (64, 48)
    assert load_image("file://" + str(png)).size == (64, 48)
    jpg = tmp_path / "a.jpg"
    jpg.write_bytes(_jpeg_bytes(200, 150))
    out = load_image(jpg)
    assert out.mode == "RGB" and out.size == (200, 150)


def test_load_bytes_and_data_uri() -> None:
    data = _jpeg_bytes(80, 60)
    assert load_image(data).size == (80, 60)
    assert load_image(bytearray(data)).size == (80, 60)
    src = _gradient(30, 20)
    uri = to_data_uri(src)
    assert uri.startswith("data:image/png;base64,")
    back = image_from_data_uri(uri)
    assert np.array_equal(np.asarray(back), np.asarray(src))
    assert load_image(uri).size == (30, 20)
    # line breaks inside the payload are tolerated
    head, payload = uri.split(",", 1)
    wrapped = head + "," + "\n".join(payload[i : i + 60] for i in range(0, len(payload), 60))
    assert load_image(wrapped).size == (30, 20)
    jpeg_uri = to_data_uri(src.convert("RGBA"), fmt="jpeg")
    assert jpeg_uri.startswith("data:image/jpeg;base64,")
    assert image_from_data_uri(jpeg_uri).size == (30, 20)


def test_bad_data_uris() -> None:
    with pytest.raises(ImageError, match="base64"):
        load_image("data:image/png;base64,@@@not base64@@@")
    with pytest.raises(ImageError, match="not an image type"):
        load_image("data:text/plain;base64,aGVsbG8=")
    with pytest.raises(ImageError, match="data URI"):
        load_image("data:image/png;base64,aGVsbG8=")  # decodes, but "hello" is no image
    with pytest.raises(ImageError, match="not a data URI"):
        image_from_data_uri("/tmp/x.png")


def test_rgba_palette_gray_cmyk_conversion(tmp_path) -> None:
    rgba = Image.new("RGBA", (10, 10), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent -> white, like qwen-vl-utils
    p = tmp_path / "rgba.png"
    rgba.save(p)
    out = load_image(p)
    assert out.mode == "RGB"
    assert out.getpixel((5, 5)) == (255, 0, 0)
    assert out.getpixel((0, 0)) == (255, 255, 255)

    pal = _gradient(16, 16).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    p = tmp_path / "pal.gif"
    pal.save(p)
    out = load_image(p)
    assert out.mode == "RGB" and out.size == (16, 16)

    assert load_image(Image.new("L", (5, 4), 77)).getpixel((1, 1)) == (77, 77, 77)
    cmyk = load_image(Image.new("CMYK", (5, 4), (0, 0, 0, 0)))
    assert cmyk.mode == "RGB" and cmyk.getpixel((0, 0)) == (255, 255, 255)
    i16 = Image.fromarray(np.full((4, 5), 65535, dtype=np.uint16))
    assert load_image(i16).getpixel((0, 0)) == (255, 255, 255)


def test_pil_input_returns_new_image() -> None:
    src = _gradient(20, 10)
    out = load_image(src)
    assert out is not src and out.size == (20, 10)


def test_exif_orientation_applied(tmp_path) -> None:
    img = _gradient(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    p = tmp_path / "rot.jpg"
    img.save(p, exif=exif.tobytes())
    assert load_image(p).size == (20, 40)


def test_corrupt_file(tmp_path) -> None:
    p = tmp_path / "noise.jpg"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ImageError, match="noise.jpg"):
        load_image(p)


def test_truncated_jpeg(tmp_path) -> None:
    data = _jpeg_bytes(400, 300)
    p = tmp_path / "half.jpg"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match="half.jpg") as ei:
        load_image(p)
    assert "truncated" in str(ei.value)
    with pytest.raises(ImageError, match="bytes"):
        load_image(data[: len(data) // 2])


def test_missing_dir_empty(tmp_path) -> None:
    missing = tmp_path / "nope.png"
    with pytest.raises(ImageError, match="not found") as ei:
        load_image(missing)
    assert str(missing) in str(ei.value)
    with pytest.raises(ImageError, match="directory") as ei:
        load_image(tmp_path)
    assert str(tmp_path) in str(ei.value)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageError, match="empty") as ei:
        load_image(empty)
    assert str(empty) in str(ei.value)
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")


def test_zero_size_and_unsupported_sources() -> None:
    with pytest.raises(ImageError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(ImageError, match="unsupported"):
        load_image(123)  # type: ignore[arg-type]
    with pytest.raises(ImageError, match="URL"):
        load_image("https://example.com/a.png")
    assert issubclass(ImageError, ValueError)


def test_decompression_bomb_is_image_error(monkeypatch, tmp_path) -> None:
    p = tmp_path / "big.png"
    Image.new("RGB", (30, 30)).save(p)  # 900 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # warning range (500..1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning may leak
        with pytest.raises(ImageError, match="decompression bomb"):
            load_image(p)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # error range (> 2x)
    with pytest.raises(ImageError, match="big.png"):
        load_image(p)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    assert load_image(p).size == (30, 30)


# ---------------------------------------------------------------------------------------------
# limits read from the header, before decoding


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header says width x height RGB, with (almost) no pixel data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * (1 + 3 * width))  # one row
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def count_decodes(monkeypatch) -> list[int]:
    """A list that gets an item per pixel decode (ImageFile.load) from now on."""
    calls: list[int] = []
    real = ImageFile.ImageFile.load

    def counting(self):
        if self.tile:  # pixels still to decode (later calls of a loaded image return at once)
            calls.append(1)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    return calls


@pytest.fixture()
def decodes(monkeypatch) -> list[int]:
    return count_decodes(monkeypatch)


def test_pixel_limit_is_checked_from_the_header_before_decoding(tmp_path, decodes) -> None:
    bomb = tmp_path / "bomb.png"  # 9400x9400: 257 KB as a real PNG, 1 GB to decode
    bomb.write_bytes(_png_header_only(9400, 9400))
    with pytest.raises(ImageError, match="too large to decode") as ei:
        load_image(bomb, max_pixels=limits.MAX_IMAGE_PIXELS)
    assert "bomb.png" in str(ei.value) and "88360000 pixels" in str(ei.value)
    with pytest.raises(ImageError, match="too large to decode"):
        load_image(bomb.read_bytes(), max_pixels=limits.MAX_IMAGE_PIXELS)
    assert decodes == []  # refused on the header alone
    assert read_header(bomb) == ImageHeader(9400, 9400, "RGB")
    assert decodes == []
    # Within the limit: decoded as before.
    Image.new("RGB", (300, 200), (1, 2, 3)).save(tmp_path / "ok.png")
    assert load_image(tmp_path / "ok.png", max_pixels=60_000).getpixel((0, 0)) == (1, 2, 3)
    with pytest.raises(ImageError, match="60000 pixels; at most 59999"):
        load_image(tmp_path / "ok.png", max_pixels=59_999)


def test_pixel_limit_charges_modes_by_what_their_decode_holds(tmp_path) -> None:
    """Modes whose decode holds more memory than RGB's are charged more pixels; none less."""
    rgb = ImageHeader(100, 100, "RGB")
    assert rgb.cost == rgb.pixels == 10_000
    for mode in ("1", "L", "P", "I;16", "CMYK"):
        assert ImageHeader(100, 100, mode).cost == 10_000, mode
    heavier = {m: ImageHeader(100, 100, m, has_alpha="A" in m) for m in ("I", "F", "RGBA", "LA")}
    for mode, header in heavier.items():
        assert header.cost > 10_000, mode
        assert header.cost * rgb.decode_bytes >= header.decode_bytes * rgb.pixels, mode
    Image.new("RGBA", (100, 100)).save(tmp_path / "rgba.png")
    Image.new("RGB", (100, 100)).save(tmp_path / "rgb.png")
    assert read_header(tmp_path / "rgba.png").cost == heavier["RGBA"].cost
    assert load_image(tmp_path / "rgb.png", max_pixels=10_000).size == (100, 100)
    with pytest.raises(ImageError, match="counted as .* for its RGBA mode"):
        load_image(tmp_path / "rgba.png", max_pixels=10_000)


def test_extreme_aspect_ratio_is_an_image_error(tmp_path, decodes) -> None:
    """A 1x30000 image can be shown to no model: a clear ImageError when loaded."""
    Image.new("L", (1, 30000)).save(tmp_path / "thin.png")
    with pytest.raises(ImageError, match="thin.png: image is 1x30000, an aspect ratio of 30000"):
        load_image(tmp_path / "thin.png")
    assert decodes == []
    with pytest.raises(ImageError, match="aspect ratio"):
        load_image(Image.new("RGB", (2010, 10)), copy=False)
    assert load_image(tmp_path / "thin.png", max_ratio=None).size == (1, 30000)
    assert load_image(Image.new("RGB", (28 * 200, 28))).size == (5600, 28)  # 200 is allowed


def _old_high_bit_to_rgb(img: Image.Image) -> Image.Image:
    """The whole-array float64 conversion the strips must reproduce pixel for pixel."""
    arr = np.asarray(img, dtype=np.float64)
    hi = float(arr.max()) if arr.size else 0.0
    arr = arr / hi * 255.0 if hi > 255.0 else arr
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "L").convert("RGB")


def test_high_bit_depth_conversion_in_strips_matches_whole_array(monkeypatch) -> None:
    import speceyes.images as images

    monkeypatch.setattr(images, "_STRIP_PIXELS", 37 * 3)  # several strips, a short last one
    rng = np.random.default_rng(3)
    f32 = (rng.standard_normal((41, 37)) * 300).astype(np.float32)
    f32[5, 5], f32[6, 6] = np.inf, -1e38
    nan = f32.copy()
    nan[7, 7] = np.nan
    cases = [
        Image.fromarray(rng.integers(0, 65536, (41, 37), dtype=np.uint16)),
        Image.fromarray(rng.integers(0, 200, (41, 37), dtype=np.uint16)),  # max <= 255
        Image.fromarray(rng.integers(-5, 1 << 20, (41, 37), dtype=np.int32)),
        Image.fromarray(f32),
        Image.fromarray(nan),
    ]
    with np.errstate(invalid="ignore"):  # inf / inf and NaN casts, as before
        for img in cases:
            want = np.asarray(_old_high_bit_to_rgb(img))
            assert np.array_equal(np.asarray(load_image(img)), want), img.mode


MEASURE = """
import resource, sys
from speceyes.images import load_image
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
load_image(data)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def _peak_decode_bytes(path: Path) -> int:
    """Peak memory a fresh process adds while load_image decodes ``path``."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, cwd=root,
        check=True,
    )  # fmt: skip
    return int(out.stdout)


@pytest.mark.slow
def test_decode_memory_stays_within_what_the_limits_charge(tmp_path) -> None:
    """The pixel limits charge ``cost`` pixels; no mode may decode to much more memory per
    charged pixel than RGB does (16-bit images used to take 1.8x RGB's, through float64)."""
    side = 1500
    rng = np.random.default_rng(0)
    images = {
        "RGB": Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)),
        "I;16": Image.fromarray(rng.integers(0, 65536, (side, side), dtype=np.uint16)),
        "F": Image.fromarray(rng.random((side, side), dtype=np.float32) * 1000),
        "RGBA": Image.fromarray(rng.integers(0, 256, (side, side, 4), dtype=np.uint8)),
        "L": Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8)),
    }
    per_charged_pixel = {}
    for mode, img in images.items():
        path = tmp_path / f"{mode.replace(';', '')}.{'tiff' if mode == 'F' else 'png'}"
        img.save(path)
        header = read_header(path)
        assert header.mode == mode
        peak = _peak_decode_bytes(path)
        assert peak <= 1.1 * header.decode_bytes, (mode, peak, header.decode_bytes)
        per_charged_pixel[mode] = peak / header.cost
    for cost in per_charged_pixel.values():
        assert cost <= 1.15 * per_charged_pixel["RGB"], per_charged_pixel


# ---------------------------------------------------------------------------------------------
# boxes

# 1000x600 original seen at 532x308 (non-uniform scale on purpose)
VIEW = View(1000, 600, 532, 308)


def test_parse_box() -> None:
    assert parse_box([1, 2, 3.5, 4]) == (1.0, 2.0, 3.5, 4.0)
    assert parse_box((np.int64(1), np.float32(2), 3, 4)) == (1.0, 2.0, 3.0, 4.0)
    bad = [
        [1, 2, 3],
        [1, 2, 3, 4, 5],
        ["1", "2", "3", "4"],
        [1, 2, "3", 4],
        [True, 2, 3, 4],
        [1, float("nan"), 3, 4],
        [1, 2, float("inf"), 4],
        None,
        "1,2,3,4",
        {"x1": 1},
        [[1, 2], [3, 4]],
    ]
    for value in bad:
        with pytest.raises(BoxError, match=r"bbox_2d must be a list of 4 numbers"):
            parse_box(value)
    with pytest.raises(BoxError) as ei:
        parse_box(list(range(10_000)))
    assert len(str(ei.value)) < 250  # model-facing messages stay short


def test_box_to_original_non_uniform_scale() -> None:
    x1, y1, x2, y2 = box_to_original([100, 50, 300, 200], VIEW)
    assert math.isclose(x1, 100 * 1000 / 532)
    assert math.isclose(y1, 50 * 600 / 308)
    assert math.isclose(x2, 300 * 1000 / 532)
    assert math.isclose(y2, 200 * 600 / 308)
    # hand computed: 187.97, 97.40, 563.91, 389.61 -> floor / ceil
    assert checked_crop_box([100, 50, 300, 200], VIEW) == (187, 97, 564, 390)
    # round trip: the full view maps to the full original without float creep
    assert checked_crop_box([0, 0, 532, 308], VIEW) == (0, 0, 1000, 600)
    back = [
        v / s
        for v, s in zip(
            box_to_original([100, 50, 300, 200], VIEW),
            (VIEW.scale_x, VIEW.scale_y) * 2,
            strict=True,
        )
    ]
    assert all(math.isclose(a, b) for a, b in zip(back, [100, 50, 300, 200], strict=True))


def test_relative1000_mapping() -> None:
    assert box_to_original([0, 0, 1000, 1000], VIEW, "relative1000") == (0, 0, 1000, 600)
    x1, y1, x2, y2 = box_to_original([250, 500, 750, 1000], VIEW, coords="relative1000")
    assert math.isclose(x1, 250) and math.isclose(y1, 300)
    assert math.isclose(x2, 750) and math.isclose(y2, 600)
    assert checked_crop_box([250, 500, 750, 1000], VIEW, "relative1000") == (250, 300, 750, 600)
    with pytest.raises(ValueError, match="coords"):
        box_to_original([0, 0, 1, 1], VIEW, "normalized")  # type: ignore[arg-type]


def test_clamp_box() -> None:
    assert clamp_box((-5, -1, 50, 70), 40, 60) == (0, 0, 40, 60)
    assert clamp_box((1, 2, 3, 4), 40, 60) == (1, 2, 3, 4)


@pytest.mark.parametrize(
    ("box", "match"),
    [
        ([300, 50, 100, 200], "inverted"),
        ([100, 200, 300, 50], "inverted"),
        ([100, 50, 100, 200], "empty"),
        ([100, 50, 300, 50], "empty"),
        ([1, float("nan"), 3, 4], "4 numbers"),
        (["100", "50", "300", "200"], "4 numbers"),
        ([100, 50, 300], "4 numbers"),
        ([600, 50, 700, 200], r"outside the image; the image is 532x308"),
        ([-100, -100, -10, -10], "outside the image"),
        ([532, 0, 600, 100], "outside the image"),
        ([100, 50, 120, 200], "too small.*at least 28 pixels"),
        ([100, 50, 300, 60], "too small"),
        ([520, 50, 600, 200], "too small"),  # only 12 px left inside the image
    ],
)
def test_bad_boxes(box, match) -> None:
    with pytest.raises(BoxError, match=match):
        checked_crop_box(box, VIEW)


def test_bad_relative_boxes_mention_scale() -> None:
    with pytest.raises(BoxError, match="0 to 1000"):
        checked_crop_box([1100, 0, 1200, 500], VIEW, "relative1000")
    with pytest.raises(BoxError, match="0-1000 scale"):
        checked_crop_box([100, 100, 110, 500], VIEW, "relative1000")


def test_partly_outside_box_is_clamped() -> None:
    # view box [-50, 250, 100, 400] -> clamped [0, 250, 100, 308] in view pixels
    got = checked_crop_box([-50, 250, 100, 400], VIEW)
    assert got == (0, math.floor(250 * 600 / 308), math.ceil(100 * 1000 / 532), 600)
    assert checked_crop_box([-1e9, -1e9, 1e9, 1e9], VIEW) == (0, 0, 1000, 600)


def test_min_size_caps_at_view_size() -> None:
    tiny = View(20, 20, 28, 28)
    assert checked_crop_box([0, 0, 28, 28], tiny, min_size=56) == (0, 0, 20, 20)
    assert checked_crop_box([0, 0, 10, 10], tiny, min_size=0) == (0, 0, 8, 8)


def test_crop_validates() -> None:
    img = _gradient(50, 40)
    assert crop(img, (10, 5, 30, 25)).size == (20, 20)
    with pytest.raises(ValueError):
        crop(img, (10, 5, 60, 25))
    with pytest.raises(ValueError):
        crop(img, (10, 5, 10, 25))


def test_zoom_crop_takes_pixels_from_original() -> None:
    orig = Image.new("RGB", (1000, 600), (255, 255, 255))
    ImageDraw.Draw(orig).rectangle([700, 100, 799, 199], fill=(255, 0, 0))  # 100x100 red
    view_img, view = resize_for_model(orig, **DEEPEYES)
    assert view_img.size == (1008, 588)
    # the model sees the square at original/scale
    vb = [700 / view.scale_x, 100 / view.scale_y, 800 / view.scale_x, 200 / view.scale_y]
    out, crop_view, box = zoom_crop(orig, view, vb, **DEEPEYES)
    assert box == (700, 100, 800, 200)
    assert out.width % 28 == 0 and out.height % 28 == 0
    assert (crop_view.orig_w, crop_view.orig_h) == (100, 100)
    assert (crop_view.view_w, crop_view.view_h) == out.size
    assert out.getpixel((out.width // 2, out.height // 2)) == (255, 0, 0)

    # a box around the square picks its colour at the centre, white near the corners
    vb = [650 / view.scale_x, 50 / view.scale_y, 850 / view.scale_x, 250 / view.scale_y]
    out, _, box = zoom_crop(orig, view, vb)
    assert box == (650, 50, 850, 250)
    assert out.getpixel((out.width // 2, out.height // 2)) == (255, 0, 0)
    assert out.getpixel((2, 2)) == (255, 255, 255)


def test_zoom_crop_qwen3_style() -> None:
    orig = Image.new("RGB", (640, 480), (0, 0, 255))
    ImageDraw.Draw(orig).rectangle([0, 0, 319, 239], fill=(0, 255, 0))
    q3 = dict(factor=32, min_pixels=64 * 32 * 32, max_pixels=4096 * 32 * 32)
    _, view = resize_for_model(orig, **q3)
    out, _, box = zoom_crop(orig, view, [0, 0, 500, 500], coords="relative1000", **q3)
    assert box == (0, 0, 320, 240)
    assert out.width % 32 == 0 and out.height % 32 == 0
    assert out.getpixel((out.width // 2, out.height // 2)) == (0, 255, 0)


def test_zoom_crop_rejects_wrong_image_and_thin_box() -> None:
    orig = Image.new("RGB", (1000, 600))
    _, view = resize_for_model(orig)
    with pytest.raises(ValueError, match="original"):
        zoom_crop(orig.resize((500, 300)), view, [0, 0, 100, 100])
    wide = Image.new("RGB", (12000, 50))
    wview = View(12000, 50, 12000, 50)
    with pytest.raises(BoxError, match="too thin"):
        zoom_crop(wide, wview, [0, 0, 12000, 50], min_size=28)
