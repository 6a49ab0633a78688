"""A model's shape from its transformers config (offline: a ``config.json``, its folder, or a Hub name already in the
local cache), and a rough count of the activations one micro-batch keeps for its backward.

The parameter count is the model's own: it is built on the meta device (no memory, no weights) from the config,
as accelerate's ``estimate-memory`` does, and its parameters counted once each (tied embeddings once).

Activations, bytes per token of a micro-batch (``h`` hidden size, ``i`` the MLP's intermediate size, ``V`` the
vocabulary, ``L`` layers; bf16 weights or autocast, attention by SDPA, which keeps no scores)::

    per layer          2 (14 h + 7 i)         the tensors a decoder layer saves for its backward
    outside the layers 5 V + 13 h             the logits and the loss's fp32 copies, the embeddings
    no checkpointing   L * per layer + outside
    checkpointing      L * 2 h + per layer + outside   each layer's input, and one layer recomputed at a time

The constants were measured on transformers' Llama on CPU (the bytes ``torch.autograd.graph.saved_tensors_hooks``
sees in a bf16 forward; ``tests/test_memory.py`` holds the formula to it within 20 % on another shape). Other
architectures (GPT-2's GELU MLP, MoE) differ: a rough figure, for a verdict, not a budget.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    params: int  # every parameter, tied ones once
    hidden: int
    layers: int
    intermediate: int
    vocab: int


def _field(config: object, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def shape_from_config(path: str | Path) -> Shape:
    """The shape of the causal LM a config describes (``path``: a ``config.json``, its folder, or a Hub name in the
    local cache; read offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    given = Path(path)
    folder = given.parent if given.is_file() else given
    try:  # a folder, its config.json, or a Hub name already in the local cache (never downloaded)
        config = AutoConfig.from_pretrained(folder if folder.exists() else str(path), local_files_only=True)
    except OSError:
        raise ValueError(
            f"--config: no config.json at {path}, and no such model in the local Hugging Face cache. Pass a model "
            "folder, its config.json, or the name of a model you have downloaded."
        ) from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # (parameters() yields a tied weight once)
    hidden = _field(config, "hidden_size", "n_embd", "d_model")
    layers = _field(config, "num_hidden_layers", "n_layer", "num_layers")
    if hidden is None or layers is None:
        raise ValueError(f"--config: {type(config).__name__} names no hidden size or layer count")
    intermediate = _field(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    return Shape(params, hidden, layers, intermediate, _field(config, "vocab_size") or 0)


def layer_bytes_per_token(shape: Shape) -> int:
    return 2 * (14 * shape.hidden + 7 * shape.intermediate)


def activation_bytes(shape: Shape, tokens: int, checkpointing: bool) -> int:
    """Rough bytes one micro-batch of ``tokens`` tokens keeps for its backward (see the module's docstring)."""
    outside = 5 * shape.vocab + 13 * shape.hidden
    layers = shape.layers * (2 * shape.hidden) + layer_bytes_per_token(shape) if checkpointing else (
        shape.layers * layer_bytes_per_token(shape))  # fmt: skip
    return tokens * (layers + outside)


def shape_and_activations(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[Any, int | None]:
    """The model's shape from ``--config`` (its parameter count for ``--params`` when not given), and the rough
    activations of ``--micro_batch_size`` x ``--seq_len`` tokens."""
    if args.config is None:
        if args.params is None:
            p.error("state --params (trainable parameters) or --config (a transformers config.json)")
        if args.micro_batch_size is not None:
            p.error("--micro_batch_size (activations) needs --config: the model's hidden size and layers")
        return None, None
    try:
        shape = shape_from_config(args.config)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if args.params is None:
        args.params = float(shape.params)
    if args.micro_batch_size is None:
        return shape, None
    tokens = args.micro_batch_size * args.seq_len
    return shape, activation_bytes(shape, tokens, args.gradient_checkpointing)
