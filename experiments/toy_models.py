"""Small Llama-style models with random weights, saved to disk with a tokenizer trained here.

No weights can be downloaded on our machines, so tests and engine benchmarks build their models
from configs: a BPE tokenizer trained in a second on an embedded corpus, and
`LlamaForCausalLM`s of a few sizes saved with `save_pretrained`, to be loaded back through the real
loading code. Random weights say nothing about quality; they exercise every code path.

Drafters made by `truncate` keep the target's embeddings, its first layers, norm and head (a
"layer-skip" drafter), so they agree with the target often, as a trained drafter would; an
independent random model agrees almost never. Tests use both.

    python -m experiments.toy_models OUT_DIR [--large]   # writes OUT_DIR/{target,tiny,mid,other}
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

_WORDS = (
    "the a red blue green small large circle square triangle star image shows there is are one two three "
    "four five left right top bottom center of and in on with near above below next to word reads color "
    "shape count how many what where describe picture background white black yellow purple orange big "
    "tiny bright dark line dot corner middle side each every some all no yes it this that which"
).split()


def corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(lines):
        n = int(torch.randint(4, 16, (1,), generator=g))
        idx = torch.randint(0, len(_WORDS), (n,), generator=g).tolist()
        out.append(" ".join(_WORDS[i] for i in idx) + ".")
    return out


def train_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed=seed), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama_config(vocab_size: int, hidden: int = 64, layers: int = 4, heads: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def random_llama(config: LlamaConfig, seed: int, branch_std: float = 0.005) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Strong embeddings and small residual branches (branch_std): each layer nudges the
        # prediction, so a drafter made of the first layers agrees with the whole model about half
        # the time (smaller branch_std: more often; wider models need a smaller one).
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 if "embed" in name else branch_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.15
                p.normal_(0.0, std)
    return model


def truncate(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A drafter made of the target's embeddings, first `layers` layers, final norm and head."""
    small = copy.deepcopy(model)
    small.model.layers = small.model.layers[:layers]
    small.config.num_hidden_layers = layers
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:layers]
    return small


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


LARGE_SIZES = dict(target_layers=12, hidden=512, branch_std=0.0003, mid_layers=3)  # target ~7.6 ms/token in bf16 here


def build_family(
    out: Path,
    seed: int = 0,
    target_layers: int = 8,
    hidden: int = 128,
    branch_std: float = 0.005,
    mid_layers: int | None = None,
) -> dict[str, Path]:
    """target, mid (its first layers: half by default), tiny (its first), other (independent)."""
    out = Path(out)
    tokenizer = train_tokenizer(seed=seed)
    vocab = len(tokenizer)
    heads = max(4, hidden // 64)
    target = random_llama(llama_config(vocab, hidden=hidden, layers=target_layers, heads=heads), seed, branch_std)
    return {
        "target": save(target, tokenizer, out / "target"),
        "mid": save(truncate(target, mid_layers or max(1, target_layers // 2)), tokenizer, out / "mid"),
        "tiny": save(truncate(target, 1), tokenizer, out / "tiny"),
        "other": save(random_llama(llama_config(vocab, hidden=32, layers=2), seed + 1), tokenizer, out / "other"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--large", action="store_true", help="a ~29M-parameter target instead of the tests' sizes")
    args = parser.parse_args()
    sizes = LARGE_SIZES if args.large else {}
    for name, path in build_family(args.out, args.seed, **sizes).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
