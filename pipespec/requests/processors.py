"""Image processors that transformers 5.23 cannot build without torchvision, rebuilt for images only.

torchvision has no CPU build for torch 2.13 here, and two processor families refuse to load without
it although their image path never uses it: Qwen2-VL / Qwen2.5-VL / SmolVLM insist on a video
processor (which needs it), and Pixtral's processor (Mistral 3) imports one resize helper from the
torchvision image module. `image_only_processor` rebuilds either from the directory's PIL image
processor, tokenizer and chat template, with the same token expansion, so `pipespec.requests.images` can
serve them. With torchvision installed, `AutoProcessor` loads them and none of this runs.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from transformers import ProcessorMixin

from pipespec.errors import ConfigError


class PixtralImageProcessorOnly(ProcessorMixin):
    """Pixtral's prompt expansion: a row of `[IMG]` per patch row, `[IMG_BREAK]` between rows, `[IMG_END]` last."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        patch_size: int = 16,
        spatial_merge_size: int = 1,
        chat_template: str | None = None,
        image_token: str = "[IMG]",
        image_break_token: str = "[IMG_BREAK]",
        image_end_token: str = "[IMG_END]",
        **kwargs: Any,
    ):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token, self.image_break_token, self.image_end_token = image_token, image_break_token, image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        return type(argument)  # the PIL image processor stands in for the torchvision one

    def _process_images(self, images: Any, **images_kwargs: Any) -> Any:
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
        step = self.patch_size * self.spatial_merge_size
        height, width = image_inputs["image_sizes"][image_idx]
        rows = [self.image_token * (width // step) + self.image_break_token] * (height // step)
        return "".join(rows).removesuffix(self.image_break_token) + self.image_end_token


def _settings(root: Path) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):  # the latter wins
        if (root / name).is_file():
            settings.update(json.loads((root / name).read_text()))
    return settings


def image_only_processor(model_dir: str, where: str, cause: ImportError) -> Any:
    """The processor of `model_dir` without the parts that need torchvision; ConfigError if unknown."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    root = Path(model_dir)
    settings = _settings(root)
    name = settings.get("processor_class")
    template = (root / "chat_template.jinja").read_text() if (root / "chat_template.jinja").is_file() else None
    parts = dict(
        image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=AutoTokenizer.from_pretrained(model_dir)
    )
    if name == "PixtralProcessor":
        keys = ("patch_size", "spatial_merge_size", "image_token", "image_break_token", "image_end_token")
        return PixtralImageProcessorOnly(**parts, chat_template=template, **{k: settings[k] for k in keys if k in settings})
    try:
        cls = getattr(transformers, name) if name else None
    except ImportError:
        cls = None
    if cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
        raise ConfigError(f"{where}: the processor {name or '?'} in {model_dir!r} needs torchvision: {cause}") from cause

    class ImageOnly(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnly(**parts, video_processor=None, chat_template=template)
