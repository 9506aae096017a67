"""Tokenizers for preprocessing and training: HF ``tokenizer.json``, a byte tokenizer, a trained BPE.

Every tokenizer has ``vocab_size``, ``eod_id`` (the end-of-document id appended after each
document), ``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``save(path)``.

Files (see docs/data.md):

* HF / BPE: ``<stem>tokenizer.json`` is a plain Hugging Face ``tokenizers`` file; beside it
  ``<stem>tokenizer_config.json`` holds ``{"eos_token": ..., "tessel_kind": ...}`` (the key
  Hugging Face also reads), which names the EOD token. In a directory ``stem`` is empty, so a
  saved directory also loads with ``transformers.AutoTokenizer``.
* byte: ``<stem>tokenizer.json`` is ``{"tessel_tokenizer": "byte", "vocab_size": 257, "eod_id": 256}``.

``load_tokenizer(spec)`` takes ``"byte"``, a path to either kind of file, or a directory holding
``tokenizer.json``. ``"bpe"`` must be trained first: :func:`train_bpe_tokenizer`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

BYTE_SPEC_KEY = "tessel_tokenizer"
BPE_EOD_TOKEN = "<|endoftext|>"
# Names tried, in order, when a tokenizer.json comes without a tokenizer_config.json naming its EOS.
KNOWN_EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus EOD = 256: an exact round trip for any text."""

    kind = "byte"

    def __init__(self):
        self.vocab_size = 257
        self.eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; EOD ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) != self.eod_id).decode("utf-8", errors="replace")

    def hf_files(self, *, model_max_length: int | None = None) -> dict[str, str]:
        """``tokenizer.json`` and ``tokenizer_config.json`` texts that ``transformers.AutoTokenizer`` loads
        as this tokenizer (byte-level BPE without merges: byte ``b`` is id ``b``, EOD is 256)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {ch: b for b, ch in enumerate(_byte_level_alphabet())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(BPE_EOD_TOKEN, special=True)])
        assert tok.token_to_id(BPE_EOD_TOKEN) == self.eod_id
        return _hf_files(tok.to_str(), eos=BPE_EOD_TOKEN, model_max_length=model_max_length)

    def save(self, path: str) -> str:
        """Write the byte spec to ``path`` (a file, or ``path/tokenizer.json`` for a directory)."""
        path = _tokenizer_file(path)
        with open(path, "w") as f:
            json.dump({BYTE_SPEC_KEY: "byte", "vocab_size": self.vocab_size, "eod_id": self.eod_id}, f)
            f.write("\n")
        return path


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with a resolved EOD token."""

    def __init__(self, tokenizer, *, eod_token: str, kind: str = "hf"):
        self._tok = tokenizer
        self.kind = kind
        eod_id = tokenizer.token_to_id(eod_token)
        if eod_id is None:
            raise ValueError(f"eod_token={eod_token!r} is not in the tokenizer's vocabulary: pass a token it has")
        self.eod_token = eod_token
        self.eod_id = int(eod_id)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        # No template tokens (BOS etc.): the data pipeline appends EOD itself.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids back to text; special tokens (EOD included) are dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def hf_files(self, *, model_max_length: int | None = None) -> dict[str, str]:
        """``tokenizer.json`` and ``tokenizer_config.json`` texts for ``transformers.AutoTokenizer``."""
        return _hf_files(self._tok.to_str(), eos=self.eod_token, model_max_length=model_max_length)

    def save(self, path: str) -> str:
        """Write ``tokenizer.json`` to ``path`` (or ``path/tokenizer.json``) and its config beside it."""
        path = _tokenizer_file(path)
        self._tok.save(path)
        with open(_config_path(path), "w") as f:
            json.dump({"eos_token": self.eod_token, "tessel_kind": self.kind}, f)
            f.write("\n")
        return path


Tokenizer = ByteTokenizer | HFTokenizer


def _hf_files(tokenizer_json: str, *, eos: str, model_max_length: int | None) -> dict[str, str]:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None, "pad_token": None,
              "unk_token": None, "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def _byte_level_alphabet() -> list[str]:
    """The character byte-level BPE (GPT-2's pre-tokenizer) writes for each byte 0..255, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _tokenizer_file(path: str) -> str:
    if os.path.isdir(path):
        return os.path.join(path, "tokenizer.json")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"directory {parent} does not exist: create it before saving the tokenizer")
    return path


def _config_path(tokenizer_path: str) -> str:
    """``X/tokenizer.json -> X/tokenizer_config.json``; ``P.tokenizer.json -> P.tokenizer_config.json``."""
    if not tokenizer_path.endswith("tokenizer.json"):
        return tokenizer_path + ".config.json"
    return tokenizer_path[: -len("tokenizer.json")] + "tokenizer_config.json"


def _resolve_eod(tok, tokenizer_path: str, eod_token: str | None) -> tuple[str, str]:
    kind = "hf"
    cfg_path = _config_path(tokenizer_path)
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
        kind = cfg.get("tessel_kind", "hf")
        eos = cfg.get("eos_token")
        if isinstance(eos, dict):  # HF sometimes stores AddedToken dicts
            eos = eos.get("content")
        if eod_token is None and eos:
            eod_token = eos
    if eod_token is None:
        for name in KNOWN_EOD_TOKENS:
            if tok.token_to_id(name) is not None:
                eod_token = name
                break
    if eod_token is None:
        raise ValueError(
            f"cannot tell the end-of-document token of {tokenizer_path}: none of {list(KNOWN_EOD_TOKENS)} is in "
            f"its vocabulary and {cfg_path} names no eos_token. Pass eod_token= (--eod-token for "
            "tools/preprocess_data.py)"
        )
    return eod_token, kind


def load_tokenizer(spec: str, *, eod_token: str | None = None) -> Tokenizer:
    """Load ``"byte"``, a tokenizer.json (HF or Tessel byte spec), or a directory holding one."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        raise ValueError(
            "tokenizer 'bpe' is trained on a corpus: call train_bpe_tokenizer(texts) (preprocess_data.py "
            "does so), or load the PREFIX.tokenizer.json it saved next to the data"
        )
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tokenizer {spec!r} not found: pass 'byte', 'bpe', a tokenizer.json file, or a directory holding one"
        )
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ValueError(f"{path}: not a JSON tokenizer file ({err})") from err
    if isinstance(data, dict) and BYTE_SPEC_KEY in data:
        if data[BYTE_SPEC_KEY] != "byte":
            raise ValueError(f"{path}: unknown Tessel tokenizer {data[BYTE_SPEC_KEY]!r}; only 'byte' exists")
        return ByteTokenizer()
    from tokenizers import Tokenizer as _HFTok

    try:
        tok = _HFTok.from_str(raw.decode("utf-8"))
    except Exception as err:  # the Rust parser raises a bare Exception
        raise ValueError(f"{path}: not a Hugging Face tokenizers file ({err})") from err
    eod, kind = _resolve_eod(tok, path, eod_token)
    return HFTokenizer(tok, eod_token=eod, kind=kind)


def train_bpe_tokenizer(texts: Iterable[str] | Iterator[str], *, vocab_size: int = 4096,
                        min_frequency: int = 2) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` (deterministic for the same texts in the same order).

    The vocabulary is the 256 byte symbols, ``<|endoftext|>`` (id 0, the EOD) and merges up to
    ``vocab_size`` entries. Decoding inverts encoding exactly for any text.
    """
    if not 257 <= vocab_size <= 1 << 20:
        raise ValueError(f"vocab_size={vocab_size} must be in [257, 2**20] for a byte-level BPE")
    from tokenizers import Tokenizer as _HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[BPE_EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, eod_token=BPE_EOD_TOKEN, kind="bpe")
