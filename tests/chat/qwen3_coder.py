"""A tokenizer with Qwen3-Coder-30B-A3B-Instruct's published chat template and special-token ids.

``tests/fixtures/qwen3_coder/`` holds every released template version that could be sourced
byte for byte (``versions.json``: layout, sha256, source; README there);
``tokenizer_config.json`` is the model's own tokenizer configuration of the first release. The real vocabulary (151,643 byte-level BPE tokens) is
not kept; this builds a small byte-level BPE with Qwen's pipeline (NFC normaliser, Qwen's
split regex, byte-level mapping), pads its vocabulary with unreachable filler entries up to
151,643 and adds every token of ``added_tokens_decoder`` in id order, so each lands at its
real id. Then the real ``tokenizer_config.json`` is put beside it unchanged and the whole
directory is loaded with ``AutoTokenizer.from_pretrained``: the template, eos/pad tokens and
added-token flags are exactly the published ones. A version of the ``chat_template.jinja``
layout adds that file beside it, as the current Hugging Face repository does (transformers
5.x renders with it, not with the template inside ``tokenizer_config.json``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_coder"
FIXTURE = FIXTURES / "tokenizer_config.json"
VERSIONS: dict[str, dict] = json.loads((FIXTURES / "versions.json").read_text(encoding="utf-8"))
"""version -> {layout, file, sha256, bytes, source}: every template version the tests run."""
QWEN_REGULAR_VOCAB = 151643
"""Ids below the first added token (<|endoftext|> = 151643) are the BPE vocabulary."""


def published_config() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def template_file(version: str) -> Path:
    """The fixture file of ``version``, refused unless its bytes are the recorded ones."""
    v = VERSIONS[version]
    path = FIXTURES / v["file"]
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != v["sha256"] or len(data) != v["bytes"]:
        raise AssertionError(f"{path}: sha256 {digest} / {len(data)} bytes, but versions.json "
                             f"records {v['sha256']} / {v['bytes']} (source: {v['source']})")
    return path


def template_text(version: str) -> str:
    path = template_file(version)
    if VERSIONS[version]["layout"] == "tokenizer_config.json":
        return json.loads(path.read_text(encoding="utf-8"))["chat_template"]
    return path.read_text(encoding="utf-8")


def build_qwen3_coder_tokenizer(out_dir: str | Path, bpe_vocab: int = 1024,
                                version: str = "2025-07"):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megatron_tg.chat.tokenizer import QWEN_SPLIT_PATTERN, default_corpus

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(default_corpus()), trainer=trainers.BpeTrainer(
        vocab_size=bpe_vocab, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    # Filler entries no merge produces: they only move the added tokens to their real ids.
    for i in range(len(vocab), QWEN_REGULAR_VOCAB):
        vocab[f"<|filler_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    cfg = published_config()
    for sid, t in sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0])):
        if tok.get_vocab_size(with_added_tokens=True) != int(sid):
            raise AssertionError(f"added token {t['content']!r} would not land at id {sid}")
        added = AddedToken(t["content"], special=t["special"], normalized=t["normalized"],
                           lstrip=t["lstrip"], rstrip=t["rstrip"], single_word=t["single_word"])
        (tok.add_special_tokens if t["special"] else tok.add_tokens)([added])
    tok.save(str(out / "tokenizer.json"))
    shutil.copyfile(template_file("2025-07"), out / "tokenizer_config.json")
    if VERSIONS[version]["layout"] == "chat_template.jinja":
        shutil.copyfile(template_file(version), out / "chat_template.jinja")
    return AutoTokenizer.from_pretrained(str(out))
