"""The ``.distcp`` files of a DCP folder: one ``torch.save`` archive per stored item, back to back.

torch's ``FileSystemWriter`` (``SerializationFormat.TORCH_SAVE``, the default) writes each tensor chunk
with ``torch.save(tensor, stream)`` and each other value with ``torch.save(value)`` into a buffer first,
one after the other into the file; the ``.metadata`` records every item's offset and length, and the
reader hands ``torch.load`` a view of exactly those bytes. So every item is a whole zip archive whose
own offsets count from its first byte. ckptlib writes the same archives with its torch zip writer
(:func:`ckptlib.io.torchzip.writer.write_archive`): a tensor's bytes streamed from its source ranges, a
value pickled (plain Python values only: numbers, strings, ``None``, booleans, tuples, lists, dicts).
Every item's size is known before a byte is written, so items can be written in any order, by any
process, at offsets fixed by :func:`place`.

Memory: the pickles; tensor bytes are streamed through the caller's buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..torchzip.specs import NewTensor
from ..torchzip.writer import archive_size, write_archive

ARCHIVE = "archive"  # the archive name torch.save gives a stream without a file name
SUFFIX = ".distcp"


@dataclass
class Item:
    """One item of a ``.distcp`` file: the flattened key ``fqn`` and its ``value``, a
    :class:`~ckptlib.io.torchzip.specs.NewTensor` (a tensor chunk) or a plain Python value; ``offset``
    and ``length`` in the file (set by :func:`place`); ``chunk_offsets``: where the chunk starts in the
    full tensor (zeros for a whole tensor)."""

    fqn: str
    value: Any
    offset: int = 0
    length: int = 0
    chunk_offsets: tuple = ()

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, NewTensor)

    @property
    def nbytes(self) -> int:
        """Tensor bytes streamed into the item (0 for a value)."""
        return self.value.nbytes if self.is_tensor else 0


def item_length(value: Any) -> int:
    """The size of the archive of ``value`` (computed; nothing is read)."""
    return archive_size(value, ARCHIVE)


def place(items: list, start: int = 0) -> int:
    """Give each item its offset and length, one after the other from ``start``; returns the file size.
    Values come first, as torch writes them."""
    pos = start
    for it in items:
        it.length = item_length(it.value)
        it.offset = pos
        pos += it.length
    return pos


def write_item(fd: int, item: Item, progress: Callable[[int], None] = lambda n: None, bufs=None, files=None,
               cancel: Any = None, behind=None) -> int:
    """Write ``item``'s archive at its offset of the open file ``fd``; returns the tensor bytes written. No
    blocks are reserved here: in a run, ``prepare`` made the file at its full size with its blocks reserved."""
    return write_archive(item.value, fd, item.offset, ARCHIVE, progress=progress, bufs=bufs, files=files,
                         cancel=cancel, behind=behind, reserve=False)


__all__ = ["ARCHIVE", "SUFFIX", "Item", "item_length", "place", "write_item"]
