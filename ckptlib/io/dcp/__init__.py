"""torch.distributed.checkpoint (DCP) folders at the byte level: the ``.metadata`` pickle
(:mod:`.metadata`, read back safely by :mod:`.reader`), the ``.distcp`` files of ``torch.save``
archives (:mod:`.layout`), the safetensors files DCP writes (:mod:`.sharding`: their headers and sharding info;
:mod:`.hfstorage`: ``HuggingFaceStorageWriter``'s folders, read and planned). No torch is imported to write or
read them.

May import: the rest of :mod:`ckptlib.io` and the layers below it.
"""
from .layout import ARCHIVE, SUFFIX, Item, item_length, place, write_item
from .metadata import VERSION, BytesEntry, Chunk, DcpMetadata, TensorEntry, metadata_pickle

__all__ = ["ARCHIVE", "SUFFIX", "Item", "item_length", "place", "write_item", "VERSION", "BytesEntry", "Chunk",
           "DcpMetadata", "TensorEntry", "metadata_pickle"]
