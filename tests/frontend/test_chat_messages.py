"""A chat message on the wire (frontend/chat_messages.py): its text, and whether it carries media."""

from __future__ import annotations

from frontend.chat_messages import ChatMessage


def test_media_detection() -> None:
    text_only = ChatMessage(role="user", content=[{"type": "text", "text": "x"}])  # type: ignore[list-item]
    image = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "u"}}])  # type: ignore[list-item]
    assert text_only.has_media is False
    assert image.has_media is True
    assert image.text() == ""
    assert ChatMessage(role="assistant").text() == ""
