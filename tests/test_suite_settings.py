"""The suite's own settings that keep it deterministic on a busy machine."""

from __future__ import annotations

import os

from hypothesis import settings


def test_property_tests_have_no_wall_clock_deadline_and_are_derandomized_under_ci() -> None:
    assert settings().deadline is None
    assert settings().database is None
    assert settings().derandomize is (os.environ.get("CI", "").lower() == "true")
