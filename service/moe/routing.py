"""The routing block: one rank's routing for a step, as it travels between ranks (defined once).

R ranks, C capacity per rank, K top-k, n rows of the rank's step; L = META + 2*C*K int32 words:

    [0]              n      the rank's real tokens this step
    [1], [2]         seq    the step's sequence number, low 31 bits then the rest (seq >> 31)
    [3]              unused
    [META : META+C*K]       ids [C, K] int32 (rows >= n: 0)
    [META+C*K : L]          w   [C, K] float32 bits (rows >= n: 0, so padding adds nothing)

The serial backend packs it on its device (`pack`, from a control copy of `meta_words`) and
all-gathers it; the fused
backend's exchange kernel writes the same layout into its peers' memory. Both read the gathered
[R, L] blocks with `unpack` and compare the R seq words with `check_seq` after a step.
"""

from __future__ import annotations

import torch

from service.config import META  # n, seq low, seq high, unused (config: the kernels read it too)


class SequenceMismatch(RuntimeError):
    """Ranks disagree about the batch sequence number: the group is out of step."""


def block_len(C: int, K: int) -> int:
    """L: int32 words of one rank's block."""
    return META + 2 * C * K


def seq_words(seq: int) -> tuple[int, int]:
    """The two non-negative int32 words that carry a sequence number of up to 62 bits."""
    return seq & 0x7FFFFFFF, seq >> 31


def meta_words(n: int, seq: int) -> list[int]:
    """The META words of a step: n, seq low, seq high, 0 (what `pack` reads from `meta`)."""
    return [n, *seq_words(seq), 0]


def pack(block: torch.Tensor, meta: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> None:
    """Write one rank's block [L] int32 from tensors on its device alone (no host value, so a CUDA
    graph can capture it): meta [META] int32 (`meta_words`), then ids [C, K] int32 and w [C, K] fp32
    with the rows past n = meta[0] zeroed; rows = arange(C) on the device."""
    C, K = ids.shape
    block[:META].copy_(meta)
    stale = (rows >= meta[0])[:, None]                                        # [C, 1] rows >= n
    block[META:META + C * K].view(C, K).copy_(ids).masked_fill_(stale, 0)     # [C, K]
    block[META + C * K:].view(torch.float32).view(C, K).copy_(w).masked_fill_(stale, 0.0)  # [C, K]


def unpack(blocks: torch.Tensor, C: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gathered blocks [R, L] -> counts [R], ids_g [R*C, K] int32, w_g [R*C, K] fp32 (views
    where the layout allows; w_g is a copy when the rows are not contiguous)."""
    R = blocks.shape[0]
    counts = blocks[:, 0]                                                            # [R]
    ids_g = blocks[:, META:META + C * K].reshape(R * C, K)                           # [R*C, K]
    w_g = blocks[:, META + C * K:].contiguous().view(torch.float32).view(R * C, K)   # [R*C, K]
    return counts, ids_g, w_g


def check_seq(blocks: torch.Tensor, seq: int, rank: int) -> None:
    """Every rank's block must carry `seq` (read after the step: on a GPU it adds no sync)."""
    check_seq_words(blocks[:, 1:3].cpu(), seq, rank)


def check_seq_words(words: torch.Tensor, seq: int, rank: int) -> None:
    """Every rank must have run `seq`: words [R, 2] int32 on the host, each rank's seq words
    (`seq_words`, the blocks' words 1 and 2)."""
    check_seqs([lo | hi << 31 for lo, hi in words.tolist()], seq, rank)  # one host read, not a torch op a word


def check_seqs(seqs: list[int], seq: int, rank: int) -> None:
    """Every rank must have run step `seq` (seqs: the step each rank ran)."""
    if any(s != seq for s in seqs):
        raise SequenceMismatch(f"rank {rank} ran seq {seq}, the group ran {seqs}")


def rank_range(T: int, R: int, rank: int) -> tuple[int, int]:
    """Rows [start, start + n) of a T-token step that belong to `rank`: spread evenly."""
    base, extra = divmod(T, R)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)
