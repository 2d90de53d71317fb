"""Reading a small JSON file that must hold one object (a model's ``config.json``, a DeepSpeed config, the
tensor-parallel rules), with the one-line errors every reader of such a file gives."""
from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import CkptError


def read_json_object(path: str | os.PathLike, what: str, hint: Optional[str] = None,
                     not_object: Optional[str] = None) -> dict:
    """The JSON object in ``path``; ``what`` names the file in the messages ("the model config"), ``hint``
    goes with a file that is not valid JSON or not an object, ``not_object`` replaces that message.

    Raises:
        CkptError: the file cannot be read, is not valid JSON, or does not hold an object.
    """
    try:
        with open(path) as f:
            out = json.load(f)
    except OSError as e:
        raise CkptError(f"cannot read {what} ({e.strerror})", path=path) from None
    except ValueError as e:
        raise CkptError(f"{what} is not valid JSON ({e})", path=path, hint=hint) from None
    if not isinstance(out, dict):
        raise CkptError(not_object or f"{what} is not a JSON object", path=path, hint=hint)
    return out


__all__ = ["read_json_object"]
