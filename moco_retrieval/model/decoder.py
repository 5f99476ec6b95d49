"""Decoder (LLM) backbones: last-token pooling and the end-of-text token it reads.

A causal decoder's last token is the only one that has seen the whole text, so ``pooling=last``
embeds a text as the hidden state of its last non-padding token (GritLM, LLM2Vec, Qwen3-Embedding
style); that token is an end-of-text token appended to every text (:func:`append_eos`), which
the tokenizer itself appends, so sentence-transformers (which runs the saved tokenizer) gets the
same tokens as training. Padding may be on either side (the tokenizer's ``padding_side``):
:func:`last_token` finds the last attended position per row.
"""
from __future__ import annotations

from typing import Any

import torch

from moco_retrieval.errors import ModelLoadError

PROBE = "a"  # any text: tokenized to see whether the tokenizer ends it with the end-of-text token


def last_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``hidden[b, t_b]`` where ``t_b`` is row b's last position with attention, float32 [B, H];
    right padding (``t_b`` = length - 1) and left padding (``t_b`` = L - 1) alike."""
    length = attention_mask.shape[1]
    last = length - 1 - attention_mask.flip(1).to(torch.int32).argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)].float()


def _ends_with_eos(tokenizer: Any) -> bool:
    ids = tokenizer(PROBE)["input_ids"]
    return bool(ids) and ids[-1] == tokenizer.eos_token_id


def append_eos(tokenizer: Any, where: str) -> Any:
    """``tokenizer``, made to end every text with its end-of-text token (kept when truncating) and
    to pad with it when it has no padding token. ``where`` names the folder, for errors."""
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"{where}: the tokenizer has no end-of-text (eos) token, which model.pooling=last reads")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if _ends_with_eos(tokenizer):
        return tokenizer
    if hasattr(tokenizer, "add_eos_token"):  # Llama-style: a saved setting, re-applied when loaded
        tokenizer.add_eos_token = True
    if not _ends_with_eos(tokenizer):
        _template_with_eos(tokenizer)
    if not _ends_with_eos(tokenizer):
        raise ModelLoadError(f"{where}: could not make the tokenizer append its end-of-text token "
                             f"{tokenizer.eos_token!r} (model.pooling=last)")
    return tokenizer


def _template_with_eos(tokenizer: Any) -> None:
    """The fast tokenizer's post-processor set to ``[bos] $A eos`` (its beginning token kept
    when it adds one); saved in tokenizer.json."""
    from tokenizers import processors

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError("model.pooling=last needs a fast (tokenizers) tokenizer to append the end-of-text token")
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    specials = [(eos, eos_id)]
    single = f"$A:0 {eos}:0"
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is not None and tokenizer(PROBE)["input_ids"][:1] == [bos_id]:
        single = f"{tokenizer.bos_token}:0 {single}"
        specials.append((tokenizer.bos_token, bos_id))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} $B:1 {eos}:1",
                                                           special_tokens=list(dict.fromkeys(specials)))


__all__ = ["append_eos", "last_token"]
