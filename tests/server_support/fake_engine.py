"""A scripted stand-in for EngineCore (same interface) for in-process bridge tests.

Each request emits the ids of its script, one per ``step()``, then finishes ("stop" if the
script ends in an EOS id, else "length"). ``fail_next_step`` makes the next step raise.
The scripts named in ``until_aborted`` hold their last id until the request is aborted (30 s at
most), so a test that aborts one mid-script does not race the script's end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from freetokend.engine.core import EngineStats, StepOutput


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    script: list[int]
    sent: int = 0
    hold: bool = False  # the last id waits for an abort
    held_since: float | None = None


class FakeEngine:
    def __init__(
        self,
        scripts: dict[str, list[int]],
        eos: int,
        max_model_len: int = 64,
        until_aborted: Iterable[str] = (),
    ) -> None:
        self.scripts = scripts  # prompt key (str of first id) -> ids to emit
        self.until_aborted = frozenset(until_aborted)  # keys whose last id waits for an abort
        self.eos = frozenset({eos})
        self.max_model_len = max_model_len
        self._lock = threading.Lock()
        self._reqs: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.step_delay = threading.Event()  # set = steps run freely
        self.step_delay.set()
        self.step_seconds = 0.01  # like a real step: the loop sees outputs before the next

    def add_request(
        self, request_id, prompt_ids, params, constraint=None, *, checked=False
    ) -> None:  # type: ignore[no-untyped-def]
        # checks the context whether or not ``checked``: it stands for any ValueError an
        # engine (or the hub, switching models) raises, which the bridge answers with a 400
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context ({self.max_model_len})"
            )
        key = str(prompt_ids[0])
        script = self.scripts[key][: params.max_tokens]
        with self._lock:
            self._reqs[request_id] = _Req(
                request_id, list(prompt_ids), script, hold=key in self.until_aborted
            )

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._reqs.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._reqs)

    def stats(self) -> EngineStats:
        with self._lock:
            n = len(self._reqs)
        return EngineStats(running=n, waiting=0, kv_pages_used=n, kv_pages_total=8)

    def step(self) -> list[StepOutput]:
        self.step_delay.wait(5)
        time.sleep(self.step_seconds)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        with self._lock:
            for req in list(self._reqs.values()):
                if req.hold and req.sent == len(req.script) - 1:
                    req.held_since = req.held_since or time.monotonic()
                    if time.monotonic() - req.held_since < 30:
                        continue  # no abort yet: nothing to emit this step
                tok = req.script[req.sent]
                req.sent += 1
                done = req.sent == len(req.script)
                reason = ("stop" if tok in self.eos else "length") if done else None
                if done:
                    del self._reqs[req.rid]
                outs.append(StepOutput(req.rid, tok, -0.5, None, done, reason, len(req.prompt), 1))
        return outs
