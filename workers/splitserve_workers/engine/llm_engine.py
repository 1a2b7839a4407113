"""LLMEngine: the engine's public API (methods documented below; names re-exported by
__init__.py).

It loads the model (loader.py), sizes the KV block pool (block_manager.py), and runs one
scheduler iteration per step(): schedule under the lock, forward pass and sampling outside it
(model_runner.py, sampling.py), then token bookkeeping (stops, finishing, prefix-cache blocks)
under the lock again. Other threads only enqueue requests/aborts or touch reservations, which
the step thread never reads during a forward pass.

Additions to the shared contract (nothing in it changed):
- finish_reason "error": a request whose on_kv callback raised is finished with it (its blocks
  are freed; the other requests of the batch carry on); so is every request of a forward pass
  that raised (step() logs the exception and returns, the engine keeps serving).
- A seeded request draws token i from a generator seeded with (seed, i), so a disaggregated run
  (first token on one engine, the rest on another) samples exactly what a local run samples.
- A prefill_only request always finishes with "prefill_done", even if its first token is EOS;
  start_decode() then finishes it at once ("stop"/"length", token_id None) on the decode side.
- abort() of a reservation (reserved, not yet started) frees it and emits nothing.
- When one sequence alone needs more blocks than the whole cache, it finishes with "length".
- EngineConfig.enable_mixed_batches (default off): decode steps ride in prefill passes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, replace
from typing import Any

import torch

from splitserve_workers.engine.block_manager import BlockManager
from splitserve_workers.engine.config import EngineConfig
from splitserve_workers.engine.grammar import GrammarError, Grammars, executor
from splitserve_workers.engine.layers.linear import cpu_native_bf16
from splitserve_workers.engine.loader import load_model
from splitserve_workers.engine.memory import free_memory
from splitserve_workers.engine.model_config import ModelConfig
from splitserve_workers.engine.model_runner import ModelRunner
from splitserve_workers.engine.sampling import (
    PenaltyState,
    SamplingParams,
    prompt_logprobs,
    sample,
)
from splitserve_workers.engine.scheduler import Scheduler
from splitserve_workers.engine.sequence import (
    OnKV,
    Priority,
    Sequence,
    SequenceStatus,
    TokenOutput,
)
from splitserve_workers.engine.speculative import Drafter
from splitserve_workers.engine.tokenizer import Tokenizer, prompt_context

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class IterationStats:
    """Facts about the last step(), for metrics."""

    num_running: int = 0
    num_waiting: int = 0
    batch_size: int = 0  # sequences observed in the last iteration
    num_prefill_tokens: int = 0
    # Tokens decode steps computed; for a speculative pass each sequence's last token and its
    # drafts, of which num_generated_tokens were emitted (else the two are equal).
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    kv_usage: float = 0.0  # 0..1, blocks held by requests and reservations
    free_blocks: int = 0
    total_blocks: int = 0
    preemptions_total: int = 0
    prefix_cache_hits_total: int = 0  # blocks
    prefix_cache_queries_total: int = 0  # blocks
    queued_prefill_tokens: int = 0
    # Seconds spent in forward passes and sampling since start (the autoscaler's utilization).
    busy_seconds_total: float = 0.0
    # Speculative decoding: draft tokens verified and accepted since start.
    draft_tokens_total: int = 0
    accepted_tokens_total: int = 0


@dataclass
class _Reservation:
    num_prompt_tokens: int
    block_table: list[int]
    imported: list[bytearray]  # per layer, 1 per token already written
    slots: torch.Tensor  # [num_prompt_tokens] flat cache slot of each prompt token (on device)
    # The prompt's leading tokens found in this engine's prefix cache at reserve (whole blocks):
    # their KV is here already, so only the tokens after them are imported.
    cached_token_ids: tuple[int, ...] = ()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device: {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        # A bfloat16 checkpoint stays bfloat16 where the CPU has bfloat16 instructions (half
        # the memory, ~2x the matmul rate of float32 there); otherwise float32.
        if model_config.torch_dtype == "bfloat16" and cpu_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES.get(model_config.torch_dtype, torch.bfloat16)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        if config.max_model_len is not None:
            if config.max_model_len > mc.max_model_len:
                raise ValueError(
                    f"EngineConfig.max_model_len: {config.max_model_len} exceeds the model's "
                    f"limit {mc.max_model_len}"
                )
            mc.max_model_len = config.max_model_len
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        self.tokenizer = Tokenizer(config.model)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
        self.grammars = Grammars(self.tokenizer.to_json(), mc.vocab_size, list(self.eos_token_ids))
        self.model = load_model(
            config.model, mc, self.dtype, self.device, prepack=config.cpu_weight_prepack
        )
        self.block_size = config.block_size
        self.num_kv_blocks, self.kv_cache_sizing = self._size_kv_cache(config)
        self.block_manager = BlockManager(
            self.num_kv_blocks, self.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager, mc.max_model_len)
        self.model_runner = ModelRunner(
            self.model, mc, self.dtype, self.device, self.num_kv_blocks, self.block_size,
            cpu_decode_kernel=config.cpu_decode_kernel,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._seqs: dict[str, Sequence] = {}  # every request not finished (incl. not yet queued)
        self._pending_add: list[Sequence] = []
        self._pending_abort: set[str] = set()
        self._reservations: dict[str, _Reservation] = {}
        self._outputs: list[TokenOutput] = []  # produced outside step(): aborts, early finishes
        self._stats = IterationStats(total_blocks=self.num_kv_blocks)
        self._busy_seconds_total = 0.0
        self._draft_tokens_total = 0  # speculative decoding: drafts verified
        self._accepted_tokens_total = 0  # ... and accepted

    def _size_kv_cache(self, config: EngineConfig) -> tuple[int, str]:
        """The block count, and how it was chosen (logged by the workers)."""
        per_block = self.block_size * self.kv_bytes_per_token()
        if config.num_kv_blocks:
            return config.num_kv_blocks, "num_kv_blocks"
        fraction = config.kv_cache_memory_fraction
        if fraction is None:
            budget = config.kv_cache_memory_bytes
            return max(1, budget // per_block), f"kv_cache_memory_bytes {budget}"
        free = free_memory(self.device)  # the weights are loaded: what is left after them
        budget = int(free.bytes * fraction)
        if budget < per_block:
            raise ValueError(
                f"EngineConfig.kv_cache_memory_fraction: {fraction:g} of {free.bytes} bytes free "
                f"({free.source}) is {budget} bytes, less than one KV block ({per_block} bytes)"
            )
        return budget // per_block, f"{fraction:g} of {free.bytes} bytes free ({free.source})"

    # ---- facts -------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x dtype bytes."""
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem

    def has_unfinished(self) -> bool:
        """Requests queued or running, or outputs not yet returned by step()."""
        with self._lock:
            return bool(self._seqs or self._outputs)

    def stats(self) -> IterationStats:
        """The last step's batch facts with the current queue and cache numbers."""
        with self._lock:
            return self._snapshot(self._stats)

    def _snapshot(self, base: IterationStats) -> IterationStats:
        bm = self.block_manager
        free = bm.num_free_blocks
        return replace(
            base,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._pending_add),
            kv_usage=1.0 - free / bm.num_blocks,
            free_blocks=free,
            total_blocks=bm.num_blocks,
            preemptions_total=self.scheduler.preemptions_total,
            prefix_cache_hits_total=bm.prefix_cache_hits_total,
            prefix_cache_queries_total=bm.prefix_cache_queries_total,
            busy_seconds_total=self._busy_seconds_total,
            draft_tokens_total=self._draft_tokens_total,
            accepted_tokens_total=self._accepted_tokens_total,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens()
            + sum(s.num_tokens for s in self._pending_add),
        )

    # ---- requests ----------------------------------------------------------------------------
    def _check_prompt(self, prompt_token_ids: list[int], field: str) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"{field}: the prompt is empty")
        limit = self.model_config.max_model_len
        if len(prompt_token_ids) > limit:
            raise ValueError(
                f"{field}: the prompt has {len(prompt_token_ids)} tokens, more than "
                f"max_model_len {limit}"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})")
        need = self.block_manager.blocks_for(len(prompt_token_ids) + 1)
        if need > self.num_kv_blocks:
            raise ValueError(
                f"{field}: the prompt needs {need} KV blocks; the cache has {self.num_kv_blocks}"
            )

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority,
        prefill_only: bool = False,
        on_kv: OnKV | None = None,
    ) -> Sequence:
        params.validate(self.model_config.vocab_size)
        seq = Sequence(request_id, prompt_token_ids, params, priority, prefill_only)
        if on_kv is not None:
            seq.on_kv = _guard(seq, on_kv)
        if params.seed is not None and not params.greedy:
            seq.generator = torch.Generator(device=self.device)
        c = self.config
        if c.speculative_tokens and not prefill_only:
            # The prompt's n-grams indexed here, on the caller's thread and without the engine
            # lock (~100 ms for 8k tokens in Python), not in a decode pass that every running
            # sequence waits for; the step loop then indexes only the new tokens.
            seq.drafter = Drafter(
                c.speculative_tokens, c.speculative_ngram_min, c.speculative_ngram_max
            )
            seq.drafter.index.add(prompt_token_ids)
        if params.grammar is not None:
            try:  # compiled here, on the caller's thread, not in the step loop
                seq.matcher = self.grammars.matcher(params.grammar)
            except GrammarError as e:
                raise ValueError(f"grammar: {e}") from e
        return seq

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        prefill_only: bool = False,
        on_kv: OnKV | None = None,
    ) -> None:
        """Queues a request (applied at the next step). prefill_only: finish after the first
        token ("prefill_done"). on_kv(request_id, layer, token_start, k, v) receives every prompt
        token's KV once per layer, from the step thread, as soon as the layer is computed.
        ValueError (naming the field) for an empty/too long prompt or bad parameters."""
        self._check_prompt(prompt_token_ids, "prompt_token_ids")
        seq = self._new_sequence(
            request_id, prompt_token_ids, params, priority, prefill_only, on_kv
        )
        with self._lock:
            self._check_new_id(request_id)
            self._seqs[request_id] = seq
            self._pending_add.append(seq)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._seqs or request_id in self._reservations:
            raise ValueError(f"request_id: {request_id!r} is already in use")

    def abort(self, request_id: str) -> bool:
        """Frees the request's blocks at the next step(), which emits finished/"abort" once.
        A reservation is freed at once. False if the id is unknown (or already finished)."""
        with self._lock:
            reservation = self._reservations.pop(request_id, None)
            if reservation is not None:
                self.block_manager.free(reservation.block_table)
                return True
            if request_id not in self._seqs:
                return False
            self._pending_abort.add(request_id)
            return True

    def _apply_aborts(self) -> None:
        for request_id in self._pending_abort:
            seq = self._seqs.get(request_id)
            if seq is None:
                continue
            if seq in self._pending_add:
                self._pending_add.remove(seq)
            self._finish(seq, "abort")
            self._outputs.append(self._output(seq, None, None))
        self._pending_abort.clear()

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    @staticmethod
    def _output(seq: Sequence, token: int | None, logprob: float | None) -> TokenOutput:
        return TokenOutput(
            request_id=seq.request_id,
            token_id=token,
            logprob=logprob,
            finished=seq.status is SequenceStatus.FINISHED,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """One scheduler iteration (prefill, decode or mixed pass). Call from ONE thread."""
        with self._lock:
            self._apply_aborts()
            for seq in self._pending_add:
                self.scheduler.add_waiting(seq)
            self._pending_add.clear()
            batch, too_long = self.scheduler.schedule()
            for seq in too_long:
                self._finish(seq, "length")
                self._outputs.append(self._output(seq, None, None))
            outputs, self._outputs = self._outputs, []
            if batch is None:
                self._stats = self._snapshot(IterationStats())
                return outputs
            seqs, counts = batch.seqs, batch.num_new_tokens

        # Forward pass and sampling without the lock: other threads only queue work meanwhile.
        started = time.perf_counter()
        try:
            if batch.is_prefill:
                starts = [s.num_computed_tokens for s in seqs]
                want = [i for i, s in enumerate(seqs) if s.wants_prompt_logprobs]
                logits, done, hidden = self.model_runner.run_prefill(seqs, counts, want)
                for i, rows in zip(want, hidden, strict=True):
                    self._prompt_logprobs(seqs[i], starts[i], rows)
            else:
                done = list(range(len(seqs)))
                if batch.drafts is not None:
                    logits = self.model_runner.run_verify(seqs, batch.drafts)
                else:
                    logits = self.model_runner.run_decode(seqs)
            # One row per sampled sequence; a speculative pass has 1 + len(draft) rows for each,
            # row j sampling output token (num_output_tokens + j) as a plain step would.
            rows_of = [counts[i] if batch.drafts is not None else 1 for i in done]
            sampled = [seqs[i] for i, n in zip(done, rows_of, strict=True) for _ in range(n)]
            generators = [
                g for i, n in zip(done, rows_of, strict=True) for g in _generators(seqs[i], n)
            ]
            params = [s.params for s in sampled]
            # Token histories only for a batch with penalties (built every step otherwise).
            penalized = any(p.adjusts_logits for p in params)
            histories, states = (
                _histories(seqs, done, rows_of, batch.drafts, logits) if penalized else (None, None)
            )
            tokens, logprobs, tops = sample(
                logits,
                params,
                generators,
                histories,
                states,
                _grammar_masks(sampled, logits.shape[-1], _drafts_by_sequence(seqs, batch.drafts)),
            )
        except Exception:
            # A failed pass fails its batch, not the engine: answer and free those requests.
            log.exception("forward pass failed for %d requests", len(seqs))
            with self._lock:
                self._busy_seconds_total += time.perf_counter() - started
                self._apply_aborts()
                for seq in seqs:
                    if seq.status is not SequenceStatus.FINISHED:
                        self._finish(seq, "error")
                        outputs.append(self._output(seq, None, None))
                outputs.extend(self._outputs)
                self._outputs = []
                self._stats = self._snapshot(IterationStats(batch_size=len(seqs)))
            return outputs
        sampled_at: dict[int, int] = {}
        for row, s in enumerate(sampled):
            sampled_at.setdefault(id(s), row)  # a speculative sequence's first row

        with self._lock:
            self._busy_seconds_total += time.perf_counter() - started
            self._apply_aborts()
            outputs.extend(self._outputs)
            self._outputs = []
            generated = 0 if batch.drafts is not None else batch.num_decode
            for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
                if seq.status is SequenceStatus.FINISHED:
                    continue  # aborted during the forward pass
                if seq.error is not None:
                    log.error("request %s: on_kv failed: %r", seq.request_id, seq.error)
                    self._finish(seq, "error")
                    outputs.append(self._output(seq, None, None))
                    continue
                j = sampled_at.get(id(seq))
                if batch.drafts is not None:
                    assert j is not None
                    picked = zip(
                        tokens[j : j + n], logprobs[j : j + n], tops[j : j + n], strict=True
                    )
                    accepted = self._accept(seq, batch.drafts[i], list(picked))
                    outputs.extend(accepted)
                    generated += len(accepted)
                    continue
                self.scheduler.mark_computed(seq, n)
                if j is None:
                    continue  # a chunk of a longer prompt; more to come
                if seq.status is SequenceStatus.WAITING:
                    self.scheduler.waiting.remove(seq)
                    self.scheduler.add_running(seq)
                outputs.append(self._append_token(seq, tokens[j], logprobs[j], tops[j]))
            decode_tokens = sum(counts) if batch.drafts is not None else batch.num_decode
            self._stats = self._snapshot(
                IterationStats(
                    batch_size=len(seqs),
                    num_prefill_tokens=sum(counts) - decode_tokens,
                    num_decode_tokens=decode_tokens,
                    num_generated_tokens=generated,
                )
            )
        return outputs

    def _accept(
        self,
        seq: Sequence,
        draft: list[int],
        picked: list[tuple[int, float | None, list[tuple[int, float]] | None]],
    ) -> list[TokenOutput]:
        """A speculative pass's rows for one sequence (speculative.py): each row's sampled
        token is emitted, and the next row counts only while the token equals the draft token
        that row was computed after. The KV of the last token and the accepted drafts is
        kept; the blocks taken for the rest are freed."""
        outs: list[TokenOutput] = []
        accepted = 0
        for r, (token, logprob, top) in enumerate(picked):
            outs.append(self._append_token(seq, token, logprob, top))
            hit = r < len(draft) and token == draft[r]
            accepted += hit
            if not hit or seq.status is SequenceStatus.FINISHED:
                break
        self._draft_tokens_total += len(draft)
        self._accepted_tokens_total += accepted
        if seq.drafter is not None:
            seq.drafter.update(len(draft), accepted)
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.mark_computed(seq, len(outs))
            self.scheduler.trim(seq)
        return outs

    def _prompt_logprobs(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Fills seq.prompt_logprobs for the prompt tokens after positions [start, start + n)
        (hidden: those positions' final hidden states). The last prompt position's next token
        is the first output: its logprob comes with it, as for any generated token."""
        assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
        n = min(hidden.shape[0], seq.num_prompt_tokens - 1 - start)
        if n <= 0:
            return
        targets = seq.token_ids[start + 1 : start + 1 + n]
        entries = prompt_logprobs(
            self.model_runner.model.compute_logits, hidden[:n], targets, seq.params.prompt_logprobs
        )
        seq.prompt_logprobs[start : start + n] = entries

    def _append_token(
        self,
        seq: Sequence,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None = None,
    ) -> TokenOutput:
        seq.token_ids.append(token)
        reason = "prefill_done" if seq.prefill_only else self._stop_reason(seq, token)
        grammar_error = None
        if seq.matcher is not None:
            if seq.matcher.is_error():
                # Failed while computing this step's mask (a limit it hit): its mask allowed
                # only EOS, so the token is no answer; never report that as "stop".
                # The request's grammar at fault (the caller is told why): no ERROR, and the
                # parser's state dump, which quotes the client's grammar, only at debug.
                dump = seq.matcher.get_error().strip()
                log.debug("request %s: grammar failed: %s", seq.request_id, dump)
                grammar_error = dump.split("\n")[0]
                log.info("request %s: grammar failed: %s", seq.request_id, grammar_error)
                reason = "error"
            elif seq.num_output_tokens == 1:
                # The first token (a prefill worker's too: the decode side's matcher starts by
                # consuming it, so a grammar that fails on it is refused before it goes out).
                refused, failed = self._feed_first(seq, token)
                if failed is not None:
                    grammar_error, reason = failed, "error"
                elif refused:  # sampled under the mask: this engine's fault (a 502)
                    log.error("request %s: token %d breaks its grammar", seq.request_id, token)
                    reason = "error"
                elif reason != "prefill_done" and seq.matcher.is_stopped():
                    reason = "stop"
            elif reason != "prefill_done":
                # A token sampled under the mask that the matcher then refuses is this
                # engine's fault, not the request's: "error" without a grammar_error (a 502).
                reason = self._advance_grammar(seq, token) or reason
        if reason is not None:
            self._finish(seq, reason)
        out = self._output(seq, token, logprob)
        out.grammar_error = grammar_error
        out.top_logprobs = top
        if seq.wants_prompt_logprobs and seq.num_output_tokens == 1:
            assert seq.prompt_logprobs is not None and None not in seq.prompt_logprobs
            out.prompt_logprobs = seq.prompt_logprobs  # type: ignore[assignment]
            seq.prompt_logprobs_sent = True
        return out

    @staticmethod
    def _feed_first(seq: Sequence, token: int) -> tuple[bool, str | None]:
        """Feeds a request's first output token to its matcher, telling a token the grammar
        refuses (True, None) from a grammar that fails on a token it allows: a limit of
        llguidance's parser, such as an Earley row past 2000 items for a schema of hundreds of
        optional properties (False, its reason). (False, None): taken."""
        if not seq.matcher.validate_tokens([token]):
            return True, None
        if not seq.matcher.consume_token(token) or seq.matcher.is_error():
            why = seq.matcher.get_error().strip()
            log.debug("request %s: grammar failed at the first token: %s", seq.request_id, why)
            return False, why.split("\n")[0] or f"token {token} breaks it"
        return False, None

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> str | None:
        """Feeds an output token to the sequence's matcher: "stop" once the grammar is complete
        (nothing but EOS could follow), "error" for a token it refuses (never sampled under
        its mask: a matcher that failed)."""
        # consume_token accepts EOS from a matcher in an error state: check is_error too.
        if not seq.matcher.consume_token(token) or seq.matcher.is_error():
            log.error(
                "request %s: token %d breaks its grammar: %s",
                seq.request_id,
                token,
                seq.matcher.get_error(),
            )
            return "error"
        return "stop" if seq.matcher.is_stopped() else None

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop and self._hit_stop_string(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.model_config.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        # A stop string of c characters spans at most 4c bytes, hence at most 4c tokens (each
        # decodes to a byte at least), and it ends in the newest token; decoding the last 4c + 1
        # tokens each step keeps the check O(1) per token. The extra token in front matters:
        # SentencePiece-style (Metaspace) decoders drop the leading space of the first token
        # decoded. While the window still reaches the first output token, the last few prompt
        # tokens take that place and only the text after theirs is searched, so a stop string
        # " word" matches the first generated word too (as decoding prompt + output would).
        # Special tokens' text is skipped, as in the text the router shows and trims: a stop
        # string only such a token spells (an "<|im_start|>" holding "im_") never stops it.
        stop = seq.params.stop
        window = 4 * max(len(s) for s in stop) + 1
        n_out = seq.num_output_tokens
        if n_out > window:
            text = self.tokenizer.decode(seq.token_ids[-window:])
            return any(s in text for s in stop)
        out = seq.token_ids[seq.num_prompt_tokens :]
        if seq.stop_context is None:  # the prompt does not change: decoded once per request
            seq.stop_context = prompt_context(
                self.tokenizer.decode, seq.token_ids[: seq.num_prompt_tokens]
            )
        ctx, ctx_text = seq.stop_context
        text = self.tokenizer.decode(ctx + out)
        if text.startswith(ctx_text):
            text = text[len(ctx_text) :]
        else:  # the context's text changed with the output after it: search the output alone
            text = self.tokenizer.decode(out)
        return any(s in text for s in stop)

    # ---- offline convenience -----------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        priorities: list[Priority] | None = None,
    ) -> list[list[int]]:
        """Offline convenience: runs step() until these prompts finish; generated ids each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} entries for {len(prompts)} prompts")
        prefix = uuid.uuid4().hex[:8]
        ids = [f"generate-{prefix}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, plist, strict=True)):
            prio = priorities[i] if priorities else Priority.INTERACTIVE
            self.add_request(rid, prompt, p, prio)
        while pending:
            for out in self.step():
                if out.request_id in results:
                    if out.token_id is not None:
                        results[out.request_id].append(out.token_id)
                    if out.finished:
                        pending.discard(out.request_id)
        return [results[rid] for rid in ids]

    # ---- decode side of a disaggregated transfer ---------------------------------------------
    def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        prompt_token_ids: SequenceT[int] | None = None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> bool:
        """Allocates blocks for the prompt + the first token now; False if they are not free,
        or while a preempted sequence of the same or a higher priority waits for blocks (it is
        admitted first).
        Given the prompt's ids, its leading full blocks found in the prefix cache are shared
        instead (never the block of the last token): `reserved_cached_tokens` says how many
        tokens those hold, whose KV then needs no import."""
        limit = self.model_config.max_model_len
        if not 1 <= num_prompt_tokens <= limit:
            raise ValueError(f"num_prompt_tokens: {num_prompt_tokens} not in [1, {limit}]")
        if prompt_token_ids is not None and len(prompt_token_ids) != num_prompt_tokens:
            raise ValueError(
                f"prompt_token_ids: {len(prompt_token_ids)} tokens, but num_prompt_tokens is "
                f"{num_prompt_tokens}"
            )
        bm = self.block_manager
        with self._lock:
            self._check_new_id(request_id)
            if any(not s.block_table and s.priority <= priority for s in self.scheduler.waiting):
                # A preempted sequence waits for blocks to be recomputed in: it goes first. A
                # reservation taking the blocks it waits for (no watermark, and between two
                # steps) starved it for as long as new reservations kept coming. Not ahead of
                # an interactive reservation, though: the scheduler would preempt a background
                # sequence for an interactive one anyway.
                return False
            cached = 0
            if prompt_token_ids is not None and bm.enable_prefix_caching:
                got = bm.allocate_with_prefix(prompt_token_ids, num_prompt_tokens + 1)
                if got is None:
                    return False
                table, hashes = got
                cached = len(hashes) * bm.block_size
            else:
                need = bm.blocks_for(num_prompt_tokens + 1)
                if need > bm.num_free_blocks:
                    return False
                table = bm.allocate(need)
            imported = [bytearray(num_prompt_tokens) for _ in range(self.model_config.num_layers)]
            for marks in imported:
                marks[:cached] = b"\x01" * cached
            self._reservations[request_id] = _Reservation(
                num_prompt_tokens,
                table,
                imported,
                # Computed once here: import_kv runs once per chunk and only slices it.
                self.model_runner.slots(table, 0, num_prompt_tokens).to(self.device),
                tuple(prompt_token_ids[:cached]) if prompt_token_ids is not None else (),
            )
            return True

    def reserved_cached_tokens(self, request_id: str) -> int:
        """Tokens of a reservation's prompt whose KV was already cached here (0 if none)."""
        with self._lock:
            r = self._reservations.get(request_id)
            return len(r.cached_token_ids) if r is not None else 0

    def import_kv(
        self, request_id: str, layer: int, token_start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Writes K/V of tokens [token_start, token_start + n) into a reservation's blocks:
        [n, kv_heads, head_dim] for `layer`, or [layers, n, kv_heads, head_dim] for that many
        consecutive layers from `layer` (one call for a chunk that carries several layers).
        ValueError on an unknown reservation, out-of-range layers/tokens, or wrong shape/dtype."""
        mc = self.model_config
        shape = (mc.num_kv_heads, mc.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() not in (3, 4) or tuple(t.shape[-2:]) != shape:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)}, expected [n_tokens, {shape[0]}, {shape[1]}]"
                    f" or [layers, n_tokens, {shape[0]}, {shape[1]}]"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{name}: dtype {t.dtype}, the engine uses {self.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k/v: shapes {tuple(k.shape)} and {tuple(v.shape)} must match")
        layers = int(k.shape[0]) if k.dim() == 4 else 1
        n = int(k.shape[-3])
        if n == 0 or layers == 0:
            raise ValueError(f"k/v: shape {tuple(k.shape)} carries no tokens")
        if not (0 <= layer and layer + layers <= mc.num_layers):
            span = f"{layer}" if layers == 1 else f"[{layer}, {layer + layers})"
            raise ValueError(f"layer: {span} not in [0, {mc.num_layers})")
        with self._lock:
            r = self._reservations.get(request_id)
            if r is None:
                raise ValueError(f"request_id: {request_id!r} has no reservation")
            if not (0 <= token_start and token_start + n <= r.num_prompt_tokens):
                raise ValueError(
                    f"token_start: [{token_start}, {token_start + n}) is outside the reserved "
                    f"prompt [0, {r.num_prompt_tokens})"
                )
            slots = r.slots[token_start : token_start + n]
            self.model_runner.write_kv(layer, slots, k, v)
            marks = b"\x01" * n
            for i in range(layer, layer + layers):
                r.imported[i][token_start : token_start + n] = marks

    def start_decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
    ) -> None:
        """The reserved, fully imported request joins continuous batching as if its prefill ran
        here; step() emits the tokens after first_token. ValueError if KV is missing."""
        self._check_prompt(prompt_token_ids, "prompt_token_ids")
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first_token: {first_token} is outside the vocabulary")
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority)
        grammar_reason = None
        if seq.matcher is not None:
            # The prefill worker sampled first_token under the same grammar's mask (and fed it
            # to its own matcher), so a token it refuses, or one the grammar fails on, is the
            # caller's error (INVALID_ARGUMENT), not a generation that ends with
            # finish_reason "error". The sequence is not registered yet: nothing to undo.
            refused, failed = self._feed_first(seq, first_token)
            if refused:
                raise ValueError(
                    f"first_token: {first_token} is not allowed by the request's grammar"
                )
            if failed is not None:
                raise ValueError(f"grammar: {failed} (at the first token)")
            grammar_reason = "stop" if seq.matcher.is_stopped() else None
        with self._lock:
            r = self._reservations.get(request_id)
            if r is None:
                raise ValueError(f"request_id: {request_id!r} has no reservation")
            if r.num_prompt_tokens != len(prompt_token_ids):
                raise ValueError(
                    f"prompt_token_ids: {len(prompt_token_ids)} tokens, the reservation is for "
                    f"{r.num_prompt_tokens}"
                )
            cached = len(r.cached_token_ids)
            if tuple(prompt_token_ids[:cached]) != r.cached_token_ids:
                # The cached blocks hold the KV of the prompt given at reserve, not this one.
                raise ValueError(
                    f"prompt_token_ids: the first {cached} tokens differ from the prompt the "
                    "reservation found cached"
                )
            for layer, marks in enumerate(r.imported):
                missing = marks.count(0)
                if missing:
                    raise ValueError(
                        f"request {request_id!r}: layer {layer} is missing KV for {missing} of "
                        f"{r.num_prompt_tokens} prompt tokens"
                    )
            del self._reservations[request_id]
            seq.block_table = r.block_table
            seq.prompt_logprobs_sent = True  # the prefill side computes and sends them
            self._seqs[request_id] = seq
            self.scheduler.add_running(seq)
            self.scheduler.mark_computed(seq, len(prompt_token_ids))  # publishes prompt blocks
            seq.token_ids.append(first_token)
            reason = grammar_reason or self._stop_reason(seq, first_token)
            if reason is not None:
                self._finish(seq, reason)
                self._outputs.append(self._output(seq, None, None))

    def release(self, request_id: str) -> None:
        """Frees a reservation that never started (lease expiry, error). Idempotent."""
        with self._lock:
            r = self._reservations.pop(request_id, None)
            if r is not None:
                self.block_manager.free(r.block_table)

    def export_kv(self, request_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's cached KV for a layer, contiguous [n_tokens, kv_heads, head_dim]."""
        mc = self.model_config
        if not 0 <= layer < mc.num_layers:
            raise ValueError(f"layer: {layer} not in [0, {mc.num_layers})")
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is not None and seq.block_table:
                return self.model_runner.read_kv(layer, seq.block_table, 0, seq.num_computed_tokens)
            r = self._reservations.get(request_id)
            if r is not None:
                return self.model_runner.read_kv(layer, r.block_table, 0, r.num_prompt_tokens)
        raise ValueError(f"request_id: {request_id!r} has no KV in this engine")


def _drafts_by_sequence(
    seqs: list[Sequence], drafts: list[list[int]] | None
) -> dict[int, list[int]] | None:
    if drafts is None:
        return None
    return {id(s): d for s, d in zip(seqs, drafts, strict=True) if d}


def _histories(
    seqs: list[Sequence],
    done: list[int],
    rows_of: list[int],
    drafts: list[list[int]] | None,
    logits: torch.Tensor,
) -> tuple[list[tuple[list[int], int]], list[PenaltyState | None]]:
    """Each sampled row's token history and penalty statistics: a sequence's own for its first
    row; for its draft rows its tokens plus the drafts before that row (what the history is if
    they are accepted), with the statistics of the row before plus that one draft token (a
    copy, not a rebuild from the whole history)."""
    vocab, device = logits.shape[-1], logits.device
    histories: list[tuple[list[int], int]] = []
    states: list[PenaltyState | None] = []
    for i, n in zip(done, rows_of, strict=True):
        seq = seqs[i]
        history, num_prompt, state = seq.token_ids, seq.num_prompt_tokens, seq.penalty_state
        histories.append((history, num_prompt))
        states.append(state)
        if n > 1 and seq.params.adjusts_logits:
            state.update(history, num_prompt, vocab, device)
        for j in range(1, n):
            assert drafts is not None
            history = history + drafts[i][j - 1 : j]
            if seq.params.adjusts_logits:
                state = state.copy().update(history, num_prompt, vocab, device)
            histories.append((history, num_prompt))
            states.append(state)
    return histories, states


def _generators(seq: Sequence, rows: int) -> list[torch.Generator | None]:
    """The generators of a sequence's rows in one pass, row j's seeded for output token
    num_output_tokens + j (what a plain step would seed it with); None for an unseeded one."""
    if seq.generator is None:
        return [None] * rows
    assert seq.params.seed is not None
    while len(seq.draft_generators) < rows - 1:
        seq.draft_generators.append(torch.Generator(device=seq.generator.device))
    gens = [seq.generator, *seq.draft_generators[: rows - 1]]
    for j, g in enumerate(gens):
        g.manual_seed(_token_seed(seq.params.seed, seq.num_output_tokens + j))
    return list(gens)


def _grammar_masks(
    seqs: list[Sequence], vocab: int, drafts: dict[int, list[int]] | None = None
) -> tuple[list[int], torch.Tensor] | None:
    """The rows of `seqs` under a grammar and llguidance's bitmask of what each may sample next
    ([rows, ceil(vocab / 32)] int32, on the host: sample() unpacks it where the logits are, so
    a GPU gets 4 bytes per 32 tokens instead of a bool per token unpacked by the CPU, which
    costs ~0.6 ms per row at a 152k vocabulary). A drafted sequence (speculative decoding) has
    consecutive rows, one per draft token plus one (drafts: id(sequence) -> its draft): row j's
    mask is its grammar's after the draft's first j tokens. A row whose matcher allows nothing
    (it failed) is left unmasked: its token is then refused and the request ends with "error",
    not the batch."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return None
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    plain: list[tuple[Any, int]] = []
    drafted: list[tuple[Any, int, list[int]]] = []
    for r, i in enumerate(rows):
        if i > 0 and seqs[i - 1] is seqs[i]:
            continue  # a draft row: written with the sequence's first row
        draft = (drafts or {}).get(id(seqs[i]))
        if draft:
            drafted.append((seqs[i].matcher, r, draft))
        else:
            plain.append((seqs[i].matcher, r))
    if len(plain) == 1 and not drafted:
        plain[0][0].unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
    elif plain:  # in parallel on llguidance's threads (the GIL released)
        executor().unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, len(rows))
    if drafted:  # each matcher advanced through its draft and rolled back by llguidance
        executor().unsafe_compute_mask_ptr_with_draft_token(
            drafted, bitmask.data_ptr(), words * 4, len(rows)
        )
    keep = bitmask.ne(0).any(dim=-1).tolist()
    if not all(keep):
        rows = [i for i, ok in zip(rows, keep, strict=True) if ok]
        bitmask = bitmask[torch.tensor(keep)]
    return rows, bitmask


_SEED_STRIDE = 1_000_003


def _token_seed(seed: int, index: int) -> int:
    """A 64-bit generator seed for output token `index` of a request seeded with `seed` (any
    int64). Over the whole 64 bits (`% (1 << 63)` made seeds s and s - 2**63 one seed), with
    the high half folded into the low one: a CPU generator (mt19937) keeps only the low 32
    bits of its seed, so seeds that differ by a multiple of 2**32 gave the same tokens there.
    Values under 2**32 (seeds up to ~4294) are unchanged by the fold."""
    x = (seed * _SEED_STRIDE + index) % (1 << 64)
    return x ^ (x >> 32)


def _guard(seq: Sequence, on_kv: OnKV) -> OnKV:
    """Wraps a request's on_kv so its exception fails that request, not the whole batch."""

    def call(request_id: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if seq.error is not None:
            return
        try:
            on_kv(request_id, layer, start, k, v)
        except Exception as exc:  # reported as the request's error after the pass
            seq.error = exc

    return call
