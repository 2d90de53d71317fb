"""torch.distributed.checkpoint (DCP) folders at the byte level: the ``.metadata`` pickle
(:mod:`.metadata`, read back safely by :mod:`.reader`) and the ``.distcp`` files of ``torch.save``
archives (:mod:`.layout`). No torch is imported to write or read them.

May import: the rest of :mod:`ckptlib.io` and the layers below it.
"""
from .layout import ARCHIVE, SUFFIX, Item, item_length, place, write_item
from .metadata import VERSION, BytesEntry, Chunk, DcpMetadata, TensorEntry, metadata_pickle

__all__ = ["ARCHIVE", "SUFFIX", "Item", "item_length", "place", "write_item", "VERSION", "BytesEntry", "Chunk",
           "DcpMetadata", "TensorEntry", "metadata_pickle"]
