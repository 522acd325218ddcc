"""The generation loop: one background thread owns the model and the running batch.

The HTTP side never touches the model. It posts commands to a thread-safe inbox and
gets answers through callbacks. Between two decode steps the loop drains the inbox,
admits waiting requests (prefill + merge into the running batch, so concurrent
requests share every forward pass), runs one decode step, and retires finished rows.

Control semantics follow SGLang:

* ``pause(mode)``: ``abort`` finishes every in-flight and queued request with
  finish_reason abort (tokens so far included); ``in_place`` stops at a token
  boundary and keeps the KV cache; ``retract`` drops the KV cache and puts running
  requests back in the queue (they are re-prefilled, prompt + tokens so far, on
  continue, so a weight update in between takes effect for the remaining tokens).
  New requests queue while paused.
* ``call(fn, drain=True)`` (weight updates): when not paused, stop admitting, let the
  running batch finish, then run ``fn`` (SGLang holds its model-update lock until
  in-flight requests finish); when paused, run at once.
* ``abort(rid)`` matches rid prefixes, as SGLang's scheduler does (so ``rid`` also
  aborts the ``rid_0..rid_{n-1}`` children of an n>1 request).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .model_runner import BatchState, ModelRunner
from .protocol import GenRequest, finish_abort, finish_length, finish_stop
from .routing import start_len_error
from .sampling import prompt_logprobs, sample_next

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    req: GenRequest
    on_done: Callable[[GenRequest], None]
    generator: torch.Generator | None = None
    aborted: str | None = None  # abort message, set from the inbox
    prefilled_once: bool = False
    routing: list[torch.Tensor] | None = None
    """Routed experts of every token fed so far, in position order ([n, layers, top_k]
    pieces: the prefill's, then one per decode step); only when the request asks."""


@dataclass
class _Call:
    fn: Callable[[], Any]
    drain: bool
    on_done: Callable[[Any, BaseException | None], None]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        eos_ids: set[int],
        tokenizer=None,
        max_running: int = 64,
        seed: int = 0,
        context_len: int | None = None,
    ):
        self.runner = runner
        self.context_len = context_len
        self.eos_ids = set(eos_ids)
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.fallback_gen = torch.Generator().manual_seed(seed)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[_Slot] = []
        self.running: list[_Slot] = []
        self.batch: BatchState | None = None
        self.next_tokens: list[int] = []  # sampled but not yet fed, one per running row
        self.paused: str | None = None  # None or the pause mode
        self.hold_admission = False  # memory released (memory.py): queued requests wait
        self.calls: list[_Call] = []
        self.steps = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ---- thread-safe API -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(("wake",))
        self._thread.join(timeout=10)

    def submit(self, req: GenRequest, on_done: Callable[[GenRequest], None]) -> None:
        self.inbox.put(("add", req, on_done))

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.inbox.put(("abort", rid, abort_all))

    def pause(self, mode: str, on_done: Callable[[], None]) -> None:
        self.inbox.put(("pause", mode, on_done))

    def resume(self, on_done: Callable[[], None]) -> None:
        self.inbox.put(("continue", on_done))

    def call(self, fn: Callable[[], Any], drain: bool, on_done: Callable[[Any, BaseException | None], None]) -> None:
        self.inbox.put(("call", _Call(fn, drain, on_done)))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting)

    def holds_kv(self) -> bool:
        return self.batch is not None and self.batch.size > 0

    # ---- loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            try:
                can_step = self.paused is None and (bool(self.running) or self._admittable())
                self._drain_inbox(block=not can_step and not any(map(self._ready, self.calls)))
                self._run_ready_calls()
                if self.paused is None and not self._draining() and not self.hold_admission:
                    self._admit()
                if self.paused is None and self.running:
                    self._decode_step()
            except Exception as exc:  # keep serving; fail the requests that were in the step
                log.exception("generation step failed")
                self._fail_running(f"engine error: {exc}")

    def _fail_running(self, message: str) -> None:
        failed, self.running, self.batch, self.next_tokens = self.running, [], None, []
        for slot in failed:
            self._finish(slot, finish_abort(message, status_code=500))

    def _admittable(self) -> bool:
        return bool(self.waiting) and self.paused is None and not self._draining() and not self.hold_admission

    def _draining(self) -> bool:
        return any(c.drain for c in self.calls) and self.paused is None

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = msg[0]
            if kind == "add":
                req, on_done = msg[1], msg[2]
                slot = _Slot(req, on_done)
                try:
                    if req.params.sampling_seed is not None:
                        # Per-request generator: the samples do not depend on batch company.
                        slot.generator = torch.Generator().manual_seed(req.params.sampling_seed)
                except Exception as exc:
                    self._finish(slot, finish_abort(f"bad sampling_seed: {exc}", status_code=400))
                    continue
                # While paused, new requests wait (SGLang holds them at the tokenizer).
                self.waiting.append(slot)
            elif kind == "abort":
                self._abort(msg[1], msg[2], "Aborted by AbortReq.")
            elif kind == "pause":
                self._pause(msg[1])
                msg[2]()
            elif kind == "continue":
                self.paused = None
                msg[1]()
            elif kind == "call":
                self.calls.append(msg[1])

    def _ready(self, c: _Call) -> bool:
        return (not c.drain) or self.paused is not None or not self.running

    def _run_ready_calls(self) -> None:
        for c in [c for c in self.calls if self._ready(c)]:
            self.calls.remove(c)
            try:
                result, err = c.fn(), None
            except BaseException as exc:  # reported to the HTTP caller
                result, err = None, exc
            c.on_done(result, err)

    def _abort(self, rid: str, abort_all: bool, message: str) -> None:
        def hit(slot: _Slot) -> bool:
            return abort_all or (bool(rid) and slot.req.rid.startswith(rid))

        for slot in [s for s in self.waiting if hit(s)]:
            self.waiting.remove(slot)
            self._finish(slot, finish_abort(message))
        for slot in self.running:
            if hit(slot):
                slot.aborted = message
        if any(s.aborted for s in self.running):
            self._retire()

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort("", True, "Aborted by pause_generation.")
        elif mode == "retract":
            # Free the KV cache; requests restart from prompt + tokens so far.
            for slot in self.running:
                slot.req.num_retractions += 1
            self.waiting = self.running + self.waiting
            self.running, self.batch, self.next_tokens = [], None, []
        self.paused = mode

    # ---- admission (prefill) -----------------------------------------------------------
    def _admit(self) -> None:
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:
            return
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        ready = []
        for slot in new:
            error = self._routing_error(slot.req)
            if error is not None:
                self._finish(slot, finish_abort(error, status_code=400))
            elif slot.req.params.max_new_tokens == 0 and not slot.req.output_ids:
                self._finish(slot, finish_length(0))
            else:
                ready.append(slot)
        if not ready:
            return
        try:
            state, logits = self._prefill(ready)
        except Exception as exc:
            # These requests are not in the running batch yet: answer them here, or their
            # HTTP callers would wait forever. The running batch is untouched.
            log.exception("prefill failed")
            for slot in ready:
                self._finish(slot, finish_abort(f"engine error during prefill: {exc}", status_code=500))
            return
        for slot in ready:
            slot.prefilled_once = True
        self.batch = ModelRunner.merge(self.batch, state)
        self.running.extend(ready)
        self.next_tokens.extend(self._sample(ready, logits))
        self._retire()

    def _prefill(self, ready: list[_Slot]):
        seqs = [s.req.input_ids + s.req.output_ids for s in ready]
        want_prompt_lp = [s.req.return_logprob and s.req.logprob_start_len >= 0 and not s.prefilled_once for s in ready]
        state, logits = self.runner.prefill(seqs, full_logits=any(want_prompt_lp))
        t_all = state.mask.shape[1]
        for b, slot in enumerate(ready):
            if slot.req.return_routed_experts:  # a re-prefill (retract) recomputes them all
                slot.routing = [self.runner.last_routing[b, t_all - len(seqs[b]):]]
        if any(want_prompt_lp):
            t = logits.shape[1]
            for b, slot in enumerate(ready):
                if want_prompt_lp[b]:
                    row = logits[b, t - len(seqs[b]):]
                    r = slot.req
                    r.input_logprobs, r.input_top_logprobs = prompt_logprobs(
                        row, r.input_ids, min(r.logprob_start_len, len(r.input_ids)), r.top_logprobs_num
                    )
            logits = logits[:, -1, :]
        return state, logits

    # ---- decode ------------------------------------------------------------------------
    def _decode_step(self) -> None:
        logits = self.runner.decode(self.batch, self.next_tokens)
        for b, slot in enumerate(self.running):
            if slot.routing is not None:
                slot.routing.append(self.runner.last_routing[b])
        self.steps += 1
        self.next_tokens = self._sample(self.running, logits)
        self._retire()

    def _sample(self, slots: list[_Slot], logits: torch.Tensor) -> list[int]:
        reqs = [s.req for s in slots]
        toks, lps, tops = sample_next(logits, reqs, [s.generator for s in slots], self.fallback_gen, self.eos_ids)
        for slot, tok, lp, top in zip(slots, toks, lps, tops):
            r = slot.req
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            if top is not None:
                r.output_top_logprobs.append(top)
            r.finish_reason = self._check_finished(r)
        return toks

    def _check_finished(self, r: GenRequest) -> dict | None:
        p, tok = r.params, r.output_ids[-1]
        if p.stop_strs and self.tokenizer is not None:
            tail = self.tokenizer.decode(r.output_ids[-64:], skip_special_tokens=p.skip_special_tokens)
            for s in p.stop_strs:
                if s in tail:
                    return finish_stop(s)
        if not p.ignore_eos and (tok in p.stop_token_ids or tok in self.eos_ids):
            return finish_stop(tok)
        if len(r.output_ids) >= p.max_new_tokens:
            return finish_length(p.max_new_tokens)
        if self.context_len is not None and len(r.input_ids) + len(r.output_ids) >= self.context_len:
            return finish_length(len(r.output_ids))  # out of positions: stop, like a length cap
        return None

    def _retire(self) -> None:
        """Remove finished / aborted rows from the running batch, then answer their callers.

        The batch is shrunk first so that a caller who has its answer never sees its own
        request still counted in ``num_running`` (a client waiting for "running" would
        mistake the old request for its next one).
        """
        keep, done = [], []
        for i, slot in enumerate(self.running):
            if slot.aborted:
                done.append((slot, finish_abort(slot.aborted)))
            elif slot.req.finish_reason is not None:
                done.append((slot, slot.req.finish_reason))
            else:
                keep.append(i)
        if not done:
            return
        self.batch = ModelRunner.select(self.batch, keep) if keep else None
        self.running = [self.running[i] for i in keep]
        self.next_tokens = [self.next_tokens[i] for i in keep]
        for slot, reason in done:
            self._finish(slot, reason)

    def _routing_error(self, req: GenRequest) -> str | None:
        if not req.return_routed_experts:
            return None
        if self.runner.routing is None:
            return ("return_routed_experts needs the engine started with "
                    "--enable-return-routed-experts")
        return start_len_error(req.routed_experts_start_len, len(req.input_ids))

    def _finish(self, slot: _Slot, reason: dict) -> None:
        r = slot.req
        if r.return_routed_experts and self.runner.routing is not None:
            # SGLang's rows: positions [start_len, seqlen - 1); the last sampled token was
            # never fed, so the pieces end exactly there.
            layers, k = self.runner.routing.num_layers, self.runner.routing.top_k
            rows = torch.cat(slot.routing) if slot.routing else torch.zeros(0, layers, k, dtype=torch.int16)
            end = max(len(r.input_ids) + len(r.output_ids) - 1, 0)
            r.routed_experts = rows[r.routed_experts_start_len:end]
        slot.req.finish_reason = reason
        try:
            slot.on_done(slot.req)
        except Exception:
            log.exception("on_done callback failed for %s", slot.req.rid)
