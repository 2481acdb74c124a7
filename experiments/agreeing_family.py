"""A family of random Llama models of given shapes whose drafters agree with the target at chosen rates.

    python -m experiments.agreeing_family OUT [--shapes cpu | gpu | NAME ...] [--agreement 0.8 0.9]
                                          [--ceiling 0.98] [--vocab V] [--device cpu] [--dtype bfloat16]
                                          [--prompts 16] [--lookahead 8] [--max-context 256] [--seed 0]

Independent random models agree about 1/V of the time, so speculation over them measures only its
overhead. These models share a vocabulary geometry instead: a V x r basis B of unit rows (r = 32) and an
r x r rotation M, common to the family, and per model an r x h projection P with orthonormal rows of its
own. A model's embedding table is B P and its head (s / sqrt(h)) B M P. With its residual branches
(every layer's o_proj and down_proj) scaled to nothing, the last hidden state is b_x P times a scale
that the final norm takes out, so every model of every width computes the same logits, s B M b_x (P P^T
= I): one bigram map, its top token the next one (up to the rounding of a low-precision dtype). Scaled
up, each model's branches perturb its prediction in directions of its own, and its agreement with the
others falls. The scale is bisected per
model, on a multiplier of its initial branches: the target's until its top-1 token agrees with the bare
bigram map at `--ceiling` of the positions of random prompts (so its answers depend on their context a
little, and a drafter cannot know all of them), then each drafter's until its teacher-forced top-1
agreement with the target, over the target's own greedy continuations of those prompts, is its rate in
`--agreement`. The special tokens' head rows are zero, so a greedy answer never ends early: every answer
is as long as it was asked to be.

Written under OUT: one directory per model (`save_pretrained`, with the family's tokenizer: a word-level
vocabulary of V made-up words), a pipeline config for each chain of the first k models (k >= 2, named
after its stages: `68m-0.5b.yaml`, `68m-0.5b-7b.yaml`), a Spec-Bench prompt set (`prompts.jsonl`) and
`family.json` (the shapes, the scales found, the agreement asked and measured between every two models,
and the seconds each part took). Each model is built on --device in --dtype (only its embedding and head
are computed on the CPU, and saving copies each tensor out); the stages then load it through the real
loading code (to the host, then to their device). The configs run each stage in an actor of its own; on
a GPU every stage asks for an eighth of it (every chain the bench starts from a 3-stage config fits at
once), forwards compiled, drafters at one width (one CUDA graph each), a small `max_context`; on the
CPU, eager (the rehearsal of experiments/device_ray.sh), a core a stage.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipespec.commands.logs import parse_logged
from pipespec.stages.causal_lm import DTYPES

log = logging.getLogger(__name__)

RANK = 32  # the shared geometry's dimension
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: never a greedy answer's token (their head rows are zero)
BRANCHES = ("o_proj.weight", "down_proj.weight")  # what each layer adds to the residual stream
# the recipe's seed plus these: the geometry (+0), the prompt set, the calibration's prompts, the i-th model
PROMPT_SEED, CALIBRATION_SEED, MODEL_SEED = 1, 1000, 100


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    kv_heads: int | None = None  # None: as many as heads


SHAPES = {
    # the CPU's, for the suite and the rehearsal
    "cpu-s": Shape(64, 1, 2, 256),
    "cpu-m": Shape(128, 2, 4, 512),
    "cpu-l": Shape(256, 4, 4, 1024),
    # Llama-68M's (JackFram/llama-68m), a bandwidth-bound CPU target (150M), a 0.5B of Llama's proportions, Llama-2-7B's
    "68m": Shape(768, 2, 12, 3072),
    "150m": Shape(768, 12, 12, 3072),
    "0.5b": Shape(1024, 24, 16, 4096),
    "7b": Shape(4096, 32, 32, 11008),
}
SETS = {"cpu": ("cpu-s", "cpu-m", "cpu-l"), "gpu": ("68m", "0.5b", "7b")}
VOCAB = {"cpu": 4096, "gpu": 32000}  # Llama's 32000 wherever a GPU shape is in the family


@dataclass(frozen=True)
class Recipe:
    shapes: tuple[str, ...]  # drafters first, the target last
    agreement: tuple[float, ...]  # per drafter: its teacher-forced top-1 agreement with the target
    ceiling: float = 0.98  # the target's agreement with the bare bigram map
    vocab: int = 32000
    device: str = "cpu"
    dtype: str = "bfloat16"
    prompts: int = 16  # in the prompt set
    prompt_words: int = 32
    calibration_prompts: int = 8  # the calibration's own prompts (another draw than the prompt set's)
    continuation: int = 48  # the target's greedy tokens each calibration prompt is continued by
    logit_scale: float = 20.0  # s: the bigram map's logits lie in [-s, s]
    lookahead: int = 8  # each drafter's max_lookahead in the configs (its verifier's window: half, sync's default 4)
    max_context: int = 256
    seed: int = 0

    def check(self) -> None:
        unknown = [s for s in self.shapes if s not in SHAPES]
        if unknown:
            raise ValueError(f"unknown shape {unknown[0]!r}; expected one of {', '.join(SHAPES)}")
        if len(self.shapes) < 2:
            raise ValueError(f"a family needs a drafter and a target, got shapes {list(self.shapes)}")
        if len(set(self.shapes)) < len(self.shapes):
            raise ValueError(f"each shape once (each names its stage), got {list(self.shapes)}")
        if len(self.agreement) != len(self.shapes) - 1:
            raise ValueError(f"one agreement per drafter: {len(self.shapes) - 1} drafters, got {list(self.agreement)}")
        for rate in (*self.agreement, self.ceiling):
            if not 0.0 < rate < 1.0:
                raise ValueError(f"an agreement is a rate in (0, 1), got {rate}")
        if self.vocab <= len(SPECIALS) + 1:
            raise ValueError(f"vocab: must exceed {len(SPECIALS) + 1}, got {self.vocab}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        need = self.prompt_words + self.continuation + 1
        if self.max_context < need:
            raise ValueError(f"max_context {self.max_context} is below a calibration sequence's {need} tokens")


# ---- the vocabulary ----------------------------------------------------------------------------------

_ONSETS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_SYLLABLES = [c + v for c in _ONSETS for v in _VOWELS]


def word(i: int) -> str:
    """The i-th made-up word: its digits in base 70 as syllables, at least two ("baba", "babe", ...)."""
    out = []
    while True:
        i, d = divmod(i, len(_SYLLABLES))
        out.append(_SYLLABLES[d])
        if not i and len(out) >= 2:
            return "".join(reversed(out))


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly `vocab` tokens: the special ones, then made-up words split on spaces."""
    table = {s: i for i, s in enumerate(SPECIALS)}
    table.update({word(i): len(SPECIALS) + i for i in range(vocab - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def prompt_ids(count: int, words: int, vocab: int, seed: int) -> torch.Tensor:
    """[count, words] ids of words drawn uniformly (no special token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIALS), vocab, (count, words), generator=g)


# ---- the models --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """What every model of the family shares (fp32, on the CPU)."""

    basis: torch.Tensor  # B [V, r], unit rows
    rotation: torch.Tensor  # M [r, r], orthogonal

    @classmethod
    def draw(cls, vocab: int, seed: int) -> Geometry:
        g = torch.Generator().manual_seed(seed)
        basis = torch.randn(vocab, RANK, generator=g)
        rotation, _ = torch.linalg.qr(torch.randn(RANK, RANK, generator=g))
        return cls(basis / basis.norm(dim=1, keepdim=True), rotation)

    def bigram(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [...]: the bare map's next token after each (the special tokens never)."""
        scores = (self.basis[ids.cpu()] @ self.rotation.T) @ self.basis.T  # [..., V]: b_j . (M b_x)
        scores[..., : len(SPECIALS)] = float("-inf")
        return scores.argmax(-1)


def llama_config(shape: Shape, vocab: int, max_context: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads or shape.heads,
        max_position_embeddings=max_context, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip


@torch.no_grad()
def build(shape: Shape, geometry: Geometry, recipe: Recipe, seed: int) -> LlamaForCausalLM:
    """A model of `shape` on the recipe's device and dtype, its embedding and head in the family's geometry,
    its other weights as Hugging Face initialises them (the branches to be scaled by `calibrate`)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[recipe.dtype])
    try:
        with torch.device(recipe.device):
            model = LlamaForCausalLM(llama_config(shape, recipe.vocab, recipe.max_context)).eval()
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(seed)
    projection, _ = torch.linalg.qr(torch.randn(shape.hidden, RANK, generator=g))  # [h, r], orthonormal columns
    embedding = geometry.basis @ projection.T  # [V, h]
    head = (recipe.logit_scale / math.sqrt(shape.hidden)) * (geometry.basis @ geometry.rotation) @ projection.T
    head[: len(SPECIALS)] = 0
    model.model.embed_tokens.weight.copy_(embedding)
    model.lm_head.weight.copy_(head)
    return model


@torch.inference_mode()
def top1(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [n, L] -> [n, L]: the model's top token after each prefix, special tokens left out."""
    logits = model(input_ids=ids.to(model.device)).logits.float()  # [n, L, V]
    logits[..., : len(SPECIALS)] = float("-inf")
    return logits.argmax(-1).cpu()


def agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a == b)[mask].float().mean().item()


def calibration_prompts(recipe: Recipe) -> torch.Tensor:
    """[n, P] the calibration's own prompts (another draw than the prompt set's)."""
    return prompt_ids(recipe.calibration_prompts, recipe.prompt_words, recipe.vocab, recipe.seed + CALIBRATION_SEED)


@torch.inference_mode()
def continued(target: LlamaForCausalLM, prompts: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy continuations of `prompts`: ([n, P + C] ids, [n, P + C] the positions whose next token
    is the target's, where agreement is measured)."""
    device = target.device
    ids = target.generate(
        input_ids=prompts.to(device), attention_mask=torch.ones_like(prompts, device=device), do_sample=False,
        max_new_tokens=recipe.continuation, min_new_tokens=recipe.continuation, suppress_tokens=list(range(len(SPECIALS))),
    ).cpu()  # fmt: skip
    answers = torch.zeros_like(ids, dtype=torch.bool)
    answers[:, recipe.prompt_words - 1 : -1] = True
    return ids, answers


def pairwise(shapes: Sequence[str], said: dict[str, torch.Tensor], answers: torch.Tensor) -> dict[str, float]:
    """Each two models' agreement on what they said at the `answers` positions, as 'a~b'."""
    return {f"{a}~{b}": agreement(said[a], said[b], answers) for a, b in itertools.combinations(shapes, 2)}


@torch.inference_mode()
def calibrate(model: LlamaForCausalLM, ids: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, rate: float,
              steps: int = 16) -> tuple[float, float]:  # fmt: skip
    """Scale the model's branches by the multiplier (10^-7 .. 10) whose top-1 agreement with `reference`
    over the `mask`ed positions of `ids` is closest to `rate` (bisected: agreement falls as branches grow);
    -> (the multiplier, the agreement it measured)."""
    branches = [p for n, p in model.named_parameters() if n.endswith(BRANCHES)]
    initial = [p.detach().clone() for p in branches]

    def measure(log_k: float) -> float:
        for p, p0 in zip(branches, initial):
            p.copy_(p0 * 10.0**log_k)
        return agreement(top1(model, ids), reference, mask)

    lo, hi = -7.0, 1.0
    found = {}
    for _ in range(steps):
        mid = (lo + hi) / 2
        found[mid] = measure(mid)
        lo, hi = (mid, hi) if found[mid] > rate else (lo, mid)
    best = min(found, key=lambda k: abs(found[k] - rate))
    measured = measure(best)
    if abs(measured - rate) > 0.02:
        log.warning(
            "agreement %.3f is as near as the branches' scales come to %.3f (multiplier %.3g)", measured, rate, 10.0**best
        )
    return 10.0**best, measured


@dataclass(frozen=True)
class Member:
    name: str  # its shape's, and its stage's
    parameters: int
    branch_scale: float  # the multiplier of its initial branches
    agreement: float  # measured while calibrating: the target's with the bigram map, a drafter's with the target
    asked: float


def build_family(out: Path, recipe: Recipe) -> dict:
    """Build, calibrate and save the family, its configs and its prompt set under `out`; -> family.json's contents."""
    recipe.check()
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    began = time.perf_counter()
    geometry = Geometry.draw(recipe.vocab, recipe.seed)
    calib = calibration_prompts(recipe)
    *drafter_shapes, target_shape = recipe.shapes
    target = build(SHAPES[target_shape], geometry, recipe, recipe.seed + MODEL_SEED + len(drafter_shapes))
    seconds["build target"] = time.perf_counter() - began

    began = time.perf_counter()
    everywhere = torch.ones_like(calib, dtype=torch.bool)
    scale, measured = calibrate(target, calib, geometry.bigram(calib), everywhere, recipe.ceiling)
    members = [Member(target_shape, target.num_parameters(), scale, measured, recipe.ceiling)]
    ids, answers = continued(target, calib, recipe)
    said = {target_shape: top1(target, ids)}
    seconds["calibrate target"] = time.perf_counter() - began

    tok = tokenizer(recipe.vocab)
    dirs = {target_shape: _save(target, tok, out / target_shape, seconds)}
    del target
    for i, (name, rate) in enumerate(zip(drafter_shapes, recipe.agreement)):
        began = time.perf_counter()
        drafter = build(SHAPES[name], geometry, recipe, recipe.seed + MODEL_SEED + i)
        scale, measured = calibrate(drafter, ids, said[target_shape], answers, rate)
        members.insert(i, Member(name, drafter.num_parameters(), scale, measured, rate))
        said[name] = top1(drafter, ids)
        seconds[f"build and calibrate {name}"] = time.perf_counter() - began
        dirs[name] = _save(drafter, tok, out / name, seconds)
        del drafter
    if recipe.device.startswith("cuda"):
        torch.cuda.empty_cache()

    pairs = pairwise(recipe.shapes, said, answers)  # teacher-forced top-1, over the target's continuations
    configs = [write_config(out, recipe, recipe.shapes[:k], dirs) for k in range(2, len(recipe.shapes) + 1)]
    prompts = write_prompts(out / "prompts.jsonl", tok, recipe)
    family = {
        "recipe": asdict(recipe), "members": [asdict(m) for m in members], "agreement": pairs,
        "configs": [str(c) for c in configs], "prompts": str(prompts), "seconds": seconds,
        "device": torch.cuda.get_device_name() if recipe.device.startswith("cuda") else recipe.device,
    }  # fmt: skip
    (out / "family.json").write_text(json.dumps(family, indent=1) + "\n")
    return family


def _save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, path: Path, seconds: dict[str, float]) -> Path:
    began = time.perf_counter()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    seconds[f"save {path.name}"] = time.perf_counter() - began
    return path.resolve()


def stage(name: str, path: Path, recipe: Recipe, target: bool) -> dict:
    """A stage of the configs: an actor of its own, on a GPU an eighth of it."""
    on_gpu = recipe.device.startswith("cuda")
    out = {"name": name, "kind": "causal_lm", "model": str(path), "dtype": recipe.dtype, "max_context": recipe.max_context}
    if not target:
        out["max_lookahead"] = recipe.lookahead
    if on_gpu:
        out.update(device="cuda", resources={"num_cpus": 1, "num_gpus": 0.125})
        if not target:
            out.update(min_width=8, max_width=8)  # one width: one CUDA graph to capture
    else:
        out.update(compile=False, resources={"num_cpus": 1})
    return out


def write_config(out: Path, recipe: Recipe, names: Sequence[str], dirs: dict[str, Path]) -> Path:
    config = {
        "name": "-".join(names),
        "stages": [stage(n, dirs[n], recipe, i == len(names) - 1) for i, n in enumerate(names)],
    }
    path = out / f"{config['name']}.yaml"
    path.write_text(f"# written by experiments.agreeing_family: random models that agree ({out / 'family.json'})\n"
                    + yaml.safe_dump(config, sort_keys=False))  # fmt: skip
    return path


def write_prompts(path: Path, tok: PreTrainedTokenizerFast, recipe: Recipe) -> Path:
    ids = prompt_ids(recipe.prompts, recipe.prompt_words, recipe.vocab, recipe.seed + PROMPT_SEED)
    lines = [
        json.dumps({"question_id": i, "category": "random words", "turns": [tok.decode(row.tolist())]})
        for i, row in enumerate(ids)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def measure(out: Path, family: dict, device: str | None = None) -> dict[str, float]:
    """The saved models, loaded back with `from_pretrained`: each two's teacher-forced top-1 agreement over
    the target's continuations of the calibration prompts (as `build_family` measured them before saving)."""
    recipe = Recipe(**{**family["recipe"], "shapes": tuple(family["recipe"]["shapes"]),
                       "agreement": tuple(family["recipe"]["agreement"])})  # fmt: skip
    device = device or recipe.device
    loaded = {n: AutoModelForCausalLM.from_pretrained(out / n, dtype=DTYPES[recipe.dtype]).to(device) for n in recipe.shapes}
    ids, answers = continued(loaded[recipe.shapes[-1]], calibration_prompts(recipe), recipe)
    return pairwise(recipe.shapes, {n: top1(m, ids) for n, m in loaded.items()}, answers)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--shapes", nargs="+", default=["cpu"], help=f"a set ({', '.join(SETS)}) or shapes, the target last: {', '.join(SHAPES)}"
    )
    parser.add_argument(
        "--agreement", type=float, nargs="+", help="per drafter, its agreement with the target (default 0.85 each)"
    )
    parser.add_argument("--ceiling", type=float, default=0.98, help="the target's agreement with the family's bigram map")
    parser.add_argument("--vocab", type=int, help="default: 32000 if a GPU shape is in the family, else 4096")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--lookahead", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_logged(parser, argv)
    shapes = SETS[args.shapes[0]] if len(args.shapes) == 1 and args.shapes[0] in SETS else tuple(args.shapes)
    vocab = args.vocab or (VOCAB["cpu"] if all(s.startswith("cpu") for s in shapes) else VOCAB["gpu"])
    recipe = Recipe(
        tuple(shapes), tuple(args.agreement or [0.85] * (len(shapes) - 1)), args.ceiling, vocab, args.device, args.dtype,
        args.prompts, lookahead=args.lookahead, max_context=args.max_context, seed=args.seed,
    )  # fmt: skip
    try:
        recipe.check()
    except ValueError as e:
        parser.error(str(e))
    family = build_family(args.out, recipe)
    for m in family["members"]:
        print(f"{m['name']:>6}: {m['parameters'] / 1e6:8.1f}M parameters, branches x{m['branch_scale']:.3g}, "
              f"agreement {m['agreement']:.3f} (asked {m['asked']})")  # fmt: skip
    print("teacher-forced top-1 agreement: " + ", ".join(f"{k} {v:.3f}" for k, v in family["agreement"].items()))
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in family["seconds"].items()))
    print("configs: " + " ".join(family["configs"]) + f"; prompts: {family['prompts']}")


if __name__ == "__main__":
    main()
