"""Small random vision-language models of every family the `vlm` stage serves, built from configs.

Each family module (llava.py, llava_next.py, idefics3.py, qwen2_vl.py, gemma3.py, mistral3.py) has
`build(out, seed) -> Path`: a model of that Hugging Face class with random weights and a tiny vision
tower, saved with its processor, chat template and a tokenizer trained here (the family's special
tokens added), so that `AutoModelForImageTextToText` and `AutoProcessor` load it back from disk.

`build_zoo_family(name, out)` adds text drafters sharing the tokenizer: `tiny` (1 layer, noisier)
and `mid` (2 layers), whose embeddings and LM head are copied from the VLM's language model. The VLM's
residual branches are kept smallish, so its next token is mostly a function of the current one and
the drafters agree with it often (`mid` ~80-90%, `tiny` less), but not always (rollbacks get exercised), and the image
still changes the answer. `mid` pads its
embedding table differently from the target, so the pipeline's vocabulary masking is exercised too.

    python -m experiments.vlm_zoo qwen2_vl /tmp/zoo    # -> /tmp/zoo/{target,mid,tiny}
"""

from __future__ import annotations

import argparse
import json
import importlib
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from experiments.toy_models import llama_config, train_tokenizer

FAMILIES = ("llava", "llava_next", "idefics3", "qwen2_vl", "gemma3", "mistral3")


def family_tokenizer(special_tokens: list[str], chat_template: str, seed: int = 0, **roles: str) -> PreTrainedTokenizerFast:
    """The toy BPE tokenizer with a family's special tokens and chat template.

    `roles` sets named special tokens (bos_token="<bos>", eos_token="<end_of_turn>", ...).
    """
    tok = train_tokenizer(seed=seed)
    new = [t for t in special_tokens if t not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": new})
    for role, token in roles.items():
        if token not in tok.get_vocab():
            tok.add_special_tokens({"additional_special_tokens": [token]})
        setattr(tok, role, token)
    tok.chat_template = chat_template
    return tok


def shrink_branches(model: torch.nn.Module, branch_std: float = 0.15, seed: int = 0) -> None:
    """Strong embeddings, smaller residual branches in the language model (see toy_models.random_llama).

    At 0.15 (hidden 64) the image changes the answer and a text drafter agrees ~80% of the time.
    """
    g = torch.Generator().manual_seed(seed)
    decoder = model.get_decoder()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=g)
        for name, p in decoder.named_parameters():
            if p.dim() == 2 and name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, branch_std, generator=g)
        head = model.get_output_embeddings()
        if head.weight is not model.get_input_embeddings().weight:
            head.weight.normal_(0.0, 1.0, generator=g)


def text_drafter(vlm: torch.nn.Module, layers: int, vocab_size: int, seed: int, branch_std: float) -> LlamaForCausalLM:
    """A Llama with the VLM's text embeddings and LM head (first `vocab_size` rows, zero-padded).

    Its own residual branches (`branch_std`) set how often it disagrees with the VLM.
    """
    embed = vlm.get_input_embeddings().weight.detach()  # [V_target, H]
    head = vlm.get_output_embeddings().weight.detach()  # [V_target, H]
    hidden = embed.shape[1]
    config = llama_config(vocab_size, hidden=hidden, layers=layers, heads=4)
    config.max_position_embeddings = 4096
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    n = min(vocab_size, embed.shape[0])
    scale = float(getattr(vlm.get_input_embeddings(), "embed_scale", 1.0))  # Gemma scales embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, branch_std)
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:n] = embed[:n] * scale
        model.lm_head.weight.zero_()
        model.lm_head.weight[:n] = head[:n]
    return model


def save_vlm(model: torch.nn.Module, processor, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def save_vlm_parts(
    model: torch.nn.Module, image_processor, tokenizer, processor_class: str, out: Path, **processor_settings
) -> Path:
    """Save a VLM whose processor cannot be built here (it wants torchvision): its parts and class name."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    image_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)  # with the chat template
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor_class, **processor_settings}))
    return out


def build_zoo_family(family: str, out: Path, seed: int = 0) -> dict[str, Path]:
    """-> {"target": VLM dir, "mid": 2-layer text drafter dir, "tiny": 1-layer text drafter dir}."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    out = Path(out)
    module = importlib.import_module(f"experiments.vlm_zoo.{family}")
    target = module.build(out / "target", seed=seed)
    vlm = AutoModelForImageTextToText.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    paths = {"target": target}
    vocab = vlm.get_output_embeddings().out_features
    for name, layers, size, branch_std in (("tiny", 1, vocab, 0.3), ("mid", 2, len(tokenizer) + 3, 0.05)):
        path = out / name
        text_drafter(vlm, layers, size, seed + layers, branch_std).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in build_zoo_family(args.family, args.out, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
