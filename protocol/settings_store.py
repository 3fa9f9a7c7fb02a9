"""The ``store`` section: the model store that versions are published to and workers fetch from."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from protocol.settings_section import Section

__all__ = ["StoreSettings"]


class StoreSettings(Section):
    """The model store (``store/``): where versions are published and workers fetch them from.

    Names only. S3 credentials come from the environment or boto3's chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, an instance role), never from this file.
    """

    backend: Literal["none", "s3", "local"] = Field(default="none", description="'none' = no store.")
    endpoint_url: str | None = Field(
        default=None, pattern=r"^https?://", description="S3 endpoint; None = AWS (or $AWS_ENDPOINT_URL_S3)."
    )
    bucket: str | None = Field(default=None, min_length=3, max_length=63, description="S3 bucket (backend s3).")
    region: str | None = Field(default=None, description="S3 region; None = boto3's default.")
    root: Path | None = Field(default=None, description="Directory of the store (backend local).")
    cache_dir: Path = Field(
        default=Path("var/model-cache"),
        description="Where workers keep verified versions: <cache_dir>/<model>/<version>/.",
    )
    fetch_stall_timeout_s: float = Field(
        default=240.0, gt=0, le=86_400,
        description="A model file's download that receives no byte for this long (s) ends in a store error, "
        "whatever the S3 client's retries would do (bytes arriving restart it: a slow download is not cut off).",
    )
    reverify_cached: bool = Field(
        default=False,
        description="Re-hash a cached version's files at every start (default: sizes + the verification marker).",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        secret_words = ("secret", "access_key", "password", "token", "credential")
        for key in data if isinstance(data, dict) else ():
            if any(word in str(key).lower() for word in secret_words):
                raise ValueError(
                    f"store.{key}: credentials are never read from the settings; set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"
                )
        return data

    @model_validator(mode="after")
    def _backend_needs(self) -> StoreSettings:
        if self.backend == "s3" and not self.bucket:
            raise ValueError("store.backend is 's3': set store.bucket")
        if self.backend == "local" and self.root is None:
            raise ValueError("store.backend is 'local': set store.root (a directory)")
        return self
