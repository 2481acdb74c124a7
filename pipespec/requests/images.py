"""Images at the front door: decode what the user gave, and let the target's processor place it.

A user image is a file path, raw bytes, a PIL image or a `data:image/...;base64,` URL. It is decoded
once, at the front door, so an image that does not decode is an error naming it before any stage
sees the request; within the config's `limits`: its bytes counted first, its pixels read from its
header before it is decoded (a 236 KB PNG may hold 9000x9000 pixels: 243 MB decoded, a gigabyte
through a processor), and only common formats opened. The target's Hugging Face processor then
renders the chat template with the image and expands its placeholder into the model's image tokens,
returning the token ids the target sees and the pixel arrays it needs (numpy, so this module stays
torch-free). Text-only drafters see the same conversation rendered without the image: its text
tokens, never the placeholders.
"""

from __future__ import annotations

import base64
import binascii
import io
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipespec.config import LimitsSpec, PipelineConfig
from pipespec.errors import ConfigError
from pipespec.protocol.messages import ImageInputs
from pipespec.requests.chat import ChatMessage
from pipespec.schema.kinds import kind_of

_TEXT_KEYS = ("input_ids", "attention_mask")  # what the processor returns besides the image arrays
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what a user's image may be (PIL opens more, some through helper programs)
# what PIL's decoders raise on bytes that are not what their header says
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error, zlib.error)


@dataclass(frozen=True)
class ImagePrompt:
    prompt_token_ids: tuple[int, ...]  # the target's prompt, image tokens expanded
    text_prompt_token_ids: tuple[int, ...]  # the same conversation without the image (text drafters)
    image: ImageInputs


def image_bytes(image: Any, limits: LimitsSpec | None = None) -> tuple[bytes, str]:
    """A path, bytes, PIL image or data URL -> (encoded bytes, how to name it in an error).

    What a client sends over the wire (once per request; no `limits`: the server checks them), and
    what the front door reads within `limits.image_bytes` (a file's size checked before it is read).
    Raises ValueError naming a bad input, a file that cannot be read, or the limit.
    """
    most = None if limits is None else limits.image_bytes
    if isinstance(image, (str, Path)) and not (isinstance(image, str) and image.startswith("data:")):
        return _file_bytes(Path(image), most)
    data, what = _encoded(image)
    if most is not None and len(data) > most:
        raise ValueError(f"{what} is over limits.image_bytes ({most})")
    return data, what


def _encoded(image: Any) -> tuple[bytes, str]:
    if type(image).__module__.startswith("PIL.") and hasattr(image, "save"):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue(), f"PIL image {image.width}x{image.height}"
    if isinstance(image, str):  # a data URL
        header, _, payload = image.partition(",")
        if ";base64" not in header or not payload:
            raise ValueError(f"image data URL {image[:40]!r}... is not a base64 data URL")
        try:
            return base64.b64decode(payload, validate=True), f"image data URL {header!r}"
        except binascii.Error as e:
            raise ValueError(f"image data URL {header!r}: invalid base64 ({e})") from e
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), f"image of {len(image)} bytes"
    raise ValueError(f"image must be a file path, bytes, a PIL image or a data URL, got {type(image).__name__}")


def _file_bytes(path: Path, most: int | None) -> tuple[bytes, str]:
    """A file's bytes, its size checked against `most` (None: any) before it is read."""
    what = f"image file {str(path)!r}"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} is not a regular file")
        if most is not None and info.st_size > most:
            raise ValueError(f"{what} of {info.st_size} bytes is over limits.image_bytes ({most})")
        with path.open("rb") as file:
            data = file.read() if most is None else file.read(most + 1)  # it may have grown since
    except FileNotFoundError:
        raise ValueError(f"{what} does not exist") from None
    except OSError as e:  # permission denied, a directory, an I/O error
        raise ValueError(f"{what} cannot be read: {e.strerror or e}") from None
    if most is not None and len(data) > most:
        raise ValueError(f"{what} is over limits.image_bytes ({most})")
    return data, what


def load_image(image: Any, limits: LimitsSpec = LimitsSpec()) -> Any:
    """A path, bytes, PIL image or data URL -> an RGB PIL image, within `limits`. Raises ValueError
    naming the input and the limit: its bytes are counted before it is opened (a file's before it is
    read), its pixels read from its header before it is decoded, so an image over a limit costs no
    more than its bytes."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        _check_pixels(image.size, "PIL image", limits)
        return image.convert("RGB")
    data, what = image_bytes(image, limits)
    try:
        opened = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:  # PIL's own bound (2 x Image.MAX_IMAGE_PIXELS), from the header too
        raise ValueError(f"{what} is too large to decode ({e}); limits.image_pixels is {limits.image_pixels}") from None
    except UnidentifiedImageError:  # its message names a BytesIO at some address
        raise ValueError(f"{what} does not decode as an image (not {', '.join(FORMATS)})") from None
    except _DECODE_ERRORS as e:
        raise ValueError(f"{what} does not decode as an image: {e}") from None
    with opened:
        _check_pixels(opened.size, what, limits)
        try:
            return opened.convert("RGB")
        except _DECODE_ERRORS as e:
            raise ValueError(f"{what} does not decode as an image: {e}") from None


def _check_pixels(size: tuple[int, int], what: str, limits: LimitsSpec) -> None:
    width, height = size
    if width * height > limits.image_pixels:
        raise ValueError(
            f"{what} is {width}x{height} = {width * height} pixels, over limits.image_pixels ({limits.image_pixels})"
        )


def load_target_processor(config: PipelineConfig) -> Any | None:
    """The image target's processor (None for other targets): checked at config time, before weights load."""
    if not kind_of(config.target).takes_images:
        return None
    return load_processor(config.target.model, f"stages[{len(config.stages) - 1}] ({config.target.name})")


def load_processor(model_dir: str, where: str) -> Any:
    """The image-text processor saved with a VLM; a directory without one is a config error."""
    from transformers import AutoProcessor

    try:
        try:
            processor = AutoProcessor.from_pretrained(model_dir)
        except ImportError as e:  # transformers wants torchvision (no CPU build for torch 2.13 here)
            from pipespec.requests.processors import image_only_processor

            processor = image_only_processor(model_dir, where, e)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"{where}: no image processor could be loaded from {model_dir!r} (a VLM directory needs the files "
            f"processor.save_pretrained(dir) writes): {e}"
        ) from e
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(
            f"{where}: {model_dir!r} has a tokenizer but no image processor (preprocessor_config.json); "
            "save the model's processor with processor.save_pretrained(dir)"
        )
    return processor


def _chat(processor: Any, messages: tuple[ChatMessage, ...], image: Any | None, **kwargs: Any) -> Any:
    """Render `messages` through the processor's chat template; with `image`, in its image part."""
    if getattr(processor, "chat_template", None):
        template = [{"role": m.role, "content": m.template_content(image)} for m in messages]
        return processor.apply_chat_template(template, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)
    parts = [processor.image_token if p.image else p.text for m in messages for p in m.parts if image is not None or not p.image]
    return processor(text=["".join(parts)], images=[image] if image is not None else None, **kwargs)  # no template: plain text


def encode_text_prompt(processor: Any, messages: tuple[ChatMessage, ...]) -> list[int]:
    """A conversation without its image through the processor's chat template."""
    return [int(t) for t in np.asarray(_chat(processor, messages, None)["input_ids"]).reshape(-1)]


def encode_image_prompt(processor: Any, messages: tuple[ChatMessage, ...], image: Any) -> ImagePrompt:
    """Render `messages` with the decoded `image` in its part through the processor: ids for every stage,
    arrays for the target."""
    try:
        out = _chat(processor, messages, image, return_tensors="np")
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"the target's processor cannot take this image ({image.width}x{image.height}): {e}") from e
    ids = np.asarray(out["input_ids"]).reshape(-1)
    arrays = {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_KEYS}
    return ImagePrompt(
        prompt_token_ids=tuple(int(t) for t in ids),
        text_prompt_token_ids=tuple(encode_text_prompt(processor, messages)),
        image=ImageInputs(arrays),
    )
