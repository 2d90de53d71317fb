"""torch.distributed.checkpoint (DCP) folders as a source: what FSDP2, torchtitan and Accelerate save (and
what ``ckpt export --format dcp`` writes), read without torch and without running anything from them.

:func:`open_dcp` finds the folder's layout (``torch``: ``model.<fqn>`` / ``optimizer.state...``;
``torchtitan``: model keys at the top level; ``accelerate``: ``pytorch_model_fsdp_0/`` and
``optimizer_0/``), reads the ``.metadata`` of each DCP folder in it, and gives every tensor as the byte
ranges of its full value in row-major order, however it was chunked (FSDP2's ``Shard(0)`` rows, 2-D
shards, one whole tensor), together with the model's parameter names and, per parameter, its optimizer
states. Values (hyper-parameters, steps saved as numbers) are unpickled on demand by the restricted
unpickler. Every storage torch 2.13 writes is read: ``.distcp`` files of ``torch.save`` items or of safetensors
data (``FileSystemWriter(serialization_format=SAFETENSORS)``), and ``HuggingFaceStorageWriter``'s safetensors
files, consolidated or per rank (:mod:`ckptlib.io.dcp.sharding`, :mod:`ckptlib.io.dcp.hfstorage`); how each
tensor's pieces tile it is proven when it is read (:mod:`.tiling`: a hole is refused, overlapping pieces must
hold the same bytes).

May import: :mod:`ckptlib.io` and every layer below it (it sits beside :mod:`ckptlib.deepspeed`).
"""
from .folder import DcpFolder, DcpTensor, is_dcp, open_dcp

__all__ = ["DcpFolder", "DcpTensor", "is_dcp", "open_dcp"]
