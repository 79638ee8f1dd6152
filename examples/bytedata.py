"""Byte-level language-model data for the example: a text file, cut into fixed-length windows.

Every byte is a token (vocabulary 256), so there is no tokenizer to download. The last
``val_fraction`` of the file is held out. Batches are a pure function of the step number: step
``s`` is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch`` of a
:class:`~torch.utils.data.DistributedSampler` (shuffled with ``seed + epoch``), so a resumed run
sees exactly the batches the uninterrupted run would have seen, with no data-loader state to save.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["DEFAULT_CORPUS", "ByteWindows", "StepBatches", "load_corpus"]

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def load_corpus(path: str | Path = DEFAULT_CORPUS, *, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a file as bytes and split it into ``(train, val)`` uint8 tensors.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if ``val_fraction`` is not in [0, 1).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    return data[: len(data) - n_val], data[len(data) - n_val :]


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: ``(input, target)`` shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"corpus ({len(data)} bytes) is shorter than seq_len + 1 ({seq_len + 1})")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class StepBatches:
    """The batch of every training step for one data-parallel rank (see the module docstring).

    Args:
        dataset: the windows.
        batch_size: windows per step on this rank.
        dp_size: number of data-parallel ranks (tensor-parallel peers share a dp rank).
        dp_rank: this rank's data-parallel index.
        seed: shuffling seed.
    """

    def __init__(self, dataset: ByteWindows, batch_size: int, *, dp_size: int, dp_rank: int, seed: int) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed, drop_last=True
        )
        self.steps_per_epoch = len(self.sampler) // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"batch_size ({batch_size}) x data-parallel ranks ({dp_size}) is more than the "
                f"{len(dataset)} windows in the corpus"
            )
        self._epoch: int | None = None
        self._indices: list[int] = []

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(batch_size, seq_len)`` int64, for 0-based ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._indices, self._epoch = list(self.sampler), epoch
        idx = self._indices[k * self.batch_size : (k + 1) * self.batch_size]
        xs, ys = zip(*(self.dataset[i] for i in idx))
        return torch.stack(xs), torch.stack(ys)
