"""A tiny random-weight Llama that tests create: 4 attention heads and 2 KV heads, so it
splits over 1, 2 or 4 tensor-parallel ranks (the default model's 9 heads split over
none), with the default model's tokenizer, saved as an HF-format folder."""

from __future__ import annotations

from pathlib import Path

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def make_tiny_llama(dest: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the model to `dest` (kept if already there) and return `dest`."""
    if (dest / "config.json").is_file():
        return dest
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    config = LlamaConfig(
        **SHAPE, vocab_size=len(tokenizer), max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, torch_dtype="float32",
        # Wider than the default 0.02: sharper next-token distributions, so greedy
        # choices are rarely near-ties that summation order could flip.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(dest)
    return dest
