"""A text corpus's tokenizer (data.tokenizer): what turns text into the staged token ids and
back. One seam for every reader of the ids (samples, generation, bits per byte):

    tok = tokenizer.load("results/staged/text-...")    # from the staged folder's manifest
    ids = tok.encode("def load(")                      # list[int]
    text = tok.decode(ids)                             # str (UTF-8, bad bytes as U+FFFD)
    tok.eod, tok.vocab_size, tok.token_bytes()         # end-of-document id, ids, bytes per id

data.tokenizer bytes: a ByteTokenizer; bpe or a tokenizer.json path: a ByteLevelBPE read
from the tokenizer.json staged next to the ids (ddpflow.data.byte_level).
"""

from __future__ import annotations

from pathlib import Path

from ddpflow.data.byte_level import BYTES, ByteLevelBPE, ByteTokenizer
from ddpflow.data.staged import check_file, read_manifest
from ddpflow.errors import DataError

__all__ = ["ByteLevelBPE", "ByteTokenizer", "load"]


def load(staged_dir, manifest: dict | None = None, verify: bool = False):
    """The tokenizer of a staged text corpus (ByteTokenizer or ByteLevelBPE); verify: check
    the staged tokenizer.json's sha256 too (its size always). A DataError for token data
    (data.source tokens: ids without their tokenizer)."""
    manifest = manifest if manifest is not None else read_manifest(staged_dir)
    if manifest.get("source") != "text":
        raise DataError(
            f"{staged_dir}: data.source {manifest.get('source')} holds token ids without "
            "their tokenizer; decode them with the tokenizer that wrote them"
        )
    entry = manifest.get("tokenizer") or {"kind": BYTES}  # staged before data.tokenizer
    if entry["kind"] == BYTES:
        return ByteTokenizer()
    path = check_file(Path(staged_dir), manifest, entry["file"], verify)
    tok = ByteLevelBPE.from_file(path, what=f"the staged {entry['file']}")
    tok.eod = entry.get("eod")
    return tok
