"""A tiny random Qwen3-MoE policy with the project's Qwen3-Coder-framed tokenizer, saved as a
real Hugging Face checkpoint directory (config.json + safetensors + tokenizer).

The same architecture code path as the 30B model, a few hundred thousand parameters: what
the CPU default recipe (``recipes/tiny_cpu.yaml``) and smoke runs train when no trained base
model is given. Its outputs are random text; it exercises the machinery, not the method.

    python -m megatron_tg.models.tiny --out models/tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY_QWEN3_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                      intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False)


def build_tiny_policy(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint + tokenizer to ``out_dir`` (reused when already complete)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_tg.chat import get_tiny_tokenizer

    out = Path(out_dir)
    stamp = out / "tiny_policy.json"
    want = {"seed": seed, **TINY_QWEN3_MOE}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    tok = get_tiny_tokenizer()
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3MoeConfig(vocab_size=len(tok), eos_token_id=eos, pad_token_id=tok.pad_token_id,
                         **TINY_QWEN3_MOE)
    out.mkdir(parents=True, exist_ok=True)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    stamp.write_text(json.dumps(want))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to write the checkpoint to")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build_tiny_policy(args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
