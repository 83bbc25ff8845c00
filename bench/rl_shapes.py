"""Random-weight models at real models' shapes, with a locally made tokenizer of the same
vocabulary size, and prompts of an exact token length: what bench/rl_gpu.py runs on, since
nothing can be downloaded.

The tokenizer is a byte-level BPE (as Qwen's is) whose vocabulary is the 256 byte symbols, every
pair of them, then pairs extended by one byte, up to the model's regular vocabulary, plus Qwen's
special tokens and its ChatML template. Its speed and the detokenizer's work per token are
therefore those of a real 152k-entry byte-level BPE, which is what the engines' incremental
detokenization and the driver's decoding pay for.

    python bench/rl_shapes.py /tmp/qwen-shape --preset qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# Qwen2.5-1.5B's config (hidden 1536, 28 layers, GQA 12/2, tied embeddings, 151936 rows) and a
# small preset of the same family for a CPU smoke run of the bench.
PRESETS = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, regular_tokens=151643,
                         max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096, regular_tokens=4000,
                  max_position_embeddings=4096, rope_theta=10_000.0, tie_word_embeddings=True),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_tokenizer(dst: Path, regular_tokens: int):
    """A byte-level BPE with ``regular_tokens`` entries (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The space symbol and the letters first, so that even a small vocabulary has "Ġ" + letter
    # (prompt_of_length's one-token words).
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (c != "Ġ", c not in LETTERS, c))
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    pairs = [a + b for a in alphabet for b in alphabet]
    for left, right in [(p[0], p[1]) for p in pairs] + [(p, c) for p in pairs for c in alphabet]:
        if len(vocab) >= regular_tokens:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(dst)
    return tokenizer


def make_model(dst: str | Path, preset: str = "qwen2.5-1.5b", seed: int = 0) -> Path:
    """Save a random-weight Qwen2 causal LM of ``preset``'s shape (bf16 on a GPU, else fp32)
    with its tokenizer; a no-op when ``dst`` already holds one."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    dst = Path(dst)
    if (dst / "config.json").exists() and (dst / "tokenizer.json").exists():
        return dst
    shape = dict(PRESETS[preset])
    regular = shape.pop("regular_tokens")
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(dst, regular)
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    config = Qwen2Config(**shape, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, torch_dtype=dtype, use_cache=False)
    torch.manual_seed(seed)
    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.save_pretrained(dst, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(dst)
    del model
    return dst


def prompt_of_length(tokenizer, tokens: int, rng: random.Random) -> str:
    """A user message whose chat prompt (template and generation prompt included) is exactly
    ``tokens`` tokens: single letters separated by spaces are one token each ("a", "Ġb", ...)."""
    def length(text: str) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    overhead = length("a") - 1
    letters = tokens - overhead
    if letters < 1:
        raise ValueError(f"a {tokens}-token prompt is shorter than the chat template's {overhead + 1} tokens")
    text = " ".join(rng.choice(LETTERS) for _ in range(letters))
    got = length(text)
    if got != tokens:
        raise AssertionError(f"prompt of {got} tokens, wanted {tokens}: the tokenizer merged across letters")
    return text


def make_data(dst: str | Path, tokenizer, prompts: int, prompt_tokens: int, seed: int = 0) -> Path:
    """``prompts`` rows of exactly ``prompt_tokens`` chat tokens each; the answer is a letter
    (kuberl's ``repeat_letter`` reward scores it, cheaply)."""
    rng = random.Random(seed)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": prompt_of_length(tokenizer, prompt_tokens, rng), "answer": rng.choice(LETTERS)}
            for _ in range(prompts)]
    dst.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dst")
    parser.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    args = parser.parse_args(argv)
    print(make_model(args.dst, args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
