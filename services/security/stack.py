"""The certificates of one `pdserve up` stack: a CA of its own, made at start in a
private folder and removed when the stack stops, so that a default local stack is mTLS
inside (router -> workers, KV transfers) without any setup. A stack started with
internal TLS files of its own uses those instead."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from services.security import certs

INTERNAL_FIELDS = ("internal_tls_ca_file", "internal_tls_cert_file", "internal_tls_key_file")


class StackCertificates:
    """A fresh development set in a 0700 temporary folder; `close()` removes it, and so
    does this process's exit, should a way out miss `close()`."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="pdserve-stack-tls-"))
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, True)
        certs.init(self.directory, certs.DEFAULT_HOSTS)

    def settings(self, role: str) -> dict[str, Any]:
        """ServerConfig fields naming `role`'s files (router, prefill or decode)."""
        files = certs.internal_files(self.directory, role)
        return dict(zip(INTERNAL_FIELDS, (str(files.ca), str(files.cert), str(files.key)),
                        strict=True))

    def close(self) -> None:
        self._remove()


def has_internal_tls(server: Any) -> bool:
    return any(getattr(server, name, "") for name in INTERNAL_FIELDS)
