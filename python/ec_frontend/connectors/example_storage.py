"""``ECExampleConnector``: the shared-directory connector in vLLM's file layout.

vLLM's ``ECExampleConnector`` keeps one directory per item,
``<shared_storage_path>/<mm_hash>/encoder_cache.safetensors``, holding the
encoder output under the tensor key ``ec_cache``. This connector reads and
writes exactly that, so an ec-frontend instance and a vLLM instance can share
one directory in either direction. Everything else is
:class:`~ec_frontend.connectors.shared_storage.ECSharedStorageConnector`'s:
the same ``ec_connector_extra_config`` keys, whole-file renames, validation on
read and eviction by age.

The item directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and the file
relative to it, so a symlink at either level is a miss (and a refused save),
never a read or write of its target. A save writes a temporary file in the
root and renames it into the item directory; an eviction removes the file and
then the directory if it is empty.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

from ec_frontend._core import is_valid_mm_hash
from ec_frontend.connectors.shared_storage import _OPEN_FLAGS, ECSharedStorageConnector

FILE_NAME = "encoder_cache.safetensors"
TENSOR_KEY = "ec_cache"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class ECExampleConnector(ECSharedStorageConnector):
    """Encoder outputs as ``<root>/<mm_hash>/encoder_cache.safetensors`` (key ``ec_cache``)."""

    tensor_key = TENSOR_KEY

    def path_for(self, mm_hash: str) -> str:
        return os.path.join(self._dir_for(mm_hash), FILE_NAME)

    def _dir_for(self, mm_hash: str) -> str:
        if not is_valid_mm_hash(mm_hash):
            raise ValueError(f"invalid mm_hash {mm_hash!r}: expected lower-case hex")
        return os.path.join(self.root, mm_hash)

    def _lstat_item(self, mm_hash: str) -> os.stat_result:
        if not stat.S_ISDIR(os.lstat(self._dir_for(mm_hash)).st_mode):
            raise NotADirectoryError(mm_hash)
        return os.lstat(self.path_for(mm_hash))

    def _open_item(self, mm_hash: str) -> int:
        dir_fd = os.open(self._dir_for(mm_hash), _DIR_FLAGS)
        try:
            return os.open(FILE_NAME, _OPEN_FLAGS, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def _place(self, tmp: str, mm_hash: str) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self._dir_for(mm_hash))
        dir_fd = os.open(self._dir_for(mm_hash), _DIR_FLAGS)
        try:
            os.replace(tmp, FILE_NAME, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def _stored_items(self) -> Iterator[tuple[int, str, int]]:
        with os.scandir(self.root) as it:
            for entry in it:
                if not is_valid_mm_hash(entry.name):
                    continue
                try:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    st = os.lstat(os.path.join(entry.path, FILE_NAME))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield st.st_mtime_ns, entry.name, st.st_size

    def _remove(self, mm_hash: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(mm_hash))
        with contextlib.suppress(OSError):
            os.rmdir(self._dir_for(mm_hash))
