"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, per-request seeds,
logit bias and repetition/frequency/presence penalties.

Greedy rows are one batched argmax; random rows are sampled one by one with the request's own
torch.Generator so a seeded request gives the same tokens whatever else shares its batch.
Logprobs are the model's raw log-softmax (before bias, penalties, temperature/top-k/top-p) of
the chosen token, and with top_logprobs of the N most likely tokens.

Logit adjustments, in vLLM's order, before temperature: `logit_bias` is added; then
`repetition_penalty` (transformers' RepetitionPenaltyLogitsProcessor: every token of the prompt
or the output so far has a positive logit divided by it, a negative one multiplied); then
OpenAI's `frequency_penalty` times how often each token was generated and `presence_penalty`
once for each token generated at all (output only, not the prompt) are subtracted.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve_workers.engine.grammar import MAX_GRAMMAR_BYTES

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
MAX_PROMPT_LOGPROBS = 5  # alternatives per prompt token, as the legacy completions API
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM's sampler does)
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty|: OpenAI's range
MAX_REPETITION_PENALTY = 10.0  # beyond this every seen token is as good as banned
# Below this a logit divided by it can overflow float32 to inf (softmax: NaN, and the batch
# fails); a proto float also rounds values under ~1e-45 to 0, which the workers read as "off".
MIN_REPETITION_PENALTY = 0.01
MAX_LOGIT_BIAS = 100.0  # |bias| per token, OpenAI's range (-100 bans, 100 forces)
MAX_LOGIT_BIAS_TOKENS = 300  # entries per request


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also the N most likely tokens per step (0-20)
    # The prompt's logprobs too, with this many alternatives per token (0-5); None = not asked.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted from each token generated at least once
    frequency_penalty: float = 0.0  # subtracted times each token's count in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Structured output: an llguidance grammar (engine/grammar.py) the output must match.
    grammar: str | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: {self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k: {self.top_k} must be >= 0 (0 or -1 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: {self.max_tokens} must be >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: every entry must be a non-negative integer")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs: {self.top_logprobs} must be between 0 and {MAX_TOP_LOGPROBS}"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs")
        if self.prompt_logprobs is not None and not (
            0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs: {self.prompt_logprobs} must be between 0 and "
                f"{MAX_PROMPT_LOGPROBS}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(
                    f"{name}: {value} must be between -{MAX_PENALTY} and {MAX_PENALTY}"
                )
        if not (
            math.isfinite(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty: {self.repetition_penalty} must be between "
                f"{MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias: {len(self.logit_bias)} tokens, at most {MAX_LOGIT_BIAS_TOKENS}"
            )
        if self.grammar is not None and not (
            isinstance(self.grammar, str)
            and 0 < len(self.grammar.encode("utf-8")) <= MAX_GRAMMAR_BYTES
        ):
            raise ValueError(
                f"grammar: must be a non-empty string of at most {MAX_GRAMMAR_BYTES} bytes"
            )
        for token, bias in self.logit_bias.items():
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias: {bias} for token {token} must be between -{MAX_LOGIT_BIAS} "
                    f"and {MAX_LOGIT_BIAS}"
                )

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        # Below GREEDY_BELOW the sampled distribution is argmax anyway, and dividing logits by
        # such a temperature overflows to inf (NaN probabilities fail the whole batch).
        return self.temperature < GREEDY_BELOW


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (keeps >= 1).
        drop = (torch.cumsum(probs, dim=-1) - probs) > params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.empty_like(scores).scatter_(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class PenaltyState:
    """One sequence's token statistics for the penalties, on the logits' device, kept on the
    sequence across steps: a step adds only the tokens appended since the last one instead of
    turning the whole history into tensors again, and the penalties then touch only the
    distinct tokens seen (`seen_ids`: prompt or output, for repetition_penalty; `out_ids` and
    `out_counts`, aligned: output, for frequency/presence). The history only grows (preemption
    keeps it). Only `seen` spans the vocabulary (one byte per token id: 152 KB at Qwen's
    152k); the output counts are kept per distinct token, where a dense float32 row cost
    another 608 KB per sequence."""

    __slots__ = ("seen", "seen_ids", "out_ids", "out_counts", "_slot", "num_tokens")

    def __init__(self) -> None:
        self.seen = self.seen_ids = self.out_ids = self.out_counts = torch.empty(0)
        self._slot: dict[int, int] = {}  # token id -> its index in out_ids / out_counts
        self.num_tokens = 0

    def copy(self) -> PenaltyState:
        """An independent copy (a speculative draft row's statistics: the sequence's plus the
        drafts before that row), costing the vocabulary bitmap, not the whole history."""
        out = PenaltyState()
        out.seen, out.seen_ids = self.seen.clone(), self.seen_ids.clone()
        out.out_ids, out.out_counts = self.out_ids.clone(), self.out_counts.clone()
        out._slot = dict(self._slot)
        out.num_tokens = self.num_tokens
        return out

    def update(
        self, token_ids: Sequence[int], num_prompt: int, vocab: int, device: torch.device
    ) -> PenaltyState:
        if self.seen.numel() != vocab or self.seen.device != device:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen_ids = self.out_ids = torch.zeros(0, dtype=torch.long, device=device)
            self.out_counts = torch.zeros(0, dtype=torch.float32, device=device)
            self._slot = {}
            self.num_tokens = 0
        start = self.num_tokens
        if len(token_ids) <= start:
            return self
        new = torch.tensor(list(token_ids[start:]), dtype=torch.long, device=device)
        new = new[new < vocab]
        fresh = torch.unique(new[~self.seen[new]])
        self.seen[fresh] = True
        self.seen_ids = torch.cat((self.seen_ids, fresh))
        # The output's counts, on the host: a decode step adds one token.
        added = Counter(t for t in token_ids[max(start, num_prompt) :] if 0 <= t < vocab)
        if added:
            first_seen, first_counts, seen_again, again_counts = [], [], [], []
            for token, count in added.items():
                slot = self._slot.get(token)
                if slot is None:
                    self._slot[token] = len(self._slot)
                    first_seen.append(token)
                    first_counts.append(float(count))
                else:
                    seen_again.append(slot)
                    again_counts.append(float(count))
            if seen_again:
                self.out_counts.index_add_(
                    0,
                    torch.tensor(seen_again, dtype=torch.long, device=device),
                    torch.tensor(again_counts, dtype=torch.float32, device=device),
                )
            if first_seen:
                ids = torch.tensor(first_seen, dtype=torch.long, device=device)
                counts = torch.tensor(first_counts, dtype=torch.float32, device=device)
                self.out_ids = torch.cat((self.out_ids, ids))
                self.out_counts = torch.cat((self.out_counts, counts))
        self.num_tokens = len(token_ids)
        return self


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], int]],
    states: Sequence[PenaltyState | None] | None = None,
) -> torch.Tensor:
    """Logit bias and penalties (see the module docstring) for the rows that ask; the others,
    and `logits` itself, are left as they are. histories[i]: (prompt + output token ids,
    number of prompt tokens) of row i; states[i]: that sequence's PenaltyState kept across
    steps (None: built from the whole history for this call)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    for i in rows:
        p = params[i]
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values())).to(row))
        rep = p.repetition_penalty != 1.0
        if not (rep or p.frequency_penalty or p.presence_penalty):
            continue
        state = (states[i] if states is not None else None) or PenaltyState()
        token_ids, num_prompt = histories[i]
        state.update(token_ids, num_prompt, vocab, row.device)
        if rep and state.seen_ids.numel():
            scores = row[state.seen_ids]
            row[state.seen_ids] = torch.where(
                scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and state.out_ids.numel():
            row[state.out_ids] -= p.frequency_penalty * state.out_counts + p.presence_penalty
    return out


def argmax_rows(scores: torch.Tensor) -> list[int]:
    """Each row's argmax: the first index on ties, and the first NaN where there is one, as
    torch.argmax. On CPU through numpy, whose vectorised kernel took 0.14 ms for a [32, 32000]
    float32 batch where torch's CPU argmax took 1.3 ms (6% of a batch-32 bfloat16 decode step;
    amax-then-compare, topk and max were all slower than numpy too)."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32:
        return np.argmax(scores.numpy(), axis=-1).tolist()
    return torch.argmax(scores, dim=-1).tolist()


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks (bit t % 32 of word t // 32 set: token t allowed, as
    llguidance writes them) -> [rows, vocab] bool, on the bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], int]] | None = None,
    states: Sequence[PenaltyState | None] | None = None,
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> tuple[list[int], list[float | None], list[list[tuple[int, float]] | None]]:
    """logits: [N, vocab] float32, one row per sequence. Returns token ids, the chosen tokens'
    logprobs (rows that asked) and the top_logprobs alternatives (rows that asked).
    histories (needed when a row has penalties) and states: see adjust_logits.
    allowed: (rows, their [len(rows), ceil(vocab / 32)] int32 bitmasks, see unpack_bitmask) -
    those rows sample only among their allowed tokens (structured output), after the logit
    adjustments; logprobs stay the model's."""
    scores = logits
    if any(p.adjusts_logits for p in params):
        if histories is None:
            raise ValueError("sample: penalties need each row's token history")
        scores = adjust_logits(logits, params, histories, states)
    if allowed is not None and allowed[0]:
        rows, bitmask = allowed
        if scores is logits:
            scores = logits.clone()
        index = torch.tensor(rows, device=scores.device)
        mask = unpack_bitmask(bitmask.to(scores.device, non_blocking=True), scores.shape[-1])
        masked = scores.index_select(0, index).masked_fill(~mask, float("-inf"))
        scores.index_copy_(0, index, masked)
    tokens = argmax_rows(scores)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(scores[i], p, generators[i])
    logprobs: list[float | None] = [None] * len(params)
    tops: list[list[tuple[int, float]] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        values = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        for i, value in zip(rows, values, strict=True):
            logprobs[i] = value
        k = min(max(params[i].top_logprobs for i in rows), lp.shape[-1])
        if k > 0:
            top_values, top_ids = lp.topk(k, dim=-1)
            for r, i in enumerate(rows):
                n = params[i].top_logprobs
                if n:
                    pairs = zip(top_ids[r, :n].tolist(), top_values[r, :n].tolist(), strict=True)
                    tops[i] = [(int(t), float(v)) for t, v in pairs]
    return tokens, logprobs, tops


# Prompt rows turned into logits at a time: [rows, vocab] float32 is 64 MiB at 128k vocab.
PROMPT_LOGITS_ROWS = 128


def prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    top: int,
) -> list[tuple[float, list[tuple[int, float]] | None]]:
    """The logprob of each target token (the prompt's next token) under the logits of the
    hidden row before it, and the `top` most likely alternatives; hidden: [len(targets), h].
    Rows go through logits_of a slice at a time, so a long prompt never holds its whole
    [tokens, vocab] logits."""
    out: list[tuple[float, list[tuple[int, float]] | None]] = []
    for at in range(0, len(targets), PROMPT_LOGITS_ROWS):
        rows = hidden[at : at + PROMPT_LOGITS_ROWS]
        lp = torch.log_softmax(logits_of(rows).float(), dim=-1)
        want = torch.tensor(targets[at : at + rows.shape[0]], device=lp.device)
        values = lp.gather(1, want.unsqueeze(1)).squeeze(1).tolist()
        if top:
            top_values, top_ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
            pairs = zip(top_ids.tolist(), top_values.tolist(), strict=True)
            tops: list[list[tuple[int, float]] | None] = [
                list(zip(ids, vals, strict=True)) for ids, vals in pairs
            ]
        else:
            tops = [None] * len(values)
        out.extend(zip(values, tops, strict=True))
    return out
