"""The embedded default: a tiny model, its tokenizer and a toy verifiable data set, made locally.

Nothing can be downloaded in tests or on an air-gapped laptop, so kuberl makes its own small
Hugging Face checkpoints with random weights: a dense Qwen2 and a Qwen3-MoE, both with
head_dim 64 (vLLM's CPU attention kernels reject smaller heads). The tokenizer is character-level,
which keeps the vocabulary small and makes the toy task (write the letter asked for) learnable by
GRPO within minutes on a CPU.

    python -m kuberl.driver.tiny /opt/kuberl/tiny   # model/, moe-model/, data/{repeat_letter,calculator}.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Padded to a multiple of 64: friendlier to GEMM kernels, and room for the special tokens.
VOCAB_SIZE = 128


def make_tokenizer(dst: Path):
    """A character-level fast tokenizer with a ChatML template, saved to ``dst``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARS])}
    assert len(vocab) <= VOCAB_SIZE
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        bos_token=None, chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(dst)
    return tokenizer


def _common_config(tokenizer) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )


def make_model(dst: str | Path, *, moe: bool = False, seed: int = 0) -> Path:
    """Save a tiny random-weight causal LM (dense Qwen2, or Qwen3-MoE) with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3MoeConfig

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(dst)
    common = _common_config(tokenizer)
    if moe:
        config = Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=64,
                                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                norm_topk_prob=True, output_router_logits=False)
    else:
        config = Qwen2Config(**common, intermediate_size=256)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(dst, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(dst)
    return dst


# Four letters: a random 2-layer model learns within a few dozen CPU steps to answer in them
# (reward 0.01 -> ~0.25); with all 26 the reward stays at chance for longer than a demo lasts.
LETTERS = "abcd"


def repeat_letter_rows(n: int, seed: int = 0, letters: str = LETTERS) -> list[dict[str, str]]:
    """Prompts asking for one letter; the reward is the share of response characters equal to it."""
    rng = random.Random(seed)
    return [{"prompt": f"Write the letter {letter}.", "answer": letter}
            for letter in (rng.choice(letters) for _ in range(n))]


def _write_rows(dst: str | Path, rows: list[dict]) -> Path:
    path = Path(dst)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_data(dst: str | Path, n: int = 512, seed: int = 0, letters: str = LETTERS) -> Path:
    return _write_rows(dst, repeat_letter_rows(n, seed, letters))


# Sums with a one-digit result in this set: four answers, as LETTERS has four letters.
RESULTS = "1234"


def calculator_rows(n: int, seed: int = 0, results: str = RESULTS) -> list[dict]:
    """The two-turn tool-use task (``kuberl.rollout.agents.calculator``): the question names a sum, the
    calculator gives its value, the answer is that digit."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        result = int(rng.choice(results))
        left = rng.randrange(result + 1)
        expression = f"{left}+{result - left}"
        rows.append({"prompt": f"{expression}? Use the calculator (=).", "answer": str(result),
                     "extra_info": {"expression": expression}})
    return rows


def make_calculator_data(dst: str | Path, n: int = 512, seed: int = 0) -> Path:
    return _write_rows(dst, calculator_rows(n, seed))


def make_all(root: str | Path) -> dict[str, Path]:
    root = Path(root)
    return {
        "model": make_model(root / "model"),
        "moe_model": make_model(root / "moe-model", moe=True),
        "data": make_data(root / "data" / "repeat_letter.jsonl"),
        "calculator_data": make_calculator_data(root / "data" / "calculator.jsonl"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberl.driver.tiny", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="directory to create model/, moe-model/ and data/ in")
    args = parser.parse_args(argv)
    for name, path in make_all(args.root).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
