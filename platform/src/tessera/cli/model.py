"""``tessera model``: make the small offline model."""

from __future__ import annotations

from pathlib import Path

import typer

model_app = typer.Typer(no_args_is_help=True, help="Models served locally.")


@model_app.command("make-small")
def make_small(
    out_dir: Path = typer.Argument(..., help="Directory to write the model into."),
    hidden_size: int = typer.Option(128, help="Model width."),
    layers: int = typer.Option(2, help="Decoder layers."),
    heads: int = typer.Option(4, help="Query heads."),
    kv_heads: int = typer.Option(2, help="KV heads."),
    intermediate_size: int = typer.Option(256, help="MLP width."),
    vocab_size: int = typer.Option(1024, help="Tokenizer vocabulary size."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
) -> None:
    """Write a random-weight Llama model and a trained tokenizer (Hugging Face layout)."""
    # NOTE: imported here, not at the top: writing the model needs torch, transformers and tokenizers.
    from tessera.engine.small_model import SmallModelSpec, make_small_model

    spec = SmallModelSpec(
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        seed=seed,
    )
    made = make_small_model(out_dir, spec)
    typer.echo(f"wrote {made.path} ({spec.num_hidden_layers} layers, width {spec.hidden_size})")
