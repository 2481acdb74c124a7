"""Which images an HTTP request may name (pipespec.serving.media): data URLs, and files only under the
allowed directory, `..` and symbolic links followed before the check; http(s) URLs never."""

from __future__ import annotations

import pytest

from pipespec.serving.media import media_image


@pytest.fixture
def allowed(tmp_path):
    (tmp_path / "allowed" / "sub").mkdir(parents=True)
    (tmp_path / "allowed" / "sub" / "a.png").write_bytes(b"png")
    (tmp_path / "secret.png").write_bytes(b"png")
    (tmp_path / "allowed" / "link.png").symlink_to(tmp_path / "secret.png")
    return tmp_path / "allowed"


def test_a_data_url_passes_as_it_is(allowed):
    assert media_image("data:image/png;base64,AAAA", None) == "data:image/png;base64,AAAA"


def test_files_under_the_allowed_directory_are_resolved(allowed):
    want = (allowed / "sub" / "a.png").resolve()
    assert media_image("sub/a.png", allowed) == want
    assert media_image(str(allowed / "sub" / "a.png"), allowed) == want
    assert media_image(f"file://{allowed}/sub/a.png", allowed) == want
    assert media_image("sub/../sub/a.png", allowed) == want


@pytest.mark.parametrize("path", ["../secret.png", "link.png", "/etc/hostname", "sub/../../secret.png"])
def test_a_path_leading_outside_is_refused_naming_it(allowed, path):
    with pytest.raises(ValueError, match="is outside the server's allowed media directory") as refused:
        media_image(path, allowed)
    assert repr(path) in str(refused.value)


def test_without_an_allowed_directory_every_path_is_refused(allowed):
    with pytest.raises(ValueError, match="'sub/a.png': file paths are refused"):
        media_image("sub/a.png", None)


@pytest.mark.parametrize("url", ["http://example.com/a.png", "HTTPS://example.com/a.png"])
def test_remote_urls_are_not_fetched(allowed, url):
    with pytest.raises(ValueError, match="http\\(s\\) URLs are not fetched"):
        media_image(url, allowed)


def test_a_path_with_a_nul_byte_is_refused(allowed):
    with pytest.raises(ValueError, match="not a usable file path"):
        media_image("a\x00b.png", allowed)


def test_an_image_that_is_not_a_url_is_refused():  # {"type": "image", "image": {...}} in a message
    with pytest.raises(ValueError, match=r"an image is given as an image_url's url .* got \{'a': 1\}"):
        media_image({"a": 1}, None)
