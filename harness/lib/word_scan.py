"""The words front end over whole chunks of text: normalise, split and hash many documents per numpy pass.

``normalise_words`` (NFKC, lower case, every run of non-word characters and
``_`` one separator) defines the words. On ASCII text that is exactly one
``bytes.translate`` (A-Z to a-z, a-z and 0-9 kept, every other byte a
space), so an ASCII chunk is normalised in one call and its words found with
numpy; other text goes through ``normalise_words`` itself. Either way the
result is a byte buffer of words separated by spaces (documents by a line
break), and every word is hashed from its bytes by one vectorised function
(:func:`word_hashes`), so a word hashes the same whichever path produced it,
and eval examples (hashed through :func:`harness.lib.ngrams.word_units`)
agree with training text.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np

from harness.lib.scan_kernels import KERNELS

_PUNCTUATION = re.compile(r"[\W_]+", re.UNICODE)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
SPACE, NEWLINE = 32, 10


def _table(keep_newline: bool) -> bytes:
    out = bytearray([SPACE]) * 256
    for c in b"abcdefghijklmnopqrstuvwxyz0123456789":
        out[c] = c
    for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ":
        out[c] = c + 32
    if keep_newline:
        out[NEWLINE] = NEWLINE
    return bytes(out)


WORD_TABLE = _table(keep_newline=False)  # one document: every non-word byte a space
_HIGH_TABLE = WORD_TABLE[:128] + bytes(range(128, 256))  # the same, UTF-8 bytes of non-ASCII word characters kept
LINE_TABLE = _table(keep_newline=True)  # a text file, a document per line: the line breaks stay
ASCII_WHITESPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # what str.strip() removes from ASCII text


def normalise_words(text: str) -> list[str]:
    """Unicode-normalised (NFKC), lower-cased words with punctuation stripped and whitespace collapsed."""
    return _PUNCTUATION.sub(" ", unicodedata.normalize("NFKC", text).lower()).split()


_ASCII = frozenset(chr(c) for c in range(128))


def normalised_bytes(text: str) -> bytes:
    """One document's normalised words as UTF-8, separated by spaces (never a line break): the fast path on ASCII.

    Other text: NFKC and lower case, then every non-ASCII character that is no
    word character (``\\w`` is ``isalnum()`` or ``_``) becomes a space, and
    the UTF-8 bytes go through the ASCII table with every byte >= 0x80 kept:
    the words of ``normalise_words`` without a regular expression over the text.
    """
    if text.isascii():
        return text.encode("ascii").translate(WORD_TABLE)
    lowered = unicodedata.normalize("NFKC", text).lower()
    separators = {ord(c): " " for c in set(lowered) - _ASCII if not c.isalnum()}
    return (lowered.translate(separators) if separators else lowered).encode("utf-8").translate(_HIGH_TABLE)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser in place: a bijection whose every output bit depends on every input bit."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def word_hashes(buffer: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """64-bit hash of every word ``buffer[starts[i]:ends[i]]``, from its bytes in little-endian 8-byte blocks.

    h = (len * golden) ^ block 0; then per further block h = mix(h) ^ block,
    the last block zero-padded. A word of up to 8 bytes (most words) is its
    bytes and its length, unmixed: the window hash multiplies every unit by
    odd constants and sums, so its top bits (the bitmap's) depend on every
    bit of every unit, as they do for token ids. A few passes over the
    words, none over the bytes.
    """
    if not len(starts):
        return np.empty(0, dtype=np.uint64)
    padded = np.frombuffer(buffer + bytes(8), dtype=np.uint8)
    blocks = np.ndarray((len(buffer) + 1,), dtype="<u8", buffer=padded, strides=(1,))  # the 8 bytes from every offset
    lengths = (ends - starts).view(np.uint64)
    with np.errstate(over="ignore"):
        out = _low_bytes(blocks[starts], lengths)
        out ^= lengths * _GOLDEN
        offset = 8
        longer = np.flatnonzero(lengths > 8)
        while len(longer):
            rest = lengths[longer] - np.uint64(offset)
            out[longer] = _mix(out[longer]) ^ _low_bytes(blocks[starts[longer] + offset], rest)
            offset += 8
            longer = longer[rest > 8]
    return out


def _low_bytes(blocks: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The low ``min(length, 8)`` bytes of every block, the others zero (two shifts: faster than a mask's gather)."""
    shift = np.minimum(lengths, np.uint64(8))
    np.subtract(np.uint64(8), shift, out=shift)
    shift <<= np.uint64(3)
    blocks <<= shift
    blocks >>= shift
    return blocks


def find_words(buffer: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Start and end byte offsets of every word of a normalised buffer (a word: a run of bytes above space)."""
    inside = np.zeros(len(buffer) + 2, dtype=np.bool_)
    np.greater(np.frombuffer(buffer, dtype=np.uint8), SPACE, out=inside[1:-1])
    edges = np.flatnonzero(inside[1:] != inside[:-1])
    return edges[0::2], edges[1::2]


@dataclass
class WordChunk:
    """Normalised words of many documents (segments of ``buffer`` split at line breaks) and their hashes."""

    buffer: bytes
    starts: np.ndarray
    ends: np.ndarray
    units: np.ndarray
    bounds: np.ndarray  # index of the first word of every segment
    breaks: np.ndarray  # byte offsets of the line breaks

    @classmethod
    def of(cls, buffer: bytes, table: bytes | None = None) -> "WordChunk":
        """The words of a normalised ``buffer``, or of ``buffer.translate(table)`` (a raw ASCII text range and
        ``LINE_TABLE``): in one pass of the C kernel when it is built, else in numpy passes (the same arrays)."""
        if KERNELS is not None:
            normalised, *arrays = KERNELS.words(buffer, table)
            starts, ends, units, breaks, bounds = (np.frombuffer(a, dtype=np.uint64 if k == 2 else np.int64) for k, a in enumerate(arrays))
            return cls(buffer if normalised is None else normalised, starts, ends, units, bounds, breaks)
        if table is not None:
            buffer = buffer.translate(table)
        starts, ends = find_words(buffer)
        breaks = np.flatnonzero(np.frombuffer(buffer, dtype=np.uint8) == NEWLINE)
        segment_starts = np.concatenate([np.zeros(1, dtype=np.int64), breaks + 1])
        bounds = np.searchsorted(starts, segment_starts)
        return cls(buffer, starts, ends, word_hashes(buffer, starts, ends), bounds, breaks)

    def words(self, first: int, count: int) -> list[bytes]:
        """The normalised words ``first`` .. ``first + count - 1`` (of the whole chunk)."""
        return [self.buffer[s:e] for s, e in zip(self.starts[first : first + count].tolist(), self.ends[first : first + count].tolist())]


def documents_buffer(texts: list[str]) -> bytes:
    """The normalised words of ``texts``, one segment (line) per text."""
    return b"\n".join(normalised_bytes(t) for t in texts)


def lines_buffer(lines: list[bytes]) -> bytes:
    """The normalised words of a text file's lines (valid UTF-8), one segment per line, the line breaks kept."""
    return b"\n".join(line.translate(WORD_TABLE) if line.isascii() else normalised_bytes(line.decode("utf-8")) for line in lines)
