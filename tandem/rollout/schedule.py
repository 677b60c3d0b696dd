"""Authorship schedules: who writes the next token of each row, as a vectorised state machine over rows.

Shared verbatim by the catch-up engine and the lockstep reference, so both follow the same authors. The
author of completion position t+1 depends only on the tokens emitted up to t and on counter-based uniforms
(`sampling.uniform`), never on which engine runs.

- `word`  : first author ~ Bernoulli(p_senior). After each emitted token, if it starts a word (its text begins
            with whitespace) or `max_gap_tokens` tokens have passed since the last redraw, redraw the author
            ~ Bernoulli(p_senior) (it may pick the same model) and reset the gap counter. The redraw follows
            the word-initial token, so the rest of that word may come from the other model.
- `token` : redraw after every token (the predecessor paper's per-token coin flip).
- `step`  : the senior writes the first step; after each token that ends a step (the current turn's text now
            holds a blank line: a `\\n\\n` token, or a token starting with `\\n` right after one ending with
            `\\n`) authorship passes strictly to the other model. The chain stops after `max_rounds` turns.
- `solo`  : the senior writes everything; `junior`: the junior writes everything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

import torch

from tandem.rollout.sampling import STREAM_FIRST, STREAM_REDRAW, uniform, uniform_at, uniform_int, uniform_prefix
from tandem.rollout.vocab import TokenTables

SCHEDULES = ("word", "step", "token", "solo", "junior")
SENIOR, JUNIOR = 1, 0


def check_schedule(schedule: str, p_senior: float, max_gap_tokens: int, max_rounds: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if not 0.0 <= p_senior <= 1.0:
        raise ValueError(f"p_senior must lie in [0, 1], got {p_senior}")
    if max_gap_tokens < 1:
        raise ValueError(f"max_gap_tokens must be >= 1, got {max_gap_tokens}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")


@dataclass(frozen=True)
class ScheduleSpec:
    """Which schedule and its settings: the one value that travels from params (`RolloutSettings.schedule`,
    `EvalSettings.schedule`) into `Schedule` / `RowSchedule` and through the rollout service (`/generate`'s
    "schedule") to every chunk the engine core stops (`turns.chunk_args`), under the same field names on each
    side. Validated once, at construction (`check_schedule`)."""

    kind: str = "word"
    p_senior: float = 0.5
    max_gap_tokens: int = 32
    max_rounds: int = 150

    def __post_init__(self) -> None:
        check_schedule(self.kind, self.p_senior, self.max_gap_tokens, self.max_rounds)

    def as_dict(self) -> dict[str, Any]:
        """JSON- and msgpack-friendly: {"kind", "p_senior", "max_gap_tokens", "max_rounds"}."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "ScheduleSpec":
        """From `as_dict()`'s shape; a missing, unknown or mistyped field raises ValueError naming it."""
        names = [f.name for f in fields(cls)]
        if not isinstance(d, Mapping) or set(d) != set(names):
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"a schedule is an object with exactly the fields {', '.join(names)}; got {got}")
        kind, p, gap, rounds = (d[n] for n in names)
        if not isinstance(kind, str) or isinstance(p, bool) or not isinstance(p, (int, float)) \
                or any(isinstance(v, bool) or not isinstance(v, int) for v in (gap, rounds)):
            raise ValueError("a schedule's kind is a string, p_senior a number, max_gap_tokens and max_rounds "
                             "integers")
        return cls(kind, float(p), gap, rounds)

    @property
    def needs_junior(self) -> bool:
        return uses_junior(self.kind, self.p_senior)

    @property
    def needs_senior(self) -> bool:
        return uses_senior(self.kind, self.p_senior)


def uses_junior(schedule: str, p_senior: float = 0.5) -> bool:
    """Whether the junior can author any token under this schedule."""
    return schedule in ("step", "junior") or (schedule in ("word", "token") and p_senior < 1.0)


def uses_senior(schedule: str, p_senior: float = 0.5) -> bool:
    return schedule in ("step", "solo") or (schedule in ("word", "token") and p_senior > 0.0)


class Schedule:
    """Per-row author state for one batch. `author_B` (bool, True = senior) names the author of the next token."""

    def __init__(self, spec: ScheduleSpec, tables: TokenTables, seed: int, row_ids_B: torch.Tensor):
        if not isinstance(spec, ScheduleSpec):
            raise TypeError(f"spec must be a ScheduleSpec, got {type(spec).__name__}")
        self.spec, self.tables, self.seed = spec, tables, seed
        self.row_ids_B = row_ids_B.to(torch.int64)
        B, dev, kind = self.row_ids_B.numel(), self.row_ids_B.device, spec.kind
        if kind in ("word", "token"):
            self.author_B = uniform(seed, STREAM_FIRST, self.row_ids_B, 0) < spec.p_senior
        else:
            self.author_B = torch.full((B,), kind != "junior", dtype=torch.bool, device=dev)
        self.gap_B = torch.zeros(B, dtype=torch.int64, device=dev)
        self.newline_B = torch.zeros(B, dtype=torch.bool, device=dev)
        self.turns_B = torch.zeros(B, dtype=torch.int64, device=dev)

    def advance(self, tokens_B: torch.Tensor, t: int) -> torch.Tensor:
        """Account for the tokens just emitted at completion position `t`; set the authors of position t+1.

        Returns a bool per row: True where this token completed the `max_rounds`-th turn (step schedule).
        Finished rows may be passed too; their state is simply never read again.
        """
        B = tokens_B.numel()
        done_rounds_B = torch.zeros(B, dtype=torch.bool, device=tokens_B.device)
        if self.spec.kind in ("word", "token"):
            if self.spec.kind == "word":
                self.gap_B += 1
                redraw_B = self.tables.word_start_V[tokens_B] | (self.gap_B >= self.spec.max_gap_tokens)
            else:
                redraw_B = torch.ones(B, dtype=torch.bool, device=tokens_B.device)
            drawn_B = uniform(self.seed, STREAM_REDRAW, self.row_ids_B, t) < self.spec.p_senior
            self.author_B = torch.where(redraw_B, drawn_B, self.author_B)
            self.gap_B = torch.where(redraw_B, torch.zeros_like(self.gap_B), self.gap_B)
        elif self.spec.kind == "step":
            tb = self.tables
            end_B = tb.step_end_V[tokens_B] | (self.newline_B & tb.starts_newline_V[tokens_B])
            self.newline_B = torch.where(tb.empty_V[tokens_B], self.newline_B, tb.ends_newline_V[tokens_B])
            self.author_B = torch.where(end_B, ~self.author_B, self.author_B)
            self.newline_B = self.newline_B & ~end_B  # a new turn starts with empty text
            self.turns_B = self.turns_B + end_B.to(torch.int64)
            done_rounds_B = end_B & (self.turns_B >= self.spec.max_rounds)
        return done_rounds_B


def naive_authors(kind: str, tokens: Sequence[int], texts: Sequence[str], seed: int, row_id: int,
                  p_senior: float = 0.5, max_gap_tokens: int = 32, max_rounds: int = 150
                  ) -> tuple[list[int], bool]:
    """Pure-Python reference: the author of each position of one row given its tokens, decoding text directly.

    Returns (authors, stopped_by_rounds): authors[t] is 1 (senior) or 0 (junior) for tokens[t]; with the step
    schedule the list is cut where the `max_rounds`-th turn ends.
    """
    check_schedule(kind, p_senior, max_gap_tokens, max_rounds)
    if kind in ("word", "token"):
        author = int(uniform_int(seed, STREAM_FIRST, row_id, 0) < p_senior)
    else:
        author = JUNIOR if kind == "junior" else SENIOR
    out, gap, turn_text, turns = [], 0, "", 0
    for t, tok in enumerate(tokens):
        out.append(author)
        text = texts[tok]
        if kind == "word":
            gap += 1
            if text[:1].isspace() or gap >= max_gap_tokens:
                author = int(uniform_int(seed, STREAM_REDRAW, row_id, t) < p_senior)
                gap = 0
        elif kind == "token":
            author = int(uniform_int(seed, STREAM_REDRAW, row_id, t) < p_senior)
        elif kind == "step":
            turn_text += text
            if "\n\n" in turn_text:
                turns += 1
                if turns >= max_rounds:
                    return out, True
                author, turn_text = 1 - author, ""
    return out, False


class LookupTables:
    """The token tables as `bytes` (one byte per id): O(1) lookups in plain Python, built once per vocabulary.

    `RowSchedule` reads these; the vLLM engine core decides authorship switches with them token by token.
    """

    __slots__ = ("word", "end", "snl", "enl", "empty")

    def __init__(self, word: bytes, end: bytes, snl: bytes, enl: bytes, empty: bytes):
        self.word, self.end, self.snl, self.enl, self.empty = word, end, snl, enl, empty

    @classmethod
    def of(cls, tables: "TokenTables | LookupTables") -> "LookupTables":
        if isinstance(tables, LookupTables):
            return tables
        key = id(tables)
        hit = _LOOKUP_CACHE.get(key)
        if hit is not None and hit[0] is tables:
            return hit[1]
        out = cls(*(bytes(t.to(torch.uint8).tolist()) for t in (tables.word_start_V, tables.step_end_V,
                                                                tables.starts_newline_V, tables.ends_newline_V,
                                                                tables.empty_V)))
        _LOOKUP_CACHE.clear()  # one vocabulary at a time is the common case; keep the cache small
        _LOOKUP_CACHE[key] = (tables, out)
        return out


_LOOKUP_CACHE: dict[int, tuple] = {}


class RowSchedule:
    """The same state machine for ONE row in plain Python (the vLLM path walks each turn's tokens with it, and
    the vLLM engine core resumes it at every chunk to stop exactly at the authorship switch).

    Reads the same tables and the same counter-based uniforms as `Schedule`, so both agree token for token.
    State: `author`, `gap` (tokens since the last redraw), `newline` (step schedule: the turn's text ends with
    a newline), `turns` (step schedule: completed turns).
    """

    __slots__ = ("spec", "seed", "row_id", "_t", "author", "gap", "newline", "turns")

    def __init__(self, spec: ScheduleSpec, tables: "TokenTables | LookupTables", seed: int, row_id: int):
        """Row `row_id`'s state machine at its start, for a validated `spec` (no second validation)."""
        if not isinstance(spec, ScheduleSpec):
            raise TypeError(f"spec must be a ScheduleSpec, got {type(spec).__name__}")
        self.spec, self.seed, self.row_id = spec, seed, row_id
        self._t = LookupTables.of(tables)
        if spec.kind in ("word", "token"):
            self.author = int(uniform_int(seed, STREAM_FIRST, row_id, 0) < spec.p_senior)
        else:
            self.author = JUNIOR if spec.kind == "junior" else SENIOR
        self.gap, self.newline, self.turns = 0, False, 0

    @classmethod
    def resume(cls, spec: ScheduleSpec, tables: "TokenTables | LookupTables", seed: int, row_id: int,
               state: Mapping[str, Any]) -> "RowSchedule":
        """The state machine at a known `state` (the keys of `state()`: author, gap, newline, turns; others are
        ignored). No validation: the state comes from a validated one."""
        st = cls.__new__(cls)
        st.spec, st.seed, st.row_id = spec, seed, row_id
        st._t = LookupTables.of(tables)
        st.author, st.gap = int(state["author"]), int(state["gap"])
        st.newline, st.turns = bool(state["newline"]), int(state["turns"])
        return st

    def state(self) -> dict:
        """The resumable state (see `resume`)."""
        return {"author": self.author, "gap": self.gap, "newline": self.newline, "turns": self.turns}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (the keys of `state()`), as another copy of this row's machine left it."""
        self.author, self.gap = int(state["author"]), int(state["gap"])
        self.newline, self.turns = bool(state["newline"]), int(state["turns"])

    def _redraw(self, t: int) -> int:
        """The author after position t: `uniform_int(seed, STREAM_REDRAW, row, t) < p_senior`, the row's part of
        the hash cached (`uniform_prefix`)."""
        return int(uniform_at(uniform_prefix(self.seed, STREAM_REDRAW, self.row_id), t) < self.spec.p_senior)

    def advance(self, token: int, t: int) -> bool:
        """Account for `token` emitted at position t; return True when it completed the last allowed turn."""
        if self.spec.kind == "word":
            self.gap += 1
            if self._t.word[token] or self.gap >= self.spec.max_gap_tokens:
                self.author = self._redraw(t)
                self.gap = 0
        elif self.spec.kind == "token":
            self.author = self._redraw(t)
        elif self.spec.kind == "step":
            tb = self._t
            end = tb.end[token] or (self.newline and tb.snl[token])
            if not tb.empty[token]:
                self.newline = bool(tb.enl[token])
            if end:
                self.author, self.newline = 1 - self.author, False
                self.turns += 1
                return self.turns >= self.spec.max_rounds
        return False
