"""A request on its way through the worker, prepared: every check passed, its answer's shape chosen, ready to run."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from frontend.disaggregated_params import DisaggregatedParams
from frontend.openai_models import GenerationWireRequest
from frontend.openai_output import ResponseIdentity
from frontend.prefix_chain import PrefixChain
from frontend.tool_calls import ToolCalling
from workers.dialects import AnswerDialect
from workers.engines.request import GenerationRequest, Phase


@dataclass(slots=True)
class PreparedGeneration:
    wire: GenerationWireRequest
    request: GenerationRequest
    ident: ResponseIdentity
    disagg: DisaggregatedParams | None
    dialect: AnswerDialect  # the shape of its answer (workers.dialects), chosen once
    tool_calling: ToolCalling | None = None  # how its answer is read for tool calls; None: it is text
    answered_at_context: bool = False  # CTX's first tokens used up max_tokens: they are the whole answer
    chain: PrefixChain | None = None  # the prompt's prefix chain, recorded once the engine holds its KV
    grant: UUID | None = None  # lifecycle v1: the generation grant this GEN request runs under
    # The orchestrator asked for each streamed piece's token ids (frontend/stream_token_ids.py), to continue the
    # stream on another worker if this one breaks.
    stream_token_ids: bool = False
    # GEN, once its engine accepted the hand-off: prompt tokens it computed itself (frontend/prompt_report.py)
    recomputed_tokens: int | None = None

    @property
    def streams(self) -> bool:
        """Answered as a stream. CTX always answers whole: the orchestrator needs its hand-off fields."""
        return bool(self.wire.stream) and self.request.phase is not Phase.CONTEXT_ONLY
