"""Mid-stream migration: a GEN stream that breaks after the client has part of the answer goes on on another GEN.

A stream breaks when GEN's connection resets, its body ends before the stream's end marker, or GEN itself writes an
error event (its engine failed). Before the first byte the retry policy moves the request (``retry.py``); after
it, the client has text, and the answer can go on only from exactly where the client is:

- **What the client has.** The relay passes GEN's frames on whole only, and our GEN workers, asked with
  ``frontend.stream_token_ids.HEADER``, open each text step's last frame with the step's token ids, a line the
  ``StreamLedger`` strips. So the ledger knows the ids G whose text the client has, no more and no fewer.
- **The continuation.** CTX prefills the prompt again (a new hand-off; its prefix cache may hold it), and GEN is
  given that hand-off with G as the answer's first tokens, as if CTX had chosen them all: its engine puts them in
  the KV after the prompt, counts them as output (the budget of ``max_tokens``, frequency and presence penalties,
  the seeded draw's position: the reference engine draws output position i from (seed, i)), advances the
  grammar over them, and its text state (detokenizer, stop-string matcher) is the one that wrote the frames the
  client has. GEN then writes the whole answer again, from the start: the ledger passes over its opening (the
  frames before its first ids, and those whose ids are G's), and hands on the rest with the first answer's id and
  ``created`` (and, on a Responses stream, its event numbers going on). ``usage`` counts G once, as GEN's output.
- **Never for a client that left** (the relay is cancelled, nothing here runs), never past ``migration_limit`` per
  request, and never on a wire that cannot say which ids were sent (TensorRT-LLM's and vLLM's GEN workers write no
  ids; ``n`` > 1 would need every sequence's): those end with an error event, as before, counted as
  ``not_resumable``. A continuation's hand-off that no GEN took is released on CTX at once, as any other.

A non-streaming request needs none of this: the client has nothing until GEN's answer is whole, so a GEN that dies
on the way is retried from the start (``retry.py``, CTX again once the hand-off is gone).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import orjson

from frontend.errors import DETERMINISTIC_FAILURE_CODES, RelayedError, ServingError, UpstreamError
from frontend.guardrail import FallbackReason
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint
from frontend.stream_token_ids import HEADER, PREFIX, parse_ids, split_tag
from orchestrator.flow.handoff_release import HandoffReleaser
from orchestrator.flow.request import FlowRequest
from orchestrator.flow.retry import Attempted, RetryPolicy
from orchestrator.member import PoolMember
from orchestrator.metric_labels import GEN_POOL_NAME
from orchestrator.metric_labels import MIGRATION_FAILED as FAILED
from orchestrator.metric_labels import MIGRATION_NOT_RESUMABLE as NOT_RESUMABLE
from orchestrator.metric_labels import MIGRATION_OVER_LIMIT as OVER_LIMIT
from orchestrator.metric_labels import MIGRATION_RESUMED as RESUMED
from orchestrator.pool import WorkerPool
from orchestrator.protocols.base import ContextAnswer, PromptCarriage, WorkerProtocol
from orchestrator.protocols.registry import DEFAULT_PROTOCOL
from orchestrator.relay import next_sequence_number
from orchestrator.routers import RoutingKey
from orchestrator.upstream.base import Body, OpenStream, Reply

logger = logging.getLogger("disagg_serve.migration")

_SEQUENCE = re.compile(rb'"sequence_number":\d+')
_ERROR_FRAMES = (b'data: {"error"', b"event: error")  # GEN's own error event (chat and completions; Responses)
_FINAL_FRAMES = (b"data: [DONE]", b"event: response.completed", b"event: response.incomplete")
_MOST_FRAMES_A_STEP = 32  # a Responses step from text to a call writes ~6


class StreamLedger:
    """What of GEN's streams the client has, fed piece by piece (``feed``): whole frames only (a frame cut by a
    break never reaches the client), the ids' lines stripped and kept, GEN's own error event held back (``broken``:
    the stream is then continued, or ended by the relay's own). Once a continuation starts (``begin_replay``), its
    opening is passed over and what follows is renamed to the first answer's identity.

    ``holds``: frames without ids are held until the frame with their step's ids (or the stream's final end marker)
    comes, so that the client has a step's frames all or none: a GEN that dies between two frames of one step (a
    tool call opened and its arguments' first piece, written as two) leaves nothing of that step with the client,
    and the continuation's replay of it, passed over whole, repeats nothing. Frames pass as they come until GEN's
    first ids (its opening, which a continuation's replay passes over; a GEN that writes no ids at all is relayed
    as it comes, and its break not continued: ``untagged``), and a stream that cannot move holds nothing."""

    __slots__ = ("broken", "deterministic", "endpoint", "held", "holds", "identity", "ids", "last_frame",
                 "next_sequence", "pending", "renames", "replay_identity", "replay_ids", "replay_tokens", "replayed",
                 "replaying")

    def __init__(self, endpoint: Endpoint, holds: bool = True) -> None:
        self.endpoint = endpoint
        self.holds = holds
        self.held: list[bytes] = []  # whole frames of a step whose ids have not come yet (``holds``)
        self.pending = b""  # a frame begun and not yet whole: held, never passed on in part
        # The ids' lines of the frames passed on, each ended by a newline, unparsed until a migration needs them: one
        # buffer, not a bytes object a step (a few bytes a token, where a list of them costs ~45).
        self.ids = bytearray()
        self.broken: str | None = None  # GEN's own error message, once it wrote one
        self.deterministic = False  # that error is one any GEN would repeat (the engine failed on the request)
        self.identity: tuple[bytes, int] | None = None  # the first answer's (id, created): what the client sees
        self.last_frame: bytes | None = None  # (a Responses stream's numbering goes on from it)
        self.replaying = False
        self.replay_tokens = 0  # ids of a continuation's opening to pass over, and those passed over so far
        self.replayed = 0
        self.replay_ids = bytearray()  # the ids the continuation's opening replays: checked against ``ids``
        self.replay_identity = False  # a continuation's identity was read (its first data frame)
        self.renames: tuple[tuple[bytes, bytes], ...] = ()
        self.next_sequence: int | None = None  # a continued Responses stream: the next event's number

    @property
    def untagged(self) -> bool:
        """The client has frames whose ids GEN never wrote: what it has cannot be told, so it cannot go on."""
        return self.last_frame is not None and not self.ids

    def sent_token_ids(self) -> list[int]:
        return parse_ids(_lines(self.ids))

    def sent_steps(self) -> list[int]:
        """How many of those ids each of GEN's text steps wrote, in order."""
        return [tag.count(b",") + 1 for tag in _lines(self.ids)]

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` the client gets now."""
        if not self.pending and chunk.endswith(b"\n\n"):
            whole = chunk  # (GEN's pieces are whole frames but where the network cut one)
        else:
            data = self.pending + chunk if self.pending else chunk
            ends = data.rfind(b"\n\n") + 2
            if ends < 2:
                self.pending = data
                return b""
            whole, self.pending = data[:ends], data[ends:]
        if self.broken is not None:
            return b""
        if (not self.holds and self.identity is not None and not self.replaying and not self.renames
                and self.next_sequence is None and PREFIX not in whole and b'data: {"error"' not in whole
                and b"event: error" not in whole):
            self.last_frame = whole  # (cut to its last frame only if a migration reads it)
            return whole  # nothing to strip, keep or rename: passed on as it came
        if whole.startswith(PREFIX) and not self.held and not self.replaying and not self.renames \
                and self.next_sequence is None and self.identity is not None and whole.find(b"\n\n") == len(whole) - 2 \
                and b"error" not in whole:
            # One text step's frame, the common piece: its ids kept, the rest passed on.
            line_end = whole.index(b"\n")
            self.ids += whole[len(PREFIX):line_end + 1]  # (with its newline)
            rest = whole[line_end + 1:]
            if rest == b"\n":
                return b""
            self.last_frame = rest
            return rest
        passed: list[bytes] = []
        for frame in whole.split(b"\n\n")[:-1]:
            frame += b"\n\n"
            if self.holds and self.ids and not frame.startswith(PREFIX):
                if frame.startswith(_ERROR_FRAMES):
                    self.held.clear()  # the frames of a step GEN did not finish: the continuation writes them
                elif not frame.startswith(_FINAL_FRAMES):
                    self.held.append(frame)
                    if len(self.held) <= _MOST_FRAMES_A_STEP:
                        continue
                    # No step writes this many: a GEN that writes no ids although asked. Nothing held any more
                    # (its stream is not buffered), and a break is not continued (``untagged``).
                    self.holds = False
                    passed.extend(self._frame(held) for held in self.held)
                    self.held.clear()
                    continue
            if self.held:
                passed.extend(self._frame(held) for held in self.held)
                self.held.clear()
            passed.append(self._frame(frame))
            if self.broken is not None:
                break  # nothing GEN writes after its error event reaches the client
        return b"".join(passed)

    def _frame(self, frame: bytes) -> bytes:
        tag, frame = split_tag(frame)
        if frame.startswith(_ERROR_FRAMES):
            self.broken, code = _error_message(frame)
            self.deterministic = code in DETERMINISTIC_FAILURE_CODES
            return b""
        if self.replaying:
            if not self.replay_identity and self.identity is not None:
                continued = _identity(self.endpoint, frame)
                if continued is not None:
                    self.replay_identity = True
                    self.renames = _renames(self.endpoint, continued, self.identity)
            if tag is None:
                return b""  # the continuation's opening: a chat role, a Responses stream's first events, an echo
            if self.replayed < self.replay_tokens:
                self.replayed += tag.count(b",") + 1
                self.replay_ids += tag
                self.replay_ids += b"\n"
                if self.replayed >= self.replay_tokens:
                    self.replaying = False
                    if _joined(self.replay_ids) != _joined(self.ids):
                        self.broken = "the continuation did not replay the tokens the client has"
                return b""
            self.replaying = False  # no ids to pass over (the break came before any): this frame is new
        if tag is not None:
            self.ids += tag
            self.ids += b"\n"
        if frame == b"\n":
            return b""  # a frame of ids alone
        if self.identity is None:
            self.identity = _identity(self.endpoint, frame)
        for old, new in self.renames:
            frame = frame.replace(old, new)
        if self.next_sequence is not None:
            frame = _SEQUENCE.sub(b'"sequence_number":%d' % self.next_sequence, frame, count=1)
            self.next_sequence += 1
        self.last_frame = frame
        return frame

    def begin_replay(self) -> None:
        """A continuation's stream comes next: it replays what the client has, then goes on."""
        self.pending = b""
        self.held.clear()  # a step whose ids never came: the continuation writes it again
        self.broken = None
        # Nothing reached the client yet (the break came before GEN's first whole frame): the continuation's
        # opening is the client's, passed on as it comes.
        self.replaying = self.last_frame is not None
        self.replay_tokens, self.replayed = len(self.sent_token_ids()), 0
        self.replay_ids = bytearray()
        self.replay_identity = False
        self.renames = ()
        if self.endpoint == "responses":
            self.next_sequence = next_sequence_number(_last_frame(self.last_frame))


def _lines(ids: bytearray) -> list[bytes]:
    """A ledger's lines of ids, one a step."""
    return bytes(ids).split(b"\n")[:-1]


def _joined(ids: bytearray) -> bytes:
    """The ids of a ledger's lines as one list, whatever steps they came in."""
    return bytes(ids).replace(b"\n", b",")


def _last_frame(piece: bytes | None) -> bytes | None:
    if not piece:
        return None
    begins = piece.rfind(b"\n\n", 0, len(piece) - 2) + 2
    return piece[begins if begins > 1 else 0:]


def _error_message(frame: bytes) -> tuple[str, object]:
    """What GEN's error event says, and its ``code``."""
    _, _, data = frame.partition(b"data: ")
    try:
        payload = orjson.loads(data.strip())
        error = payload.get("error", payload)
        message, code = (error.get("message"), error.get("code")) if isinstance(error, dict) else (None, None)
    except (orjson.JSONDecodeError, AttributeError):
        message, code = None, None
    said = f"GEN wrote an error event: {message}" if isinstance(message, str) else "GEN wrote an error event"
    return said, code


def _identity(endpoint: Endpoint, frame: bytes) -> tuple[bytes, int] | None:
    """(the id's own part, created) of the answer a data frame belongs to; None for a frame without one."""
    _, _, data = frame.partition(b"data: ")
    if not data or data.startswith(b"[DONE]"):
        return None
    try:
        payload = orjson.loads(data.strip())
        if endpoint == "responses":
            response = payload["response"]
            name, created = response["id"].removeprefix("resp_"), response["created_at"]
        else:
            name, created = payload["id"].partition("-")[2], payload["created"]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    if not name or not isinstance(created, int):
        return None
    return name.encode(), created


def _renames(endpoint: Endpoint, continued: tuple[bytes, int], first: tuple[bytes, int]) -> tuple[
        tuple[bytes, bytes], ...]:
    """What a continuation's frames must say instead: the first answer's id (chatcmpl-, cmpl-, resp_, msg_, call_
    all share it) and its time of creation."""
    key = b'"created_at":' if endpoint == "responses" else b'"created":'
    renames = []
    if continued[0] != first[0]:
        renames.append((continued[0], first[0]))
    if continued[1] != first[1]:
        renames.append((key + b"%d" % continued[1], key + b"%d" % first[1]))
    return tuple(renames)


def continued_handoff(ctx: ContextAnswer, sent: list[int], steps: list[int]) -> ContextAnswer:
    """CTX's new hand-off with the tokens the client has as the answer's first tokens, in the ``steps`` they were
    streamed in (CTX's own first token, the same one for a greedy or seeded request, is dropped). Their logprobs are
    not sent again: the continuation's frames that would carry them are the ones passed over."""
    if not sent:
        return ctx  # the break came before any token: the answer starts over, from CTX's own first token
    handoff: dict[str, Any] = dict(ctx.handoff)
    handoff["first_gen_tokens"] = sent
    handoff["first_gen_steps"] = steps
    if handoff.get("first_gen_logprobs") is not None:
        handoff["first_gen_logprobs"] = [{"token_id": token, "logprob": 0.0, "top": []} for token in sent]
    return replace(ctx, handoff=handoff)


class Migration:
    """One streamed request's migrations: its ledger (fed by the relay), and the continuations it starts."""

    __slots__ = ("count", "ledger", "migrations", "request", "resumable")

    def __init__(self, request: FlowRequest, migrations: Migrations, resumable: bool = True) -> None:
        self.request = request
        self.migrations = migrations
        self.resumable = resumable  # else its ids are only stripped, and a break is counted
        self.ledger = StreamLedger(request.endpoint, holds=resumable)
        self.count = 0

    def feed(self, chunk: bytes) -> bytes:
        return self.ledger.feed(chunk)

    @property
    def broken(self) -> str | None:
        return self.ledger.broken

    async def resume(self, failed: PoolMember, reason: str) -> tuple[OpenStream, PoolMember] | None:
        """A stream on another GEN worker that goes on from what the client has; None where there is none (the
        relay then ends the client's stream with its error event)."""
        migrations = self.migrations
        if self.ledger.deterministic:  # the engine failed on the request itself: any GEN would fail it again
            logger.info("GEN stream on %s ended with a failure any worker would repeat (%s): not continued",
                        failed.url, reason)
            return None
        if not self.resumable or self.ledger.untagged:
            migrations.counted(failed, NOT_RESUMABLE)
            logger.warning("GEN stream broke on %s (%s): it cannot be continued on another worker (n > 1, or "
                           "another wire than ours)", failed.url, reason)
            return None
        if self.count >= migrations.limit:
            migrations.counted(failed, OVER_LIMIT)
            logger.warning("GEN stream broke on %s (%s): not continued, it has been moved %d time(s) already",
                           failed.url, reason, self.count)
            return None
        self.count += 1
        self.ledger.broken = None
        try:
            sent, steps = self.ledger.sent_token_ids(), self.ledger.sent_steps()  # (ids GEN wrote wrong: raises)
            logger.warning("GEN stream broke on %s after %d token(s) (%s): continuing it on another GEN worker",
                           failed.url, len(sent), reason)
            resumed = await migrations.continuation(self.request, sent, steps, failed)
        except ServingError as exc:  # no CTX or GEN to continue on, or one that refused (its own words logged)
            migrations.counted(failed, FAILED)
            error = exc.to_dict().get("error")
            message = error.get("message") if isinstance(error, dict) else None
            logger.warning("could not continue the stream that broke on %s: %s", failed.url, message or exc.message)
            return None
        except Exception:  # a failure no one foresaw: the client's stream still ends with the relay's error event
            migrations.counted(failed, FAILED)
            logger.exception("could not continue the stream that broke on %s", failed.url)
            return None
        migrations.counted(failed, RESUMED)
        self.ledger.begin_replay()
        return resumed


class ContinuationSteps(Protocol):
    """What a continuation runs of the flow's steps (``orchestrator.flow.steps.Steps``): CTX again, then GEN."""

    metrics: Metrics
    gen_pool: WorkerPool
    releaser: HandoffReleaser

    async def run_context_step(self, request: FlowRequest) -> ContextAnswer: ...

    def prompt_carriage(self, request: FlowRequest, ctx: ContextAnswer, gen: PoolMember
                        ) -> tuple[PromptCarriage, FallbackReason | None]: ...

    def wire(self, request: FlowRequest, member: PoolMember | None) -> WorkerProtocol: ...

    async def call_gen(self, request: FlowRequest, key: RoutingKey, body_for: Callable[[PoolMember], Body],
                       avoid: tuple[PoolMember, ...] = (), retry: RetryPolicy | None = None
                       ) -> Attempted[Reply | OpenStream]: ...


class Migrations:
    """The flow's migrations: which streams may move, and the continuation of one that does."""

    def __init__(self, limit: int, steps: ContinuationSteps) -> None:
        self.limit = limit
        self.steps = steps
        self._counters: dict[tuple[str, str], Any] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def ask_for_token_ids(self, request: FlowRequest) -> None:
        """A streamed request's GEN is asked to say each piece's token ids (``frontend.stream_token_ids``)."""
        if self.enabled and request.streaming:
            request.headers[HEADER] = "1"

    def for_request(self, request: FlowRequest, gen: PoolMember) -> Migration | None:
        """The migration of ``request``'s stream from ``gen``: None where no ids were asked for; one that only
        strips them, and counts a break as ``not_resumable``, where the stream could not be continued anywhere."""
        if request.headers.get(HEADER) != "1":
            return None
        return Migration(request, self, self.resumable(request, gen))

    def resumable(self, request: FlowRequest, gen: PoolMember) -> bool:
        """Whether a break could be continued: one sequence, on our own wire and GEN workers (the only ones that
        write the ids)."""
        n = request.body.get("n")
        return request.wire is None and (n is None or n == 1) and gen.protocol == DEFAULT_PROTOCOL

    def counted(self, worker: PoolMember, outcome: str) -> None:
        key = (worker.url, outcome)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.steps.metrics.stream_migrations.labels(
                pool=GEN_POOL_NAME, worker=worker.url, outcome=outcome)
        counter.inc()

    async def continuation(self, request: FlowRequest, sent: list[int], step_sizes: list[int], failed: PoolMember
                           ) -> tuple[OpenStream, PoolMember]:
        """A new CTX hand-off of the prompt, and GEN's stream that goes on from the ``sent`` tokens (streamed in steps
        of ``step_sizes``), on a GEN worker
        other than ``failed`` where one is left. Raises where there is none; a hand-off no GEN took is released."""
        steps = self.steps
        # Started now: a wait for a worker expected back (the only GEN restarting) has its whole bound from the break.
        again = FlowRequest(request.endpoint, request.body, request.key, time.perf_counter(), dict(request.headers),
                            span=request.span, priority=request.priority, conversation_id=request.conversation_id)
        ctx = await steps.run_context_step(again)
        if ctx.finished:  # only a request sampled without a seed can finish differently at CTX the second time
            raise UpstreamError("CTX finished the continuation by itself: there is no hand-off to continue from")
        try:  # from here on, CTX's new hand-off is released unless a GEN took it
            ctx = continued_handoff(ctx, sent, step_sizes)

            def body_for(gen: PoolMember) -> Body:
                carriage, _ = steps.prompt_carriage(again, ctx, gen)
                return steps.wire(again, gen).generation_request(again.body, ctx, carriage,
                                                                 conversation_id=again.conversation_id)

            prompt_tokens = ctx.prompt_len if ctx.prompt_len is not None else request.key.prompt_tokens
            key = replace(request.key, prompt_tokens=prompt_tokens, only=None, prefill_tokens={})
            key.prefill_tokens.update((w.url, 0) for w in steps.gen_pool.workers)
            answered = await steps.call_gen(again, key, body_for, avoid=(failed,))
        except BaseException:
            steps.releaser.release(again.ctx, again.ctx_worker, again.headers)
            raise
        answer = answered.answer
        if isinstance(answer, Reply):  # GEN refused it, and did not take the hand-off
            steps.releaser.release(again.ctx, again.ctx_worker, again.headers)
            raise RelayedError(answer.status_code, answer.content)
        request.gen_worker = answered.member.url
        return answer, answered.member
