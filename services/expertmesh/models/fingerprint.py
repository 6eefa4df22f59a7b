"""A weight fingerprint of one hosted expert: taken when its weights are loaded,
recomputed on demand (``Fingerprint`` RPC), so that a difference shows weights
changed in memory since (a stray write, a bit flip, a kernel that scribbled
over the wrong buffer).

Computed where the weights live (on the GPU for a GPU group) from integer sums
over the parameters' raw 16-bit words, an Adler/Fletcher-style checksum:

- ``plain``: the sum of the words;
- ``positional``: the sum of word × (position mod 65521 + 1).

Integer sums are exact and independent of summation order, so recomputing over
unchanged weights gives the same figures on any device and any kernel, which a
floating-point sum would not. Any single changed word changes ``plain``; two
changes that cancel in it almost always differ in ``positional``. It is a
corruption check, not a cryptographic hash: whoever can write GPU memory on
purpose has other ways in. The words go through int64 in chunks of
``CHUNK_WORDS``, which bounds the temporaries (2 × 64 MiB) whatever the expert's size.
"""

from __future__ import annotations

import hashlib

import torch

#: Adler-32's modulus: the largest prime below 2**16, so word × weight < 2**32 and a chunk's sum fits int64
MODULUS = 65521
CHUNK_WORDS = 1 << 23


def _sums(t: torch.Tensor) -> tuple[int, int]:
    """(plain, positional) over ``t``'s bytes read as unsigned 16-bit words."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)  # [N]
    plain = positional = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS].to(torch.int64) & 0xFFFF  # [n] in [0, 65535]
        weight = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64) % MODULUS + 1
        plain += int(chunk.sum())
        positional += int((chunk * weight).sum())
    return plain, positional


def fingerprint(params: dict[str, torch.Tensor]) -> str:
    """One expert's fingerprint from its parameters (name -> its row of the stacked tensor), 16 hex digits."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(params):
        t = params[name]
        plain, positional = _sums(t)
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{plain}:{positional};".encode())
    return digest.hexdigest()
