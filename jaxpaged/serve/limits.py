"""What one deployment of the server allows: ``ServerLimits``, the ``jaxpaged serve`` flags of the same
names (a module of its own, free of heavy imports, so the command line can show the defaults)."""

from __future__ import annotations

import dataclasses

# Hard bounds of the request bodies (``protocol.py``); a deployment's limits may be tighter, never looser.
MAX_N = 1024
MAX_STOP_STRINGS = 64


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one deployment allows (``jaxpaged serve`` flags of the same names). ``max_prompt_bytes``
    None: as many bytes as ``max_model_len`` of the tokenizer's longest tokens can hold (a longer text
    cannot fit, so it is refused without being tokenized)."""

    max_body_bytes: int = 32 << 20
    max_prompt_bytes: int | None = None
    max_n: int = 128  # OpenAI's bound on n
    max_stop: int = 16
    max_concurrent_requests: int = 1024
    body_timeout: float = 30.0  # seconds to receive a request's body
    header_timeout: float = 10.0  # seconds from a connection's first byte (or the previous response) to the headers
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    shutdown_timeout: float = 5.0  # on SIGTERM: seconds to drain running requests before they are aborted

    def __post_init__(self) -> None:
        for name, hard in (("max_n", MAX_N), ("max_stop", MAX_STOP_STRINGS)):
            if not 1 <= getattr(self, name) <= hard:
                raise ValueError(f"{name} must be in [1, {hard}], got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0 and f.name != "shutdown_timeout":
                raise ValueError(f"{f.name} must be positive, got {value}")
