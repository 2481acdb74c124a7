"""Does the demo target find the shape a colour question asks about? Where its attention goes on the picture.

    python -m dev.demo_attention [--models models/demo] [--questions 40] [--json FILE]

Held-out colour questions whose asked shape is the only one of its colour (so the answer names the shape),
each teacher-forced up to the colour word through the target's own processor and chat template. For every
layer and head: how often its largest attention weight over the picture's tokens lands on the asked shape's
cell (one image token per cell). Beside it, how often the colour word is the target's first choice there.
A target that names colours poorly while no head finds the cell fails at finding the shape, not at seeing
its colour (issue 29's note: 7/40 and 42% with the picture before the question, 21/40 and 65% after it).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from demo.world import CELLS, IMAGE_SIZE, examples, render
from pipespec.commands.logs import add_log_level, setup_logging

log = logging.getLogger(__name__)


def colour_questions(n: int) -> list:
    """The first `n` held-out colour questions whose answer's last word names exactly one shape's colour."""
    chosen = []
    for ex in examples("held_out", 20 * n, 0):
        if ex.kind == "colour" and sum(s.colour in ex.answer.split()[-1] for s in ex.scene.shapes) == 1:
            chosen.append(ex)
    return chosen[:n]


def attention_on_cells(models: Path, n: int) -> dict:
    """-> {"questions", "colour_first" (questions whose colour word is the top choice), "heads" [layer][head]:
    the share of questions whose head puts its top image weight on the asked shape's cell}."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(models / "target", dtype=torch.float32, attn_implementation="eager")
    model.eval()
    processor = AutoProcessor.from_pretrained(models / "target")
    tokenizer = processor.tokenizer
    text_config = model.config.text_config
    hits = torch.zeros(text_config.num_hidden_layers, text_config.num_attention_heads)
    right, questions = 0, colour_questions(n)
    for ex in questions:
        shape = next(s for s in ex.scene.shapes if s.colour in ex.answer.split()[-1])
        parts = [{"type": "image"}, {"type": "text", "text": ex.prompt}]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=[render(ex.scene, IMAGE_SIZE)], return_tensors="pt")
        before = tokenizer(" " + ex.answer[: ex.answer.rindex(shape.colour)].rstrip(), add_special_tokens=False)["input_ids"]
        ids = torch.cat([enc["input_ids"], torch.tensor([before])], 1)  # [1, T]: the answer up to its colour word
        with torch.no_grad():
            out = model(input_ids=ids, pixel_values=enc["pixel_values"], output_attentions=True)
        image = (ids[0] == model.config.image_token_id).nonzero().flatten()  # [9]: one token per cell
        for layer, weights in enumerate(out.attentions):  # [1, heads, T, T]
            hits[layer] += (weights[0, :, -1, image].argmax(-1) == CELLS.index(shape.cell)).float()
        right += tokenizer.decode(out.logits[0, -1].argmax()).strip() == shape.colour
    return {"questions": len(questions), "colour_first": right, "heads": (hits / len(questions)).round(decimals=2).tolist()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models/demo"))
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--json", type=Path, help="write the result here too")
    add_log_level(parser, default="WARNING")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    result = attention_on_cells(args.models, args.questions)
    print(f"colour word first (teacher-forced): {result['colour_first']}/{result['questions']}")
    print("share of questions whose head's top image token is the asked shape's cell (rows: layers, columns: heads):")
    for row in result["heads"]:
        print("  " + " ".join(f"{v:.2f}" for v in row))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
