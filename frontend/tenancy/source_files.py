"""What every adapter source (lora_sources.py's folders, object_sources.py's object store)
shares: the files a read returns with the source they came from, and the checks of a
lora_path's text made before any source looks at it."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.http.errors import bad_request

MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class SourceFiles:
    """What a source read for a lora_path: the PEFT files, and the source the stored
    version records (the lora_path itself; an object's URI and ETags)."""

    files: dict[str, bytes]
    source: str


def check_text(lora_path: str) -> None:
    """ApiError for a lora_path no source reads: empty, over MAX_PATH_CHARS, a NUL, not UTF-8."""
    if not lora_path or len(lora_path) > MAX_PATH_CHARS or "\x00" in lora_path:
        raise bad_request(
            "invalid_lora_path", f"lora_path must be 1-{MAX_PATH_CHARS} characters", "lora_path"
        )
    try:
        lora_path.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no file has that name
        raise bad_request(
            "invalid_lora_path", "lora_path is not valid UTF-8", "lora_path"
        ) from None
