"""A tiny random BERT with a small WordPiece vocabulary, written to a folder (tests, smoke runs).

``build_tiny_bert(dir)`` writes ``config.json``, ``model.safetensors``, ``vocab.txt`` and the
tokenizer files, loadable with ``AutoModel.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)``. No download. The vocabulary holds the special tokens,
single characters (a-z, 0-9, ASCII punctuation), ``##`` continuation pieces for each of them and a
few common suffixes, so any ASCII English text tokenizes without ``[UNK]``, then a few hundred
whole words (a fixed list plus seeded pseudo-words). Same arguments, same files.

``build_tiny_decoder(dir, arch="llama"|"qwen2")``: a tiny random decoder (Llama or Qwen2
architecture) with the same vocabulary in a plain fast tokenizer, plus an end-of-text token
(``<|endoftext|>``, also the padding token; ``padding_side`` left or right): the decoder-backbone
path (model/decoder.py) without a download.
"""
from __future__ import annotations

import os
import random
import shutil
import string
import tempfile
from pathlib import Path
from typing import Iterable, Optional

import torch

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# Common English and package-description words (the Debian data set is about software).
BASE_WORDS = """
the of and to in is for a on with that this from by as be are or it an at which
not can you your all use used uses using new one two more other also its into
has have was will may when if than only such about over most some any each
file files data library libraries package packages tool tools program programs
system systems support supports server client network web user users version
development documentation module modules python perl ruby java rust go haskell
ocaml lisp shell script scripts command line interface graphical gui text editor
image images audio video sound music game games font fonts theme themes kernel
driver drivers firmware linux debian gnu free software source binary binaries
runtime shared static header headers dev doc dbg common utilities utility utils
test tests testing debug debugging plugin plugins extension extensions framework
database sql query queries search index indexing http https xml json yaml html
css javascript node api bindings binding wrapper compiler interpreter language
protocol format formats parser parsing library's manager management configuration
config settings service services daemon desktop window windows display screen
terminal console input output read write reading writing fast simple small large
based provides provide provided contains contain includes include including
implementation implements written c c++ toolkit engine backend frontend remote
local security secure crypto encryption password key keys certificate mail email
message messages chat voice camera printer print printing scanner backup archive
compression compress compressed zip tar storage disk filesystem memory cpu process
processes thread threads time date calendar math mathematical scientific science
statistics plot plotting graph graphs chart map maps geographic dictionary spell
translation translations language languages english german french data-set
transitional dummy metapackage meta virtual machine container cloud cluster
""".split()

SUFFIXES = ["s", "es", "ed", "ing", "er", "ers", "ly", "ion", "tion", "al", "ic", "able", "ment", "ness", "ity", "ize", "ive"]


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    consonants = "bcdfghjklmnprstvwz"
    vowels = "aeiou"
    out = []
    while len(out) < n:
        syllables = rng.randint(1, 3)
        word = "".join(rng.choice(consonants) + rng.choice(vowels) + (rng.choice(consonants) if rng.random() < 0.4 else "") for _ in range(syllables))
        out.append(word)
    return out


def tiny_vocab(vocab_words: Optional[Iterable[str]] = None, seed: int = 0, n_pseudo: int = 200) -> list[str]:
    """The token list, in id order: specials, characters, ``##`` pieces, words (deduplicated)."""
    chars = list(string.ascii_lowercase) + list(string.digits) + list(string.punctuation)
    tokens = list(SPECIAL_TOKENS)
    tokens += chars
    tokens += ["##" + c for c in string.ascii_lowercase + string.digits]
    tokens += ["##" + s for s in SUFFIXES]
    words = [w for w in BASE_WORDS if w.isalnum()]
    words += _pseudo_words(random.Random(seed), n_pseudo)
    if vocab_words is not None:
        words += [w.lower() for w in vocab_words]
    tokens += words
    seen: set[str] = set()
    ordered = []
    for t in tokens:
        if t and t not in seen and not any(ch.isspace() for ch in t):
            seen.add(t)
            ordered.append(t)
    return ordered


def build_tiny_bert(
    directory: str | os.PathLike,
    hidden: int = 32,
    layers: int = 2,
    vocab_words: Optional[Iterable[str]] = None,
    seed: int = 0,
    heads: Optional[int] = None,
    max_position: int = 512,
) -> Path:
    """Write a tiny random ``BertModel`` and its WordPiece tokenizer into ``directory``.

    Deterministic given the arguments (``seed`` drives the weights and the pseudo-words); the
    global torch RNG is left as it was. The files are written into a temporary sibling folder
    and moved into place, so a concurrent reader never sees half a model. Returns the path.
    """
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory = Path(directory).expanduser().resolve()
    if heads is None:
        heads = 2 if hidden % 2 == 0 else 1
    if hidden % heads:
        raise ValueError(f"tiny BERT: hidden={hidden} must be divisible by heads={heads}")
    vocab = tiny_vocab(vocab_words, seed=seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_position,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(config, add_pooling_layer=False)
    model.eval()
    # transformers 5: BertTokenizerFast(vocab_file=...) ignores the file; pass the mapping.
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True)
    tokenizer.model_max_length = max_position

    return _write_atomically(directory, model, tokenizer, vocab)


EOS = "<|endoftext|>"
DECODER_ARCHS = ("llama", "qwen2")


def build_tiny_decoder(
    directory: str | os.PathLike,
    arch: str = "llama",
    hidden: int = 32,
    layers: int = 2,
    padding_side: str = "left",
    seed: int = 0,
) -> Path:
    """Write a tiny random decoder (``LlamaModel`` or ``Qwen2Model``) and a WordPiece fast
    tokenizer over :func:`tiny_vocab` plus ``<|endoftext|>`` (eos and padding, no bos) into
    ``directory``. The tokenizer appends nothing itself. Deterministic; global RNG untouched."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2Model

    if arch not in DECODER_ARCHS:
        raise ValueError(f"tiny decoder: arch={arch!r}, expected one of {DECODER_ARCHS}")
    directory = Path(directory).expanduser().resolve()
    vocab = tiny_vocab(seed=seed) + [EOS]
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS, unk_token="[UNK]",
                                        padding_side=padding_side, model_max_length=512)
    eos_id = vocab.index(EOS)
    config_cls, model_cls = (LlamaConfig, LlamaModel) if arch == "llama" else (Qwen2Config, Qwen2Model)
    config = config_cls(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=512, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.eval()
    return _write_atomically(directory, model, tokenizer, vocab)


def _write_atomically(directory: Path, model, tokenizer, vocab: list[str]) -> Path:
    """Model, tokenizer and vocab.txt into ``directory`` through a temporary sibling folder."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
        old = None
        if directory.is_dir() and any(directory.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old)  # an explicit build overwrites what was there
        elif directory.is_dir():
            directory.rmdir()
        try:
            os.replace(tmp, directory)  # atomic
        except OSError:
            if not (directory / "config.json").exists():  # another writer got there first: keep it
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


__all__ = ["DECODER_ARCHS", "EOS", "build_tiny_bert", "build_tiny_decoder", "tiny_vocab", "SPECIAL_TOKENS"]
