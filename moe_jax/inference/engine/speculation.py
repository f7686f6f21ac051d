"""The engine's host side of speculative decoding (`Engine(speculative=True, draft_depth=K)`):
which positions a request's calls run and write, its pages for them, and what a verify call's
verdict emits. The programs, and why rejected drafts need no rollback: `draft_programs`.

    engine = Engine(sampler, speculative=True)       # a model with model.mtp_depth >= 1
    engine.generate(prompts, SamplingParams(max_tokens=64))   # the plain engine's tokens
    engine.speculation.acceptance_rate               # drafts kept over drafts checked

A request's state between calls: its newest token (the last emitted, at position `done`, not
yet fed), its K drafts (`Seq.drafts`) and the step its keys are at (`Seq.it`: the verify
calls it has had, plus one). Each decode step checks every decoding request's drafts and
emits 1..K+1 tokens of it, through its stop ids and `max_tokens`: a step ends the request
at the first token that ends it, and counts the drafts checked up to there (a draft after a
kept stop id or past `max_tokens` is never checked), as `SpeculativeSampler` counts them.
Each token's Event says the draft it was checked against (-1: none: the first token, a bonus
token), as `SpeculativeGeneration.drafts` does.

Prefill chunks: every chunk but a prompt's last ends K positions or more before the prompt's
end, so that the MTP depths over it see known tokens only (depth k at t takes token t+k),
and the last chunk holds the K positions whose entries the first drafts make hypothetical
(hence `chunk` >= K). Randomness: each request's key folded with its step and split as the
sampler's (`acceptance.step_keys`), so a request alone draws what
`SpeculativeSampler` draws for it (its row's key, `SamplingParams.row`); not the plain
engine's text at a temperature (the same distribution, drawn otherwise).
"""

from __future__ import annotations

import numpy as np

from moe_jax.errors import MoeJaxError
from moe_jax.inference.engine.draft_programs import PrefillRows, Verified, VerifyRows


def draft_depth_of(cfg, draft_depth: int | None, error: type[MoeJaxError]) -> int:
    """The depths that draft: `draft_depth`, else sample.draft_depth, else all of the
    model's MTP depths; `error` (one line) if the model has none or it is out of range."""
    depth = cfg.model.mtp_depth
    if not depth:
        raise error(
            "speculative decoding drafts with the model's MTP layers, and this model has none "
            "(model.mtp_depth=0); train with model.mtp_depth=1, or serve without speculation"
        )
    K = draft_depth or cfg.sample.draft_depth or depth
    if not 1 <= K <= depth:
        raise error(
            f"draft_depth {K} is not within [1, {depth}] (the model's MTP depths, "
            f"model.mtp_depth={depth}); give at most {depth}"
        )
    return K


class Speculation:
    """The engine's speculative prefill and decode (module doc), and its counts: drafts
    checked and kept per depth, all requests together."""

    def __init__(self, engine, K: int):
        self.engine, self.K = engine, K
        self.drafted = np.zeros(K, np.int64)  # [K]: drafts of depth k checked
        self.accepted = np.zeros(K, np.int64)  # [K]: those kept

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over checked drafts, all depths (nan before any was checked)."""
        checked = int(self.drafted.sum())
        return float(self.accepted.sum()) / checked if checked else float("nan")

    # ------------------------------------------------------------------ prefill

    def shared_prefix(self, pages: list[int]) -> list[int]:
        """Of a matched prefix's shared pages, those ending K positions before it (module doc
        of `draft_programs`); the others are released."""
        PS = self.engine.page_size
        keep = max(len(pages) - -(-self.K // PS), 0)
        self.engine.pool.release(pages[keep:])
        return pages[:keep]

    def chunk_end(self, done: int, end: int, chunk: int) -> int:
        """Where a chunk from `done` ends for a prefill to `end` (module doc)."""
        return end if done + chunk >= end else min(done + chunk, end - self.K)

    def prefill(self, seqs: list, batch, ends: list[int]) -> list:
        """The chunk `batch` of `seqs` (to `ends`) -> the first tokens of those it ends."""
        e, K = self.engine, self.K
        R, C = batch.tokens_BT.shape
        slot_R = np.full(R, e.max_slots, np.int32)
        final_R, fresh_R = np.zeros(R, bool), np.zeros(R, bool)
        ahead_RF = np.zeros((R, C + K), np.int32)
        step_R = np.zeros(R, np.int32)
        for i, (seq, end) in enumerate(zip(seqs, ends, strict=True)):
            tokens = seq.tokens
            known = tokens[seq.done + 1 : seq.done + 1 + C + K]  # a refill's: x too
            ahead_RF[i, : len(known)] = known
            final_R[i] = end == len(tokens) - (1 if seq.out else 0)
            fresh_R[i] = final_R[i] and not seq.out
            slot_R[i] = seq.slot
            step_R[i] = max(seq.it - 1, 0)  # a refill's drafts: the keys of its last step's
        rows = PrefillRows(slot_R, final_R, fresh_R, ahead_RF)
        out = e.programs.prefill(batch._replace(step_B=step_R), rows, e._mode(seqs))
        events = []
        for i, (seq, end) in enumerate(zip(seqs, ends, strict=True)):
            seq.done = end
            if not final_R[i]:
                continue
            if e.shares_prefixes:
                e.pool.register(seq.prompt, seq.pages)
            seq.drafts = out.drafts_BK[i].tolist()
            if fresh_R[i]:
                seq.it = 1
                top = zip(out.top_ids_BK[i].tolist(), out.top_logprobs_BK[i].tolist(), strict=True)
                token, logprob = int(out.tokens_B[i]), float(out.logprob_B[i])
                events.append(e._event(seq, token, logprob, tuple(top)))
        return events

    # ------------------------------------------------------------------ decode

    def _reach(self, seq) -> int:
        """Positions a verify call of `seq` may write up to (exclusive): p + K, or its last."""
        return min(seq.done + self.K, len(seq.prompt) + seq.params.max_tokens - 1) + 1

    def decode(self, seqs: list) -> list:
        """One verify call for every decoding request (module doc) -> the tokens emitted."""
        e, K = self.engine, self.K
        for seq in sorted(seqs, key=lambda s: e._order[s.rid]):
            if seq.slot >= 0 and not e._grow(seq, self._reach(seq)):
                e._preempt(seq)
        seqs = [s for s in seqs if s.slot >= 0]
        if not seqs:
            return []
        for seq in seqs:
            e._window_pages(seq, self._reach(seq))
        S = e._rows_for(len(seqs))
        tokens_ST = np.zeros((S, K + 1), np.int32)
        positions_ST = np.full((S, K + 1), -1, np.int32)
        slot_S, room_S = np.full(S, e.max_slots, np.int32), np.zeros(S, np.int32)
        step_S = np.zeros(S, np.int32)
        for i, seq in enumerate(seqs):
            room_S[i] = seq.params.max_tokens - len(seq.out)
            tokens_ST[i] = [seq.tokens[-1], *seq.drafts]
            n = min(K + 1, room_S[i])  # positions past the last token it may emit: none
            positions_ST[i, :n] = np.arange(seq.done, seq.done + n)
            slot_S[i], step_S[i] = seq.slot, seq.it
        rows = seqs + [None] * (S - len(seqs))
        batch = e._batch(rows, tokens_ST, positions_ST, np.zeros(S, np.int32))
        out = e.programs.verify(
            batch._replace(step_B=step_S), VerifyRows(slot_S, room_S), e._mode(seqs)
        )
        events = []
        for i, seq in enumerate(seqs):
            events += self._emit(seq, out, i, int(room_S[i]))
        return events

    def _emit(self, seq, out: Verified, row: int, room: int) -> list:
        """A request's tokens of the step, up to the first that ends it; its drafts counted."""
        n_kept = int(out.n_kept_B[row])
        drafts, stops = seq.drafts, seq.params.stop_ids
        checked = 0  # drafts checked: while the ones before were kept, and no stop among them
        while checked < min(self.K, room):
            self.drafted[checked] += 1
            checked += 1
            if checked > n_kept:
                break
            self.accepted[checked - 1] += 1
            if drafts[checked - 1] in stops:
                break
        count = n_kept + (n_kept < room)  # the kept drafts and the main model's token
        events, e = [], self.engine
        for j in range(count):
            ids, lps = out.top_ids_BTK[row, j].tolist(), out.top_logprobs_BTK[row, j].tolist()
            token, logprob = int(out.tokens_BT[row, j]), float(out.logprob_BT[row, j])
            draft = drafts[j] if j < checked else -1
            events.append(e._event(seq, token, logprob, tuple(zip(ids, lps, strict=True)), draft))
            if events[-1].finish_reason is not None:
                return events
        seq.done += count
        seq.drafts, seq.it = out.drafts_BK[row].tolist(), seq.it + 1
        return events
