"""Tests for pipespec/requests/images.py that need no model: an image file within the limits is measured before
it is read, and a file that cannot be read is a ValueError naming it, never an OSError. (Images
decoded and processed for a VLM target: tests/test_vlm.py; refused every way in: tests/test_bad_input.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipespec.config import LimitsSpec
from pipespec.requests.images import image_bytes, load_image

LIMITS = LimitsSpec(image_bytes=1000)


def unreadable(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


def test_a_file_over_the_limit_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch):
    big = tmp_path / "big.png"
    with big.open("wb") as file:
        file.truncate(2000)  # sparse: its size without its bytes
    monkeypatch.setattr(Path, "open", lambda *a, **k: pytest.fail("read before its size was checked"))
    why = f"image file {str(big)!r} of 2000 bytes is over limits.image_bytes (1000)"
    for read in (lambda: image_bytes(big, LIMITS), lambda: load_image(str(big), LIMITS)):
        with pytest.raises(ValueError) as refused:
            read()
        assert str(refused.value) == why


def test_a_file_within_the_limit_or_without_one_is_read(tmp_path):
    small = tmp_path / "small.png"
    small.write_bytes(b"x" * 1000)
    assert image_bytes(small, LIMITS) == (b"x" * 1000, f"image file {str(small)!r}")
    small.write_bytes(b"x" * 5000)
    assert image_bytes(small)[0] == b"x" * 5000  # a client's encoding: the server checks the limits


def test_a_file_that_cannot_be_read_is_a_value_error_naming_it(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=f"image file {str(tmp_path)!r} is not a regular file"):
        image_bytes(tmp_path, LIMITS)
    with pytest.raises(ValueError, match="image file '.*nope.png' does not exist"):
        image_bytes(tmp_path / "nope.png", LIMITS)
    locked = tmp_path / "locked.png"
    locked.write_bytes(b"png")
    monkeypatch.setattr(Path, "open", unreadable)  # as chmod 000 would, even for root
    with pytest.raises(ValueError, match=f"image file {str(locked)!r} cannot be read: Permission denied"):
        image_bytes(locked, LIMITS)
