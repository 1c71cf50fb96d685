"""Moved into the SSH seam: `remote_ops.remote.transfer` (this name is the same module)."""
import sys

from .remote import transfer as _transfer

sys.modules[__name__] = _transfer
