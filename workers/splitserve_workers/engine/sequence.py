"""A request inside the engine (Sequence) and what step() hands back (TokenOutput).

A Sequence owns its token list, its block table (block_manager.py) and its progress: how many
tokens have KV in the cache. The scheduler moves it WAITING -> RUNNING -> FINISHED (and back to
WAITING when preempted: its KV is dropped and recomputed from prompt + output so far).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from splitserve_workers.engine.sampling import PenaltyState, SamplingParams
from splitserve_workers.engine.speculative import Drafter

# on_kv(request_id, layer, token_start, k, v), k/v: [n_tokens, kv_heads, head_dim]
OnKV = Callable[[str, int, int, torch.Tensor, torch.Tensor], None]


class Priority(enum.IntEnum):
    INTERACTIVE = 0
    BACKGROUND = 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or admitted and partway through a chunked prefill
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class TokenOutput:
    request_id: str
    token_id: int | None
    logprob: float | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefill_done"
    num_prompt_tokens: int
    num_cached_tokens: int
    # With SamplingParams.top_logprobs: the most likely tokens at this step, most likely first,
    # as (token id, logprob) pairs (raw distribution, like `logprob`).
    top_logprobs: list[tuple[int, float]] | None = None
    # With SamplingParams.prompt_logprobs, on the first token's output only: per prompt token
    # after the first, its logprob given the tokens before it and the top alternatives.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]] | None]] | None = None
    # With finish_reason "error" from the request's grammar: llguidance's reason (a lexer
    # limit, say), for the worker to answer with.
    grammar_error: str | None = None


_arrival = itertools.count()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        prefill_only: bool = False,
        on_kv: OnKV | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival = next(_arrival)  # FIFO order within a priority; preemption picks newest
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = Priority(priority)
        self.prefill_only = prefill_only
        self.on_kv = on_kv
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full blocks
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.admitted = False  # given blocks at least once (a preempted one is re-admitted)
        # The prompt's last ids and their text, for stop strings (LLMEngine._hit_stop_string).
        self.stop_context: tuple[list[int], str] | None = None
        self.kv_exported = 0  # tokens already handed to on_kv (prefix hits are exported once)
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        self.error: BaseException | None = None  # set when on_kv raised
        # SamplingParams.prompt_logprobs: entry p is for prompt token p + 1, filled as the
        # prompt is computed (a recompute after preemption overwrites it with equal values)
        # and handed out with the first token.
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]] | None] | None] | None = (
            None if params.prompt_logprobs is None else [None] * (len(prompt_token_ids) - 1)
        )
        self.prompt_logprobs_sent = False
        # Token statistics for repetition/frequency/presence penalties, built on first use.
        self.penalty_state = PenaltyState()
        # With SamplingParams.grammar: its llguidance matcher, advanced by every output token.
        self.matcher: Any = None
        # Speculative decoding (speculative.py): its drafter (n-gram index of token_ids and
        # adaptive draft length; None: not drafted for, as a prefill-only sequence), and a
        # generator per draft row of a seeded request (row 0 uses `generator`).
        self.drafter: Drafter | None = None
        self.draft_generators: list[torch.Generator] = []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt rows' logits are needed (so no prefix-cache hits may skip them)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        return (int(self.priority), self.arrival)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
