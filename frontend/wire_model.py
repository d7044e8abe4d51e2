"""The base of every wire model of the OpenAI API here: an unknown field is refused (``extra="forbid"``), so that a
misspelt or unsupported parameter is a clear 400 instead of being silently ignored, and a validated model is frozen.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
