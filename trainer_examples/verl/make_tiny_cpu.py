"""The inputs of the CPU run of verl's ``main_ppo`` (``run_grpo_cpu.sh``): a tiny Qwen3-MoE built
with the installed transformers (random weights, saved as safetensors with its tokenizer) and a
GRPO dataset in verl's RLHFDataset parquet layout.

The tokenizer is word-level with Qwen's ChatML frame (``<|im_start|>``, ``<|im_end|>`` = EOS, ``\n``
one token, as verl's Qwen token builder requires) over the words ``t0 ..``; prompts are ``tK``
words, and the reward is verl's own gsm8k scorer (``data_source: openai/gsm8k``): a random model
scores 0, which GRPO handles (zero advantages).

    python -m trainer_examples.verl.make_tiny_cpu OUT_DIR   # writes OUT_DIR/model, OUT_DIR/{train,val}.parquet
"""
from __future__ import annotations

import argparse
import os
import random


SPECIAL = ["<|im_start|>", "<|im_end|>", "\n", "user", "assistant", "system", "tool", "<think>", "</think>"]


def chatml_word_tokenizer(vocab: int = 512):
    """Words ``t0 .. t{vocab-10}`` then :data:`SPECIAL`; ``t0`` is unknown / padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = vocab - len(SPECIAL)
    table = {f"t{i}": i for i in range(words)}
    table.update({w: words + i for i, w in enumerate(SPECIAL)})
    tk = Tokenizer(models.WordLevel(vocab=table, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("[ ]+"), behavior="removed"),
        pre_tokenizers.Split(Regex("\n"), behavior="isolated")])
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)     # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def build_model(path: str, vocab: int = 512, seed: int = 0) -> None:
    import torch
    import transformers

    tok = chatml_word_tokenizer(vocab)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, rope_theta=10000.0, eos_token_id=eos, pad_token_id=0,
        bos_token_id=None, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(path)
    tok.save_pretrained(path)


def build_data(out: str, n_train: int = 16, n_val: int = 4, seed: int = 0) -> None:
    import pandas as pd
    rng = random.Random(seed)

    def rows(n: int, split: str) -> list[dict]:
        out_rows = []
        for i in range(n):
            words = " ".join(f"t{rng.randrange(4, 500)}" for _ in range(rng.randrange(6, 14)))
            out_rows.append({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": words}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(rng.randrange(10))},
                "extra_info": {"split": split, "index": i},
            })
        return out_rows

    pd.DataFrame(rows(n_train, "train")).to_parquet(os.path.join(out, "train.parquet"))
    pd.DataFrame(rows(n_val, "test")).to_parquet(os.path.join(out, "val.parquet"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    build_model(os.path.join(args.out, "model"))
    build_data(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
