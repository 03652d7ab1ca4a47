"""All pixel geometry of speceyes: loading, smart_resize, box mapping and crops.

Pure PIL/numpy on purpose: the agents, the sandbox and the tests use this without torch or
transformers, and a single module keeps the "which pixels did the model see" rules in one place.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import numbers
import os
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageOps

__all__ = [
    "BoxError",
    "Coords",
    "ImageError",
    "ImageHeader",
    "View",
    "box_to_original",
    "checked_crop_box",
    "clamp_box",
    "crop",
    "image_from_data_uri",
    "load_image",
    "parse_box",
    "read_header",
    "resize_for_model",
    "smart_resize",
    "to_data_uri",
    "zoom_crop",
]

# DeepEyes (Qwen2.5-VL) defaults; Qwen3-VL uses factor 32.
FACTOR = 28
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200

Box = tuple[float, float, float, float]
IntBox = tuple[int, int, int, int]
# "absolute": pixels of the resized view (Qwen2.5-VL, DeepEyes);
# "relative1000": 0..1000 relative to the view (Qwen3-VL).
Coords = Literal["absolute", "relative1000"]

# Float noise (e.g. 532 * (1000 / 532) = 1000.0000000001) must not grow a crop by a pixel.
_EPS = 1e-6


class ImageError(ValueError):
    """An image source could not be turned into a usable RGB image."""


class BoxError(ValueError):
    """A bounding box from the model is unusable; the message is shown back to the model."""


# ---------------------------------------------------------------------------------------------
# Loading


def _describe(src: object) -> str:
    """A short human name for a source, used in every ImageError."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"image bytes ({len(src)} bytes)"
    if isinstance(src, str) and src.startswith("data:"):
        head = src if len(src) <= 40 else src[:37] + "..."
        return f"data URI {head!r} ({len(src)} chars)"
    if isinstance(src, (str, os.PathLike)):
        return str(src)
    if isinstance(src, Image.Image):
        return f"PIL image ({src.mode}, {src.width}x{src.height})"
    return f"object of type {type(src).__name__}"


def _decode_data_uri(uri: str) -> bytes:
    """Payload of a `data:[<mediatype>][;base64],<data>` URI (RFC 2397)."""
    name = _describe(uri)
    header, sep, payload = uri[len("data:") :].partition(",")
    if not sep:
        raise ImageError(f"{name}: malformed data URI, no ',' after the header")
    params = [p.strip().lower() for p in header.split(";")]
    media = params[0]
    if media and not media.startswith("image/"):
        raise ImageError(f"{name}: data URI media type {media!r} is not an image type")
    if "base64" in params[1:]:
        # Line breaks and blanks are common in hand-made URIs; anything else is corruption.
        compact = "".join(payload.split())
        try:
            return base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{name}: invalid base64 payload ({e})") from e
    return urllib.parse.unquote_to_bytes(payload)


_EXIF_ORIENTATION = 0x0112
_HIGH_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")
# Pixels per row strip of the high-bit-depth conversion: its float64 scratch stays ~8 MB.
_STRIP_PIXELS = 1 << 20


def _has_alpha(img: Image.Image) -> bool:
    return "A" in img.getbands() or (img.mode == "P" and "transparency" in img.info)


def _to_rgb(img: Image.Image, owned: bool = False) -> Image.Image:
    """Upright RGB copy; transparency is composited on white like qwen-vl-utils/transformers.

    ``owned``: ``img`` is ours (opened from encoded data) and is rotated in place rather than
    copied first. ``ImageHeader.decode_bytes`` models what this holds at its peak.
    """
    if owned:
        ImageOps.exif_transpose(img, in_place=True)
    else:
        img = ImageOps.exif_transpose(img)  # a copy, rotated when EXIF says so
    if _has_alpha(img):
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if img.mode in _HIGH_BIT_MODES:
        # PIL's direct RGB conversion clips high-bit-depth data to 255; scale to 8 bits instead.
        return _high_bit_to_gray(img).convert("RGB")
    return img.convert("RGB")  # also a copy when already RGB


def _high_bit_to_gray(img: Image.Image) -> Image.Image:
    """8-bit gray of a 16/32-bit or float image, scaled by its maximum when that is over 255.

    Row strip by row strip: the same float64 arithmetic as on the whole array (identical
    pixels), but the float copies cost ~8 MB, not 8 bytes per pixel several times over.
    """
    w, h = img.size
    rows = max(1, _STRIP_PIXELS // max(w, 1))
    starts = range(0, h, rows)

    def strip(y: int) -> np.ndarray:
        return np.asarray(img.crop((0, y, w, min(y + rows, h))), dtype=np.float64)

    # np.max propagates NaN like the whole array's max (a NaN maximum leaves values as they are)
    hi = float(np.max([strip(y).max() for y in starts])) if w and h else 0.0
    out = np.empty((h, w), dtype=np.uint8)
    for y in starts:
        arr = strip(y)
        arr = arr / hi * 255.0 if hi > 255.0 else arr
        out[y : y + rows] = np.clip(arr, 0, 255).astype(np.uint8)
    return Image.fromarray(out, "L")


def _stored_bytes(mode: str) -> int:
    """Bytes per pixel PIL holds for ``mode`` (bands of 8 bits take 4 bytes, RGB included)."""
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says: size and mode, known before any pixel is decoded."""

    width: int
    height: int
    mode: str
    has_alpha: bool = False

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def decode_bytes(self) -> int:
        """The most memory ``load_image`` holds decoding it: the decoded pixels, a rotated
        copy (EXIF orientation), the conversion's intermediate and the RGB result."""
        stored = _stored_bytes(self.mode)
        if self.has_alpha:
            between = (0 if self.mode == "RGBA" else 4) + 1  # the RGBA copy and its alpha mask
        elif self.mode in _HIGH_BIT_MODES:
            between = 1  # the 8-bit gray image (the float scratch is a bounded strip)
        else:
            between = 0
        return self.pixels * (2 * stored + between + _stored_bytes("RGB"))

    @property
    def cost(self) -> int:
        """What the pixel limits charge (``limits.MAX_IMAGE_PIXELS``, the server's budget):
        the pixels, or more where the mode's decode holds more memory than an RGB image of
        as many pixels does (alpha, 32-bit and float modes)."""
        rgb = _RGB_DECODE_BYTES_PER_PIXEL
        return max(self.pixels, (self.decode_bytes + rgb - 1) // rgb)


_RGB_DECODE_BYTES_PER_PIXEL = ImageHeader(1, 1, "RGB").decode_bytes


def header_of(img: Image.Image) -> ImageHeader:
    """The header of an image PIL has opened (nothing decoded)."""
    return ImageHeader(img.width, img.height, img.mode, _has_alpha(img))


def _check_header(
    header: ImageHeader, name: str, max_pixels: int | None, max_ratio: float | None
) -> None:
    """Refuse, before decoding, an image over ``max_pixels`` (charged by ``cost``) or more
    elongated than ``max_ratio`` (no model's smart_resize accepts it)."""
    w, h = header.width, header.height
    if max_ratio is not None and w > 0 and h > 0 and max(w, h) / min(w, h) > max_ratio:
        raise ImageError(
            f"{name}: image is {w}x{h}, an aspect ratio of {max(w, h) / min(w, h):g}; "
            f"images are resized for the model only up to {max_ratio:g}"
        )
    if max_pixels is not None and header.cost > max_pixels:
        heavier = f", counted as {header.cost} for its {header.mode} mode" * (
            header.cost > header.pixels
        )
        raise ImageError(
            f"{name}: image is too large to decode: {w}x{h} = {header.pixels} pixels{heavier}; "
            f"at most {max_pixels} are allowed"
        )


def _finish(img: Image.Image, name: str, owned: bool = False) -> Image.Image:
    """Fully decode, validate size, convert; every PIL failure becomes an ImageError."""
    try:
        img.load()  # force a full decode so truncated/corrupt data fails here, not later
        if img.width == 0 or img.height == 0:
            raise ImageError(f"{name}: image has zero size ({img.width}x{img.height})")
        return _to_rgb(img, owned)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _bomb(name, e) from e
    except Exception as e:  # PIL plugins raise OSError, SyntaxError, struct.error, ...
        raise ImageError(f"{name}: image data is corrupt or truncated ({e})") from e


def _bomb(name: str, e: Exception) -> ImageError:
    return ImageError(
        f"{name}: image is too large to decode safely (decompression bomb check: {e})"
    )


def _open(
    fp: str | os.PathLike[str] | io.BytesIO,
    name: str,
    max_pixels: int | None = None,
    max_ratio: float | None = None,
) -> Image.Image:
    """Open, check the header, decode; the decompression-bomb warning is an error."""
    # Note: catch_warnings swaps process-wide filters (not thread-safe before Python 3.14's
    # context-aware warnings); another thread loading at the same moment may see them too.
    with warnings.catch_warnings():
        # Keep PIL's bomb check, but as an ImageError instead of a stray warning.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(fp) as img:  # reads the header only
                _check_header(header_of(img), name, max_pixels, max_ratio)
                return _finish(img, name, owned=True)
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _bomb(name, e) from e
        except Image.UnidentifiedImageError as e:
            raise ImageError(f"{name}: not an image file (unrecognized format)") from e
        except Exception as e:  # OSError (permissions...), SyntaxError from plugins
            raise ImageError(f"{name}: cannot open image ({e})") from e


def load_image(
    src: str | os.PathLike[str] | bytes | bytearray | Image.Image,
    *,
    copy: bool = True,
    max_pixels: int | None = None,
    max_ratio: float | None = MAX_RATIO,
) -> Image.Image:
    """Load `src` (path, raw bytes, `data:image/...;base64,...` URI, PIL image) as loaded RGB.

    EXIF orientation is applied and the result is a new image, safe to mutate. With
    ``copy=False`` an already upright, loaded RGB PIL image is returned as it is: the hot path
    passes the same image through every phase and never mutates it.

    Checked from the header, before anything is decoded: ``max_pixels`` (``None``: only PIL's
    decompression-bomb limit; untrusted images get ``limits.MAX_IMAGE_PIXELS``), charged as
    ``ImageHeader.cost``, and ``max_ratio``, the longer side over the shorter (default: the
    most any model's smart_resize takes; ``None``: not checked).
    Raises ImageError with the source named in the message.
    """
    name = _describe(src)
    if isinstance(src, Image.Image):
        _check_header(header_of(src), name, None, max_ratio)  # decoded already: shape only
        if (
            not copy
            and src.mode == "RGB"
            and src.width > 0
            and src.height > 0
            and getattr(src, "im", None) is not None  # pixel data already decoded
            and src.getexif().get(_EXIF_ORIENTATION, 1) == 1
        ):
            return src
        return _finish(src, name)
    fp, name = _encoded(src, name)
    return _open(fp, name, max_pixels, max_ratio)


def _encoded(src: object, name: str) -> tuple[io.BytesIO | Path, str]:
    """The encoded image of a bytes, data URI or path source, and the name errors give it."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            raise ImageError(f"{name}: no image data (empty)")
        return io.BytesIO(bytes(src)), name
    if isinstance(src, str) and src.startswith("data:"):
        data = _decode_data_uri(src)
        if not data:
            raise ImageError(f"{name}: data URI has an empty payload")
        return io.BytesIO(data), name
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise ImageError(f"{src}: URLs are not supported, download the image first")
    if isinstance(src, (str, os.PathLike)):
        s = os.fspath(src)
        if isinstance(s, bytes):
            raise ImageError(f"{name}: bytes paths are not supported")
        path = Path(s.removeprefix("file://"))
        if not path.exists():
            raise ImageError(f"{path}: image file not found")
        if path.is_dir():
            raise ImageError(f"{path}: is a directory, not an image file")
        try:
            size = path.stat().st_size
        except OSError as e:
            raise ImageError(f"{path}: cannot stat image file ({e})") from e
        if size == 0:
            raise ImageError(f"{path}: image file is empty (0 bytes)")
        return path, str(path)
    raise ImageError(
        f"unsupported image source: {name} "
        "(expected a path, bytes, a data:image/... URI or a PIL image)"
    )


def read_header(src: str | os.PathLike[str] | bytes | bytearray) -> ImageHeader:
    """The header of an encoded image (path, bytes or data URI): no pixel is decoded.

    Raises ImageError when there is no readable header, or past PIL's decompression-bomb
    limit (such an image is refused by every limit anyway).
    """
    fp, name = _encoded(src, _describe(src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(fp) as img:
                return header_of(img)
        except Image.DecompressionBombError as e:
            raise _bomb(name, e) from e
        except Image.UnidentifiedImageError as e:
            raise ImageError(f"{name}: not an image file (unrecognized format)") from e
        except Exception as e:  # OSError (permissions...), SyntaxError from plugins
            raise ImageError(f"{name}: cannot open image ({e})") from e


def to_data_uri(image: Image.Image, fmt: str = "PNG") -> str:
    """Encode `image` as a `data:image/<fmt>;base64,...` URI."""
    fmt = fmt.upper()
    if fmt == "JPG":
        fmt = "JPEG"
    if fmt == "JPEG" and image.mode not in ("RGB", "L", "CMYK"):
        image = _to_rgb(image)  # JPEG has no alpha/palette
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = Image.MIME.get(fmt, f"image/{fmt.lower()}")
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def image_from_data_uri(uri: str) -> Image.Image:
    """Decode a data URI produced by `to_data_uri` (or any image data URI) to RGB."""
    if not isinstance(uri, str) or not uri.startswith("data:"):
        raise ImageError(f"{_describe(uri)}: not a data URI (must start with 'data:')")
    return load_image(uri)


# ---------------------------------------------------------------------------------------------
# smart_resize and views


def smart_resize(
    height: int,
    width: int,
    factor: int = FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """Qwen's smart_resize: (h, w) that are multiples of `factor` with area in [min, max].

    Same arithmetic as qwen-vl-utils (including `max(factor, ...)` on the rounded sides, which
    transformers omits; the two only differ when a side is under factor/2 pixels).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class View:
    """An image as the model saw it: original size and the (resized) size it was shown at."""

    orig_w: int
    orig_h: int
    view_w: int
    view_h: int

    def __post_init__(self) -> None:
        if min(self.orig_w, self.orig_h, self.view_w, self.view_h) <= 0:
            raise ValueError(f"View sizes must be positive, got {self}")

    @property
    def scale_x(self) -> float:
        """Original pixels per view pixel, horizontally."""
        return self.orig_w / self.view_w

    @property
    def scale_y(self) -> float:
        """Original pixels per view pixel, vertically."""
        return self.orig_h / self.view_h


def view_for_model(
    image: Image.Image,
    factor: int = FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> View:
    """The geometry of ``image`` as a model with these resize settings sees it (no resizing)."""
    h, w = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    return View(orig_w=image.width, orig_h=image.height, view_w=w, view_h=h)


def resize_for_model(
    image: Image.Image,
    factor: int = FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[Image.Image, View]:
    """smart_resize `image` (BICUBIC, as Qwen's processor); same object if already that size."""
    h, w = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    view = View(image.width, image.height, w, h)
    if (w, h) == image.size:
        return image, view
    return image.resize((w, h), Image.Resampling.BICUBIC), view


# ---------------------------------------------------------------------------------------------
# Boxes (DeepEyes image_zoom_in_tool)


def _short(value: object, limit: int = 120) -> str:
    """repr for a model-facing message, cut so a huge argument cannot flood the context."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def parse_box(value: object) -> Box:
    """Validate a model-supplied bbox_2d: a list/tuple of 4 finite numbers (not bools/strings)."""
    msg = f"bbox_2d must be a list of 4 numbers [x1, y1, x2, y2], got {_short(value)}"
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        raise BoxError(msg)
    out = []
    for v in value:
        # bool is an int subclass and "12" is not a number: both are model mistakes to report.
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise BoxError(msg)
        f = float(v)
        if not math.isfinite(f):
            raise BoxError(msg)
        out.append(f)
    return (out[0], out[1], out[2], out[3])


def _check_coords(coords: str) -> None:
    if coords not in ("absolute", "relative1000"):
        raise ValueError(f"coords must be 'absolute' or 'relative1000', got {coords!r}")


def _to_view_pixels(box: Box, view: View, coords: Coords) -> Box:
    _check_coords(coords)
    if coords == "absolute":
        return box
    sx, sy = view.view_w / 1000.0, view.view_h / 1000.0
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def box_to_original(box: object, view: View, coords: Coords = "absolute") -> Box:
    """Map a box in the model's coordinates to original-image pixels (no clamping)."""
    x1, y1, x2, y2 = _to_view_pixels(parse_box(box), view, coords)
    return (x1 * view.scale_x, y1 * view.scale_y, x2 * view.scale_x, y2 * view.scale_y)


def clamp_box(box: Box, width: float, height: float) -> Box:
    """Clamp each coordinate of `box` to [0, width] x [0, height]."""
    x1, y1, x2, y2 = box
    return (
        min(max(x1, 0.0), width),
        min(max(y1, 0.0), height),
        min(max(x2, 0.0), width),
        min(max(y2, 0.0), height),
    )


def checked_crop_box(
    box: object, view: View, coords: Coords = "absolute", min_size: float = 28
) -> IntBox:
    """Validate a zoom box and return the integer crop box in ORIGINAL image pixels.

    Raises BoxError (message meant for the model) for malformed, inverted, empty,
    out-of-image or too-small boxes; a box partly outside the image is clamped.
    """
    _check_coords(coords)
    b = parse_box(box)
    x1, y1, x2, y2 = b
    if x2 < x1 or y2 < y1:
        raise BoxError(f"bbox_2d {_fmt(b)} is inverted: it must satisfy x1 <= x2 and y1 <= y2.")
    if x2 == x1 or y2 == y1:
        raise BoxError(f"bbox_2d {_fmt(b)} is empty: it has zero width or height.")

    # Clamp and size-check in view pixels: that is the space the model reasons in.
    v = clamp_box(_to_view_pixels(b, view, coords), view.view_w, view.view_h)
    vw, vh = v[2] - v[0], v[3] - v[1]
    if coords == "absolute":
        space = f"the image is {view.view_w}x{view.view_h} pixels (width x height)"
    else:
        space = "coordinates run from 0 to 1000 relative to the image"
    if vw <= 0 or vh <= 0:
        raise BoxError(f"bbox_2d {_fmt(b)} lies outside the image; {space}.")
    # A view side can be shorter than min_size (tiny images); then the full side is enough.
    need_w, need_h = min(min_size, view.view_w), min(min_size, view.view_h)
    if vw < need_w - _EPS or vh < need_h - _EPS:
        if coords == "absolute":
            raise BoxError(
                f"bbox_2d {_fmt(b)} is too small ({vw:g}x{vh:g} pixels inside the image); "
                f"each side must be at least {min_size:g} pixels."
            )
        rw, rh = math.ceil(need_w * 1000 / view.view_w), math.ceil(need_h * 1000 / view.view_h)
        raise BoxError(
            f"bbox_2d {_fmt(b)} is too small; it must be at least {rw} wide and {rh} high "
            f"on the 0-1000 scale ({min_size:g} pixels of the image)."
        )

    ox1, oy1 = v[0] * view.scale_x, v[1] * view.scale_y
    ox2, oy2 = v[2] * view.scale_x, v[3] * view.scale_y
    ix1 = min(max(math.floor(ox1 + _EPS), 0), view.orig_w - 1)
    iy1 = min(max(math.floor(oy1 + _EPS), 0), view.orig_h - 1)
    ix2 = max(min(math.ceil(ox2 - _EPS), view.orig_w), ix1 + 1)
    iy2 = max(min(math.ceil(oy2 - _EPS), view.orig_h), iy1 + 1)
    return (ix1, iy1, ix2, iy2)


def crop(image: Image.Image, box_int: IntBox) -> Image.Image:
    """Crop the original image to an integer box (x1, y1, x2, y2), right/bottom exclusive."""
    x1, y1, x2, y2 = box_int
    if not (0 <= x1 < x2 <= image.width and 0 <= y1 < y2 <= image.height):
        raise ValueError(f"crop box {box_int} is not inside the {image.width}x{image.height} image")
    return image.crop((x1, y1, x2, y2))


def zoom_crop(
    image: Image.Image,
    view: View,
    box: object,
    coords: Coords = "absolute",
    factor: int = FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    min_size: float = 28,
) -> tuple[Image.Image, View, IntBox]:
    """DeepEyes zoom: check the box, crop the ORIGINAL image, smart_resize the crop.

    Returns (resized crop, its View relative to the crop, box in original pixels).
    """
    if image.size != (view.orig_w, view.orig_h):
        raise ValueError(
            f"image is {image.width}x{image.height} but the view's original is "
            f"{view.orig_w}x{view.orig_h}; pass the original image"
        )
    box_int = checked_crop_box(box, view, coords, min_size)
    piece = crop(image, box_int)
    try:
        resized, crop_view = resize_for_model(piece, factor, min_pixels, max_pixels)
    except ValueError as e:  # aspect ratio over 200: the model can fix its box
        raise BoxError(f"bbox_2d {_fmt(parse_box(box))} is too thin: {e}.") from e
    return resized, crop_view, box_int
