"""A small Llama-architecture model made offline: random weights and a byte-level BPE tokenizer trained
on a few built-in sentences. Deterministic from a seed, written in the Hugging Face layout vLLM loads.

Nothing can be downloaded from a model hub on the machines this runs on, so every test and ``make run``
serve a model made here. Random weights produce text that is meaningless but real: every token goes through
the real engine (prefill, KV cache, sampling, speculative decoding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# Enough varied text for a few hundred merges; the tokenizer only has to be real, not good.
_CORPUS = [
    "Tessera serves large language models to many tenants on one cluster.",
    "Every tenant has its own keys, limits, priority and share of the KV cache.",
    "The gateway routes each request to the engine most likely to hold its prefix.",
    "A KV cache stores the keys and values of every token the model has already seen.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Once upon a time there was a small model that answered every question with numbers.",
    "User: hello there, how are you today? Assistant: I am fine, thank you for asking.",
    "The scheduler preempts low priority requests when the cache runs out of free blocks.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April.",
    "def main(): print('hello world') return 0 if __name__ == '__main__': main()",
    "SELECT name, count(*) FROM tenants GROUP BY name ORDER BY count DESC LIMIT 10;",
    "Latency percentiles p50 p90 p99 describe the tail that users actually feel.",
]

# Chat template used by the gateway for /v1/chat/completions (the model has no real chat format).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


class SmallModelSpec(BaseModel):
    """Shape of the generated model. The default starts in seconds; raise sizes for realistic prefill cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(default=1024, ge=300, description="Tokenizer vocabulary (and embedding rows).")
    hidden_size: int = Field(default=128, ge=32, description="Model width.")
    intermediate_size: int = Field(default=256, ge=32, description="SwiGLU MLP width.")
    num_hidden_layers: int = Field(default=2, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(default=4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(default=2, ge=1, description="KV heads (GQA when below query heads).")
    max_position_embeddings: int = Field(default=8192, ge=128, description="Longest context, tokens.")
    torch_dtype: str = Field(default="bfloat16", description="Stored weight dtype.")
    seed: int = Field(default=0, description="Seed of the random weights.")


@dataclass(frozen=True, slots=True)
class SmallModel:
    path: Path
    spec: SmallModelSpec


def _train_tokenizer(vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repetition gives the trainer frequencies to merge on; the corpus is fixed, so the result is too.
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_small_model(out_dir: Path, spec: SmallModelSpec | None = None) -> SmallModel:
    """Writes config.json, model.safetensors and the tokenizer files into ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or SmallModelSpec()
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if spec.hidden_size % spec.num_attention_heads:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(spec.vocab_size, out_dir)
    actual_vocab = len(json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"])

    config = LlamaConfig(
        vocab_size=max(spec.vocab_size, actual_vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    dtype = getattr(torch, spec.torch_dtype)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "tessera-small.json").write_text(spec.model_dump_json(indent=2))
    return SmallModel(path=out_dir, spec=spec)


def is_small_model_dir(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "tokenizer.json").exists()
