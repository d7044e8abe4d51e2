"""The token ids of each streamed piece, for the orchestrator's eyes only: what it needs to continue a stream on
another GEN worker once the first one broke (``orchestrator.flow.migration``).

The orchestrator asks with ``HEADER``; our workers then open the last frame each text step writes with an SSE
comment line, ``: token_ids 12,345\\n`` (a frame of that line alone where the step wrote no frame: text held back
by a stop string, a forced tool call, or part of a character). A line and its frame are one: the orchestrator passes
a frame on only whole, so the ids it counts are exactly those whose text the client has; on the last frame of a
step that writes several (a tool call opened and its arguments' first piece), a continuation that replays the step
passes all of its frames over, not only the first. It strips the line before
the client sees the frame (SSE clients skip comments anyway). vLLM's ``return_token_ids`` serves the same purpose
inside its JSON; a comment line costs the orchestrator a prefix test per frame instead of a parse.
"""

from __future__ import annotations

from collections.abc import Sequence

HEADER = "x-disagg-stream-token-ids"
PREFIX = b": token_ids "


def tagged(frames: list[bytes], token_ids: Sequence[int]) -> list[bytes]:
    """``frames`` (one text step's) with the step's ``token_ids`` in the last; a frame of its own if none."""
    if not token_ids:
        return frames
    line = PREFIX + ",".join(map(str, token_ids)).encode("ascii") + b"\n"
    if not frames:
        return [line + b"\n"]
    return [*frames[:-1], line + frames[-1]]


def split_tag(frame: bytes) -> tuple[bytes | None, bytes]:
    """(the ids' text, ``frame`` without its line) for a tagged whole frame; (None, ``frame``) for another. A frame
    that was the line alone comes back as ``b"\\n"``: nothing for the client."""
    if not frame.startswith(PREFIX):
        return None, frame
    end = frame.index(b"\n")
    return frame[len(PREFIX):end], frame[end + 1:]


def parse_ids(parts: Sequence[bytes]) -> list[int]:
    """The ids of every tag text in ``parts``, in order."""
    return [int(token) for part in parts for token in part.split(b",")]
