"""The synthetic digit task of the GRPO workload: a tiny random-init causal LM, a digit
vocabulary, prompts and rewards, all built locally (nothing is downloaded).

A prompt is ``prompt_len`` random digits followed by ``=``; a completion is up to
``max_completion_length`` digits ending with ``<eos>``. Two rewards:

* ``target``: the share of completion digits equal to ``7`` (a policy learns it in a few dozen
  steps);
* ``copy``: the share of completion digits equal to the prompt's first digit (the model has to
  attend back to the prompt).

Needs ``transformers``, ``tokenizers`` and ``datasets`` (the ``conduit-rl[trl]`` extra); they are
imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

DIGITS = tuple(str(d) for d in range(10))
SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>", "=")
TARGET_DIGIT = "7"
TASKS = ("target", "copy")


def digit_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over the digit vocabulary (WordLevel, whitespace split).

    Token ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, ``=`` 4, digits 5-14.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + DIGITS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


HEADS = 4
"""Attention heads of :func:`tiny_llama`: its width must be a multiple of ``2 * HEADS``
(each head an even width, for the rotary position embedding)."""


def tiny_llama(*, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = HEADS,
               max_positions: int = 128, seed: int = 0) -> Any:
    """A random-init ``LlamaForCausalLM`` (hidden 64 and 2 layers: about 0.1 M parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=max_positions,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    return model


def prompt_dataset(*, n: int, prompt_len: int, seed: int) -> Any:
    """``n`` prompts of ``prompt_len`` random digits and ``=``, as a ``datasets.Dataset``."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 10, size=(n, prompt_len))
    prompts = [" ".join(str(d) for d in row) + " =" for row in digits]
    return Dataset.from_dict({"prompt": prompts})


def completion_digits(text: str) -> list[str]:
    """The digit tokens of a decoded completion (special tokens dropped)."""
    return [t for t in text.split() if t in DIGITS]


def reward_fn(task: str) -> Callable[..., list[float]]:
    """The TRL reward function of ``task`` (``completions`` are decoded strings).

    Raises:
        ValueError: Unknown task.
    """
    if task == "target":
        def target_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
            out = []
            for c in completions:
                d = completion_digits(c)
                out.append(sum(t == TARGET_DIGIT for t in d) / len(d) if d else 0.0)
            return out
        return target_reward
    if task == "copy":
        def copy_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
            out = []
            for p, c in zip(prompts, completions):
                d, first = completion_digits(c), p.split()[0]
                out.append(sum(t == first for t in d) / len(d) if d else 0.0)
            return out
        return copy_reward
    raise ValueError(f"task: must be one of {TASKS}, got {task!r}")
