"""Train the demo's models on the generated visual world (`demo.world`, `demo.talk`), reproducibly, on a CPU or a GPU.

    python -m demo.train tokenizer        # BPE on the world's text, with the chat tokens
    python -m demo.train tower            # the target's vision tower, pretrained on the world's ground truth (demo.tower)
    python -m demo.train target           # the VLM target (LLaVA class, 384 wide, 4 layers) over the frozen tower
    python -m demo.train tiny             # the tiny text drafter (sees the prompt's text only)
    python -m demo.train dream            # the DREAM drafter, through training.train
    python -m demo.train evaluate         # the target's accuracy per kind, 40 held-out questions each (demo.evaluate)
    python -m demo.train picture          # models/demo/example.png: the picture `pipespec demo` asks about,
                                          # and held_out.jsonl: the questions it asks all at once
    python -m demo.train all              # everything above, in order: the shipped models

The tower step pretrains the CLIP-style tower densely (`demo.tower`), as contrastive pretraining does for
real LLaVA models; the target step then trains the language model and projector on the conversations with
the tower frozen, as LLaVA does. Each step runs the shipped recipe (`SHIPPED`: its optimiser steps and
batch, stopping early at its minutes of budget) unless `--steps` / `--minutes` / `--batch-size` say
otherwise. Everything is seeded. The models are written in half precision to
`models/demo/{tower,target,tiny,dream}` (shipped in the repository, so `pipespec demo` starts at once;
retraining overwrites them).

The target and tiny steps train on `--device` (cpu by default; cuda for a GPU). The shipped target was trained on a
2-core CPU by this command's target step (its recipe, 5000 steps at batch 64: 1 h 4 min on a CPU with AMX, 0.75 s a
step; 1 h 52 min on one without, 1.34 s), and meets every accuracy bar on 40 held-out questions a kind. With
`--device cuda` one H200 runs the recipe in 2 min 46 s and gives a target as good within the intervals (on 100
questions a kind, count 0.89 and where 0.92 against the CPU's 0.92 and 0.98; it shipped before this one). In 30
minutes a 2-core CPU runs 5000 steps at batch 16, a quarter of the conversations, and gives a target that finds the
asked shape 0.40 of the time. The best of the CPU's 30 minutes so far is a 256-wide target (half the cost a step:
3200 steps at batch 64), which meets every bar but count (0.90) and where (0.62), yet costs 3x the tiny drafter a
forward, under the 4x the demo wants (experiments/results/demo_shapes). One recipe follows one loss curve on either
device: at batch 64 the mean loss of the first 100 steps is 3.32914 on the CPU and 3.32913 on the GPU, of the last
50 steps 0.189 and 0.196; at batch 16, over all 5000 steps, the last 200 steps' is 0.265 and 0.260. Every other
step fits in about 15 minutes here. Training runs in fp32: on a CPU without bf16 instructions a bf16-autocast step
costs 23x an fp32 one (80 s against 3.5 s for the old 24-layer target's batch), and on one with them (AMX) a step
of the shipped shape took 0.79x the fp32 one's time, 0.68x compiled (`python -m dev.train_cost`,
experiments/results/train_cost.md): not enough to leave the loss curve both devices share for a budget it would
still miss (the fp32 step already runs at 54% of these cores' fp32 matrix-product rate).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

from demo.evaluate import evaluate_target, summary
from demo.llava_template import CHAT_TEMPLATE
from demo.projector import init_projector
from demo.tower import pretrain_tower
from demo.world import IMAGE_SIZE
from pipespec.commands.logs import add_log_level, setup_logging
from training.optimiser import Optimiser

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerBase

    from demo.world import Example, Scene

log = logging.getLogger(__name__)

MODELS = Path("models/demo")
# One patch per cell of the world's 3x3 grid: 9 image tokens, each all of one cell (a shape, a word or nothing).
# Against 8-pixel patches (64 image tokens) a prompt is 55 tokens shorter, so a training step costs about half
# (1500 steps in 14 minutes, not 26) and so does a prefill (experiments/results/demo_shapes).
PATCH = 24
# Shallow and wide (dev/demo_shapes.py, experiments/results/demo_shapes): a 24-layer, 256-wide target did
# not learn to use the picture in the budget. This one learns it from enough conversations: at batch 16 (5000
# steps) it read the word and described the picture with every shape right 0.17 of the time, but found a
# shape by what it is (where) 0.40 of the time; at batch 64 (four times the conversations) describe 0.97
# (every detail right 0.90), colour 1.00, where 0.88, count 0.90.
# Compiled, its forward costs about 6x the tiny drafter's on one thread of this CPU, yet at 9 ms a token
# alone it is too cheap for the pipeline to beat by much here (issue 29's note).
TARGET = dict(hidden=384, layers=4, heads=6, intermediate=1024)


@dataclass(frozen=True)
class Recipe:
    """How a step of `all` trains its shipped model: optimiser steps, stopping early at `minutes` of budget
    (None: no budget), `batch` conversations a step (None: the step draws its own). --steps, --minutes and
    --batch-size override them."""

    steps: int
    minutes: float | None = None
    batch: int | None = None


SHIPPED = {
    "tower": Recipe(1200, 15.0),
    "target": Recipe(5000, batch=64),  # 1 h 4 min on a 2-core CPU with AMX (the module's docstring)
    "tiny": Recipe(5000, 10.0, batch=32),
    "dream": Recipe(4000),
}
TINY = dict(hidden=192, layers=2, heads=4, intermediate=512)


# ---- tokenizer --------------------------------------------------------------------------------------


def train_tokenizer(out: Path, vocab_size: int = 1024, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from demo import talk, world

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = world.corpus(seed=seed) + talk.corpus(20000 // 6, seed) + ["USER: ", "ASSISTANT:", "\n"]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def load_tokenizer(models: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models / "tokenizer")


# ---- the target -------------------------------------------------------------------------------------


def llama_config(tokenizer: PreTrainedTokenizerBase, shape: dict[str, int], tie_word_embeddings: bool) -> LlamaConfig:
    """A Llama language model's config of `shape` (TARGET's or TINY's sizes) over `tokenizer`'s vocabulary
    and special tokens: the target's text half, or the tiny drafter."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip


def vision_config():
    """The demo tower's CLIP vision config: a patch per grid cell of the world's pictures, 4 layers at width 192."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=192,
    )  # fmt: skip


def image_processor():
    """The demo pictures' CLIP processor, one for the tower's pretraining and the target: IMAGE_SIZE, uncropped."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def build_target(tokenizer, seed: int = 0, shape: dict[str, int] = TARGET):
    """A fresh LLaVA-class target (random weights, its tower too) of `shape`, and its processor."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    text = llama_config(tokenizer, shape, tie_word_embeddings=False)
    config = LlavaConfig(
        vision_config=vision_config().to_dict(), text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    processor = LlavaProcessor(
        image_processor=image_processor(),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    return model, processor


Row = tuple[list[int], list[int], torch.Tensor | None]  # one `encode`d conversation: ids, labels, pixel_values [3, S, S]


def encode_all(examples, processor, tokenizer, with_image: bool = True, workers: int = 1) -> list[Row]:
    """`encode` every example once, in order, on `workers` processes (rendering and the image processor cost
    about 2 ms a picture: re-encoded at every draw, a batch of 16 took 34 ms, as long as a GPU's step)."""
    if workers <= 1:
        return [encode(ex, processor, tokenizer, with_image) for ex in examples]
    job = partial(_encode_to_numpy, processor=processor, tokenizer=tokenizer, with_image=with_image)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = pool.map(job, examples, chunksize=max(1, len(examples) // (8 * workers)))
        return [(ids, labels, None if pixels is None else torch.from_numpy(pixels)) for ids, labels, pixels in rows]


def _encode_to_numpy(example, processor, tokenizer, with_image: bool):
    """`encode` on a worker: the pixels go back as an array (torch would send each tensor through a file
    descriptor of shared memory, and runs out of them)."""
    ids, labels, pixels = encode(example, processor, tokenizer, with_image)
    return ids, labels, None if pixels is None else pixels.numpy()


def batches(rows: Sequence[Row], batch_size: int, rng: random.Random, pad: int, group: int = 32):
    """Endless shuffled batches of `encode_all`'s rows: (input_ids [B, T], pixel_values [P, 3, S, S] | None,
    labels [B, T]), P the rows with a picture, padded with `pad`.

    Batches are grouped by length, as Hugging Face's `group_by_length` does: `group` batches' worth of
    rows are drawn, sorted by length, cut into batches and yielded in a random order. A description
    (about 100 tokens) no longer pads the short questions (about 35) it is drawn with: at batch 16, rows
    were half padding, and a step's cost follows its width."""
    order: list[int] = []

    def draw() -> Row:
        nonlocal order
        if not order:
            order = list(range(len(rows)))
            rng.shuffle(order)
        return rows[order.pop()]

    while True:
        drawn = sorted((draw() for _ in range(batch_size * group)), key=lambda r: len(r[0]))
        chunks = [drawn[i : i + batch_size] for i in range(0, len(drawn), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield collate(chunk, pad)


def encode(example, processor, tokenizer, with_image: bool) -> Row:
    """One conversation -> (token ids, labels: -100 but on the answer and its end of turn, pixel_values
    [3, S, S] or None)."""
    from demo.world import render

    picture = with_image and example.scene is not None
    parts = ([{"type": "image"}] if picture else []) + [{"type": "text", "text": example.prompt}]
    renderer = processor if picture else tokenizer
    text = renderer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
    pixels = None
    if picture:
        enc = processor(text=[text], images=[render(example.scene, IMAGE_SIZE)], return_tensors="pt")
        prompt = enc["input_ids"][0].tolist()
        pixels = enc["pixel_values"][0]
    else:
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer = tokenizer(" " + example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer, pixels


def collate(rows, pad: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`encode`d rows -> (input_ids [B, T], pixel_values [P, 3, S, S] | None, labels [B, T]), right-padded."""
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab, _ in rows])
    pixels = [p for _, _, p in rows if p is not None]
    return ids, (torch.stack(pixels) if pixels else None), labels


PICTURES = 50_000  # picture questions the target and the tiny drafter learn from


def conversations(seed: int, pictures: int = PICTURES) -> list[Example]:
    """What the target and the tiny drafter learn from: `pictures` picture questions (demo.world) and a
    sixth as many that need no picture (demo.talk)."""
    from demo.talk import text_examples
    from demo.world import examples

    return examples("train", pictures, seed) + text_examples("train", pictures // 6, seed)


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V], labels [B, T] (-100 where not learnt) -> each answer's mean next-token loss, averaged
    over the answers: every question counts the same. Averaged over tokens instead, a description (about 60
    tokens) outweighed a colour answer (6 tokens, one of them the colour) ten to one, and a target trained
    1500 steps that way described the layout but named the asked colour 15% of the time."""
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")  # [B, T - 1]
    learnt = labels[:, 1:] != -100
    return ((per_token * learnt).sum(1) / learnt.sum(1).clamp_min(1)).mean()


def fit(model, data, minutes: float, lr: float, max_steps: int, desc: str, device: str = "cpu") -> list[float]:
    """AdamW, warmup then cosine over `max_steps`, stopping at the time budget; fp32, on `device` (the
    model is back on the CPU when it returns)."""
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = Optimiser.adamw(params, lr, max_steps, weight_decay=0.1, warmup_steps=max_steps // 30)
    deadline = time.monotonic() + minutes * 60
    curve: list[float] = []
    model.train()
    bar = tqdm(range(max_steps), desc=desc)
    for _ in bar:
        ids, pixels, labels = (None if t is None else t.to(device) for t in next(data))
        kwargs = {"pixel_values": pixels} if pixels is not None else {}
        logits = model(input_ids=ids, **kwargs).logits  # right padding: real tokens never see it
        curve.append(optimiser.update(answer_loss(logits, labels)))
        bar.set_postfix(loss=f"{sum(curve[-20:]) / len(curve[-20:]):.3f}")
        if time.monotonic() > deadline:
            log.info("%s: time budget reached after %d steps", desc, len(curve))
            break
    model.eval().to("cpu")
    return curve


def save_half(model, out: Path, *extras) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, max_shard_size="16MB")  # no file over 16 MB in the repository
    model.to(torch.float32)
    for extra in extras:
        extra.save_pretrained(out)


def train_tower(models: Path, minutes: float, steps: int, seed: int) -> Path:
    """Pretrain the target's vision tower on the world's ground truth (`demo.tower`) into models/tower."""
    from transformers import CLIPVisionModel

    torch.manual_seed(seed)
    tower = CLIPVisionModel(vision_config())
    curve, _ = pretrain_tower(tower, image_processor(), IMAGE_SIZE, PATCH, minutes, steps, seed)
    out = models / "tower"
    save_half(tower, out)
    (out / "loss_curve.json").write_text(json.dumps(curve) + "\n")
    return out


def train_target(
    models: Path,
    minutes: float,
    steps: int,
    batch_size: int,
    seed: int,
    shape: dict[str, int] = TARGET,
    device: str = "cpu",
    workers: int = 1,
    pictures: int = PICTURES,
) -> Path:
    """Train the target's language model and projector over the pretrained tower (models/tower, frozen, as
    LLaVA's recipe keeps it)."""
    from transformers import CLIPVisionModel

    tokenizer = load_tokenizer(models)
    model, processor = build_target(tokenizer, seed, shape)
    tower = CLIPVisionModel.from_pretrained(models / "tower", dtype=torch.float32)
    model.model.vision_tower.load_state_dict(tower.state_dict())
    model.model.vision_tower.requires_grad_(False)
    init_projector(model, processor.image_processor, seed)
    log.info("target: %.1fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    rows = encode_all(conversations(seed, pictures), processor, tokenizer, workers=workers)
    curve = fit(
        model, batches(rows, batch_size, random.Random(seed), tokenizer.pad_token_id), minutes, 1e-3, steps, "target", device
    )
    out = models / "target"
    save_half(model, out, processor)
    (out / "loss_curve.json").write_text(json.dumps(curve) + "\n")
    return out


def train_tiny(models: Path, minutes: float, steps: int, batch_size: int, seed: int, device: str = "cpu") -> Path:
    """A small Llama on the same conversations, text only (what a text drafter sees)."""
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer(models)
    config = llama_config(tokenizer, TINY, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    rows = encode_all(conversations(seed + 1), None, tokenizer, with_image=False)
    curve = fit(
        model, batches(rows, batch_size, random.Random(seed), tokenizer.pad_token_id), minutes, 2e-3, steps, "tiny", device
    )
    out = models / "tiny"
    save_half(model, out, tokenizer)
    (out / "loss_curve.json").write_text(json.dumps(curve) + "\n")
    return out


def train_dream(models: Path, steps: int, seed: int) -> Path:
    import subprocess
    import sys

    models = models.resolve()  # the command runs in the checkout's root, where training/ lies (not installed)
    cmd = [
        sys.executable, "-m", "training.train", "--target", str(models / "target"), "--samples", "demo.world:samples",
        "--out", str(models / "dream"), "--steps", str(steps), "--seed", str(seed), "--train-samples", "1200",
        "--max-new-tokens", "96",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1])
    return models / "dream"


def example_scene() -> Scene:
    """The scene of the demo's default picture: a held-out one of the world."""
    from demo.world import examples

    return next(ex.scene for ex in examples("held_out", 12, seed=7) if ex.kind == "describe")


def write_example_picture(models: Path) -> Path:
    """The demo's default picture (`example_scene`) as a PNG beside the models, and its scene's truth in
    example.json (the runtime reads the files; it never renders the world itself)."""
    from demo.world import render

    scene = example_scene()
    out = models / "example.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    render(scene, IMAGE_SIZE).save(out)
    truth = {"png_sha256": hashlib.sha256(out.read_bytes()).hexdigest(), "truth": scene.truth()}
    (models / "example.json").write_text(json.dumps(truth, indent=2) + "\n")  # what `pipespec demo` prints under its answer
    log.info("wrote %s: %s", out, scene.truth())
    return out


HELD_OUT_QUESTIONS = 16  # `pipespec demo` answers them one at a time, then all at once


def write_held_out_questions(models: Path, n: int = HELD_OUT_QUESTIONS, seed: int = 3) -> Path:
    """`n` questions of the world's held-out split (every kind), their pictures under held_out/ beside the
    models, listed in held_out.jsonl: what `pipespec demo` asks all at once (the runtime reads the files)."""
    from demo.world import examples, render

    pictures = models / "held_out"
    pictures.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, ex in enumerate(examples("held_out", n, seed)):
        render(ex.scene, IMAGE_SIZE).save(pictures / f"{i:03d}.png")
        lines.append(json.dumps({"text": ex.prompt, "image": f"held_out/{i:03d}.png", "answer": ex.answer}))
    out = models / "held_out.jsonl"
    out.write_text("\n".join(lines) + "\n")
    log.info("wrote %s: %d questions", out, n)
    return out


def _device_error(device: str) -> str | None:
    """Why torch cannot train on `device` here (None: it can)."""
    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        return str(error)
    if kind == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here"
    return None if kind in ("cpu", "cuda") else "cpu or cuda"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["tokenizer", "tower", "target", "tiny", "dream", "evaluate", "picture", "all"])
    parser.add_argument("--models", type=Path, default=MODELS)
    parser.add_argument("--minutes", type=float, help="time budget of a training step (default: the shipped recipe's)")
    parser.add_argument("--steps", type=int, help="optimiser steps (default: the shipped recipe's)")
    parser.add_argument("--batch-size", type=int, help="conversations a step (default: the shipped recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the target and tiny steps train: cpu (the shipped models trained there), or cuda for a GPU",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="processes that encode the target's conversations")
    parser.add_argument("--per-kind", type=int, default=40, help="evaluate: held-out questions of each kind")
    add_log_level(parser, default="INFO")
    args = parser.parse_args(argv)
    device_error = _device_error(args.device)
    if device_error:
        parser.error(f"--device {args.device}: {device_error}")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: at least 1 process encodes the conversations")
    setup_logging(args.log_level, fmt="%(message)s")
    torch.manual_seed(args.seed)
    steps = [args.step] if args.step != "all" else ["tokenizer", "tower", "target", "tiny", "dream", "evaluate", "picture"]
    for step in steps:
        recipe = SHIPPED.get(step, Recipe(0))
        n_steps, batch = args.steps or recipe.steps, args.batch_size or recipe.batch
        minutes = args.minutes or recipe.minutes or math.inf
        if step == "tokenizer":
            train_tokenizer(args.models / "tokenizer", seed=args.seed)
        elif step == "tower":
            train_tower(args.models, minutes, n_steps, args.seed)
        elif step == "target":
            train_target(args.models, minutes, n_steps, batch, args.seed, device=args.device, workers=args.workers)
        elif step == "tiny":
            train_tiny(args.models, minutes, n_steps, batch, args.seed, device=args.device)
        elif step == "dream":
            train_dream(args.models, n_steps, args.seed)
        elif step == "picture":
            write_example_picture(args.models)
            write_held_out_questions(args.models)
        else:
            report = evaluate_target(args.models, args.per_kind, args.seed)
            print("\n".join(summary(report)))
            out = Path("experiments/results/demo_target_accuracy.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
