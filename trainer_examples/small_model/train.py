"""Train a small real ``qwen3_moe`` on the Python standard library's sources (issue 38, item 5).

Acceptance of speculative drafts, FP8 logprob error and the live-RL example need a model whose
outputs mean something; random weights do not. This script makes one from text that ships on every
machine, deterministically from its seed:

1. **Data.** Every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (not ``site-packages``, not
   ``test`` / ``tests`` / ``idlelib`` / ``encodings`` directories), ordered by the SHA-1 of the relative path (a fixed
   order that mixes packages). A file is held out when that hash's first byte is < 16 (~6%).
   Each file becomes one chat-like multi-turn document: its lines cut into chunks of 3-30 lines
   (a per-file seeded RNG), given in turn to ``<|user|>``, ``<|assistant|>``, ``<|tool|>``,
   ``<|assistant|>``, ``<|tool|>``, ... each closed by ``<|end|>``, the document by
   ``<|endoftext|>``. So an assistant turn continues the code it was shown and ends itself.
2. **Tokenizer.** Byte-level BPE (the ``tokenizers`` library) on the first ``--tokenizer-mb`` of
   the training files, ``--vocab`` ids, special tokens first: ``<|endoftext|>`` (0, EOS),
   ``<|user|>``, ``<|assistant|>``, ``<|tool|>``, ``<|end|>`` (4, ends a turn), ``<|pad|>``.
   Saved as a Hugging Face tokenizer (``AutoTokenizer.from_pretrained(out)`` works).
3. **Model.** ``transformers.Qwen3MoeForCausalLM`` (defaults: hidden 256, 4 layers, 8 experts
   top-2 with ``norm_topk_prob``, expert intermediate 192, 4 heads / 2 KV heads of 64, untied head,
   vocab 4096: 7.6M parameters, 15.3 MB in bf16), trained with plain PyTorch: AdamW, linear
   warm-up then cosine to 10%, gradient clipping, the router's load-balancing loss as transformers
   adds it (``output_router_logits``, ``router_aux_loss_coef``), on packed ``--seq-len`` windows of
   the token stream drawn by a seeded generator.
4. **Output** (``--out``): ``config.json``, ``generation_config.json`` (EOS ids: ``<|end|>``,
   ``<|endoftext|>``), ``model.safetensors`` (bf16), the tokenizer files, ``heldout_sample.txt``
   (the start of the held-out documents, for a quick loss check) and ``recipe.json`` (every
   hyper-parameter, the seed, the Python version, the SHA-256 of the data file list and of the
   data, the loss curve, the final train / held-out loss, the wall time).

    python trainer_examples/small_model/train.py --out tests/data/small_qwen3_moe            # CPU
    python trainer_examples/small_model/train.py --out /tmp/small --device cuda              # GPU: more steps
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<|pad|>"]
EOS, END, PAD = "<|endoftext|>", "<|end|>", "<|pad|>"
ROLES = ["<|user|>", "<|assistant|>", "<|tool|>"]
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "encodings"}
"""Not trained on: third-party packages, test suites, and ``encodings`` (117 files, mostly generated
codec tables: near-free to predict, they would flatter the loss and the draft acceptance)."""

# per device: (steps, batch, seq_len, lr)
DEVICE_DEFAULTS = {"cpu": (500, 16, 256, 3e-3), "cuda": (1000, 32, 512, 2e-3)}


# ------------------------------------------------------------------------------------ data
def stdlib_files(root: Path) -> list[tuple[str, Path, bool]]:
    """(relative path, path, held out?) of the stdlib's sources, ordered by SHA-1 of the relative path."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]):
            continue
        h = hashlib.sha1(rel.encode()).digest()
        out.append((h, rel, p))
    out.sort()
    return [(rel, p, h[0] < 16) for h, rel, p in out]


def read_text(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def as_dialogue(rel: str, text: str, seed: int) -> str:
    """One file as a multi-turn document: chunks of 3-30 lines, roles user, assistant, tool, assistant, ..."""
    rng = random.Random(f"{seed}:{rel}")
    lines = text.splitlines(keepends=True)
    parts, i, turn = [], 0, 0
    while i < len(lines):
        n = rng.randint(3, 30)
        role = ROLES[0] if turn == 0 else ROLES[1 + (turn - 1) % 2]
        parts.append(f"{role}\n{''.join(lines[i:i + n])}{END}")
        i, turn = i + n, turn + 1
    return "".join(parts) + EOS


def heldout_sample(held_docs: list[tuple[str, str]], seed: int, chars: int, pieces: int = 8) -> str:
    """``pieces`` stretches of the held-out documents, ``chars`` characters in all, at evenly spaced
    offsets of their concatenation (as the held-out loss's windows are spread), each from a line start."""
    text = "".join(as_dialogue(rel, t, seed) for rel, t in held_docs)
    n = chars // pieces
    out = []
    for i in range(pieces):
        at = text.find("\n", i * (len(text) - n) // pieces) + 1
        out.append(text[at:at + n])
    return "".join(out)


# ------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                 additional_special_tokens=SPECIAL[1:5], model_max_length=2048)
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"             # the class name transformers 4 and 5 both load
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return hf


# ------------------------------------------------------------------------------------ model
def make_model(a, tok):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    ids = tok.convert_tokens_to_ids
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, head_dim=a.head_dim, num_experts=a.experts, num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.expert_intermediate, intermediate_size=4 * a.expert_intermediate,
        norm_topk_prob=True, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=a.aux_coef,
        eos_token_id=[ids(END), ids(EOS)], pad_token_id=ids(PAD), bos_token_id=None)
    torch.manual_seed(a.seed)
    return Qwen3MoeForCausalLM(cfg)


def lr_at(step: int, a) -> float:
    warm = max(1, a.steps // 20)
    if step < warm:
        return a.lr * (step + 1) / warm
    t = (step - warm) / max(1, a.steps - warm)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor, device: str, batch: int) -> float:
    """Mean next-token cross-entropy (nats, no auxiliary loss) over ``windows`` [N, T]."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(x, use_cache=False, output_router_logits=False).logits.float()
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                               reduction="sum")
        tot, n = tot + float(ce), n + x[:, 1:].numel()
    model.train()
    return tot / n


def windows_of(ids: list[int], T: int) -> torch.Tensor:
    n = len(ids) // T
    return torch.tensor(ids[:n * T], dtype=torch.long).view(n, T)


# ------------------------------------------------------------------------------------ main
def build_data(a):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    train, held, listing = [], [], hashlib.sha256()
    data_hash = hashlib.sha256()
    for rel, p, is_held in files:
        text = read_text(p)
        if text is None or not text.strip():
            continue
        listing.update(f"{rel}\n".encode())
        data_hash.update(text.encode())
        (held if is_held else train).append((rel, text))
    return root, train, held, listing.hexdigest(), data_hash.hexdigest()


def take_mb(docs: list[tuple[str, str]], mb: float) -> list[tuple[str, str]]:
    out, size = [], 0
    for rel, text in docs:
        if size >= mb * 1e6:
            break
        out.append((rel, text))
        size += len(text)
    return out


def train(a) -> dict:
    t_start = time.time()
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    root, train_docs, held_docs, list_hash, data_hash = build_data(a)
    tok = train_tokenizer([t for _, t in take_mb(train_docs, a.tokenizer_mb)], a.vocab, out)
    t_tok = time.time() - t_start
    used = take_mb(train_docs, a.train_mb)
    enc = lambda docs: [i for e in tok.backend_tokenizer.encode_batch([as_dialogue(rel, t, a.seed) for rel, t in docs])
                        for i in e.ids]
    train_ids, held_ids = enc(used), enc(take_mb(held_docs, a.heldout_mb))
    (out / "heldout_sample.txt").write_text(heldout_sample(held_docs, a.seed, a.sample_chars))
    train_w, held_w = windows_of(train_ids, a.seq_len), windows_of(held_ids, a.seq_len)
    held_w = held_w[torch.linspace(0, len(held_w) - 1, min(a.eval_windows, len(held_w))).long()]   # spread over the files
    eval_train_w = train_w[torch.randperm(len(train_w), generator=torch.Generator().manual_seed(a.seed + 1))[:a.eval_windows]]
    print(f"stdlib {root}: {len(train_docs)} train / {len(held_docs)} held-out files; using {len(used)} files, "
          f"{len(train_ids)} train tokens ({len(train_w)} windows of {a.seq_len}), {len(held_ids)} held-out tokens; "
          f"tokenizer {t_tok:.0f}s, {sum(len(t) for _, t in used) / max(1, len(train_ids)):.2f} chars/token", flush=True)

    model = make_model(a, tok).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(a.seed)
    order, pos, curve = torch.randperm(len(train_w), generator=g), 0, []
    print(f"model: {n_params / 1e6:.2f}M parameters; {a.steps} steps x {a.batch} x {a.seq_len} tokens on {a.device}",
          flush=True)
    model.train()
    t0 = time.time()
    for step in range(a.steps):
        if pos + a.batch > len(order):
            order, pos = torch.randperm(len(train_w), generator=g), 0
        x = train_w[order[pos:pos + a.batch]].to(a.device)
        pos += a.batch
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, a)
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.device == "cuda"):
            o = model(x, labels=x, use_cache=False)
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        if step % a.log_every == 0 or step == a.steps - 1:
            aux = float(o.aux_loss.detach())
            ce = float(o.loss.detach()) - a.aux_coef * aux
            curve.append({"step": step, "loss": round(ce, 4), "aux": round(aux, 4),
                          "lr": lr_at(step, a), "s": round(time.time() - t0, 1)})
            print(f"step {step:5d}  loss {ce:.4f}  aux {aux:.4f}  lr {lr_at(step, a):.2e}  "
                  f"{time.time() - t0:6.0f}s", flush=True)
    train_s = time.time() - t0
    final_train, final_held = eval_loss(model, eval_train_w, a.device, a.batch), eval_loss(model, held_w, a.device, a.batch)
    print(f"final: train loss {final_train:.4f}  held-out loss {final_held:.4f}  (uniform {math.log(a.vocab):.4f}); "
          f"training {train_s:.0f}s", flush=True)
    save(model, tok, out)
    recipe = {
        "script": "trainer_examples/small_model/train.py", "argv": sys.argv[1:], "args": vars(a),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "tokenizers": __import__("tokenizers").__version__,
        "stdlib": str(root), "skip_dirs": sorted(SKIP_DIRS), "heldout_rule": "sha1(relpath)[0] < 16",
        "file_list_sha256": list_hash, "data_sha256": data_hash,
        "train_files": len(train_docs), "heldout_files": len(held_docs), "train_files_used": len(used),
        "train_tokens": len(train_ids), "heldout_tokens": len(held_ids), "tokens_seen": a.steps * a.batch * a.seq_len,
        "parameters": n_params, "special_tokens": SPECIAL,
        "final_train_loss": round(final_train, 4), "final_heldout_loss": round(final_held, 4),
        "uniform_loss": round(math.log(a.vocab), 4), "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1), "loss_curve": curve,
    }
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    return recipe


def save(model, tok, out: Path) -> None:
    from transformers import GenerationConfig
    model.config.output_router_logits = False
    model = model.to("cpu", torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    eos = model.config.eos_token_id
    GenerationConfig(eos_token_id=eos, pad_token_id=model.config.pad_token_id, do_sample=False).save_pretrained(out)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, default=192)
    ap.add_argument("--tokenizer-mb", type=float, default=3.0, help="training text the tokenizer learns from")
    ap.add_argument("--train-mb", type=float, help="training text (MB of source, in file order) the model sees")
    ap.add_argument("--heldout-mb", type=float, default=100.0, help="held-out text evaluated (default: all of it)")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--sample-chars", type=int, default=8000)
    ap.add_argument("--log-every", type=int, default=20)
    a = ap.parse_args(argv)
    steps, batch, seq, lr = DEVICE_DEFAULTS[a.device]
    a.steps, a.batch, a.seq_len, a.lr = a.steps or steps, a.batch or batch, a.seq_len or seq, a.lr or lr
    a.train_mb = a.train_mb or (4.0 if a.device == "cpu" else 12.0)
    return a


def main(argv=None) -> None:
    a = parse(argv)
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    train(a)


if __name__ == "__main__":
    main()
