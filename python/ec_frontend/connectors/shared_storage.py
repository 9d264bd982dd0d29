"""EC connector over a shared directory: one safetensors file per ``mm_hash``.

``ec_connector_extra_config``:

* ``shared_storage_path`` (required): the directory, shared by producers and consumers.
* ``max_items`` / ``max_bytes`` (optional): bounds on the files kept; after each
  save the oldest files (by modification time) are deleted until both hold.
* ``max_item_bytes`` (default 256 MiB): a larger file is not read.

Files are written to a temporary name in the same directory and renamed into
place, so a reader sees a whole file or none; concurrent writers of one hash
each rename a complete file. Only lower-case hex hashes become file names, so no
path leaves the directory, and files are opened without following symlinks
(``O_NOFOLLOW``, regular files only): a link planted in the directory is a miss,
never a read of its target. A file that is missing, short, corrupt, of the
wrong shape or holding NaN/Inf is a miss: the runner encodes the item locally.
Transfer params play no part in what is read (the file name comes from the
item's own hash), so there is nothing here for a client to point elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ec_frontend._core import is_valid_mm_hash
from ec_frontend.connectors.base import (
    ECConnectorRole,
    ECLoadSpec,
    ECQueuedLoadsConnector,
)
from ec_frontend.connectors.ec_item_params import item_fields
from ec_frontend.connectors.tensor_checks import tensor_problem
from ec_frontend.errors import ConfigError
from ec_frontend.types import JSONObject

if TYPE_CHECKING:
    from ec_frontend.config import ECTransferConfig
    from ec_frontend.engine.request import Request

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TENSOR_KEY = "encoder_output"
_TMP_PREFIX = ".tmp-"
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _optional_positive(extra: Any, key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"ec_connector_extra_config.{key} must be a positive integer", key)
    return value


class ECSharedStorageConnector(ECQueuedLoadsConnector):
    """Encoder outputs as files under ``shared_storage_path``.

    The file layout is in the ``_lstat_item`` ... ``_remove`` methods, so a
    subclass can store the same files under other names.
    """

    tensor_key = TENSOR_KEY

    def __init__(self, config: ECTransferConfig, role: ECConnectorRole) -> None:
        super().__init__(config, role)
        extra = config.ec_connector_extra_config
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ConfigError(
                "ec_connector_extra_config.shared_storage_path must be a directory path",
                "shared_storage_path",
            )
        self.root = os.path.realpath(path)
        self.max_items = _optional_positive(extra, "max_items")
        self.max_bytes = _optional_positive(extra, "max_bytes")
        self.max_item_bytes = _optional_positive(extra, "max_item_bytes") or 256 << 20
        if self.is_producer:
            os.makedirs(self.root, exist_ok=True)

    def path_for(self, mm_hash: str) -> str:
        """The file of ``mm_hash``; raises ``ValueError`` for anything but lower-case hex."""
        if not is_valid_mm_hash(mm_hash):
            raise ValueError(f"invalid mm_hash {mm_hash!r}: expected lower-case hex")
        return os.path.join(self.root, mm_hash + SUFFIX)

    # ---- scheduler side -------------------------------------------------

    def has_cache_item(self, mm_hash: str, request: Request | None = None) -> bool:
        if not is_valid_mm_hash(mm_hash):
            return False
        try:
            st = self._lstat_item(mm_hash)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def request_finished(self, request: Request) -> tuple[bool, JSONObject | None]:
        if not self.is_producer:
            return False, None
        fields = item_fields(request.mm_features)
        params = {
            f.mm_hash: {**fields[f.mm_hash], "num_tokens": f.length}
            for f in request.mm_features
            if self.has_cache_item(f.mm_hash)
        }
        return False, (params or None)

    # ---- worker side ----------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        for spec in self.metadata.loads:
            if spec.mm_hash in encoder_cache:
                continue
            tensor = self._read(spec)
            if tensor is None:
                self.stats.load_failures += 1
                continue
            encoder_cache[spec.mm_hash] = tensor
            self.stats.items_loaded += 1

    def _read(self, spec: ECLoadSpec) -> torch.Tensor | None:
        try:
            fd = self._open_item(spec.mm_hash)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError("not a regular file")
                if st.st_size > self.max_item_bytes:
                    raise ValueError(f"{st.st_size} bytes, over max_item_bytes")
                data = f.read(self.max_item_bytes + 1)
            tensor = load_safetensors(data).get(self.tensor_key)
        except (OSError, ValueError, SafetensorError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else exc
            logger.warning("EC load of %s failed: %s", spec.mm_hash, reason)
            return None
        if tensor is None or tensor.dim() != 2:
            logger.warning("EC file of %s holds no 2-D %r tensor", spec.mm_hash, self.tensor_key)
            return None
        problem = tensor_problem(tensor, shape=[spec.num_tokens, tensor.shape[1]])
        if problem is not None:
            logger.warning("EC file of %s: %s", spec.mm_hash, problem)
            return None
        return tensor

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        self.path_for(mm_hash)  # refuses an invalid hash before anything is written
        tensor = encoder_cache[mm_hash].detach().to("cpu").contiguous()
        data = save_safetensors({self.tensor_key: tensor}, metadata={"mm_hash": mm_hash})
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=_TMP_PREFIX, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._place(tmp, mm_hash)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.stats.items_saved += 1
        if self.max_items is not None or self.max_bytes is not None:
            self._enforce_capacity()

    def _enforce_capacity(self) -> None:
        entries = sorted(self._stored_items())
        count = len(entries)
        total = sum(size for _, _, size in entries)
        for _, mm_hash, size in entries:
            over_items = self.max_items is not None and count > self.max_items
            over_bytes = self.max_bytes is not None and total > self.max_bytes
            if not (over_items or over_bytes):
                break
            self._remove(mm_hash)
            count -= 1
            total -= size

    # ---- file layout: <root>/<mm_hash>.safetensors ----------------------

    def _lstat_item(self, mm_hash: str) -> os.stat_result:
        return os.lstat(self.path_for(mm_hash))

    def _open_item(self, mm_hash: str) -> int:
        return os.open(self.path_for(mm_hash), _OPEN_FLAGS)

    def _place(self, tmp: str, mm_hash: str) -> None:
        """Rename the complete file ``tmp`` (in ``root``) to ``mm_hash``'s name."""
        os.replace(tmp, self.path_for(mm_hash))

    def _stored_items(self) -> Iterator[tuple[int, str, int]]:
        """``(mtime_ns, mm_hash, size)`` of every stored regular file."""
        with os.scandir(self.root) as it:
            for entry in it:
                name = entry.name
                if not name.endswith(SUFFIX) or not is_valid_mm_hash(name[: -len(SUFFIX)]):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield st.st_mtime_ns, name[: -len(SUFFIX)], st.st_size

    def _remove(self, mm_hash: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(mm_hash))
