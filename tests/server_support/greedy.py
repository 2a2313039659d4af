"""A well-formed greedy request to run beside hostile or fuzzed traffic: its output must be the
same as when it runs alone.

The built-in model is tiny, random and computes in bf16: a row's logits differ a little between
a batch of one and a mixed batch (other matmul shapes), and a small difference that flips a
near-tie of its router sends a token to other experts, which moves its logits by up to ~1
(measured: a prompt whose first token led by 0.41 alone lost it in a batch with one other
prompt of anywhere from 4 to 60 tokens; transformers' fp32 forward agrees with it alone).
Equal output is a real check that other requests do not reach into this one only for a prompt
that the batch's shape does not move, so the probe's prompt is one whose every step wins by
``MARGIN`` (in logprob) and whose tokens stay the same beside each of ``FILLERS``.

The margins are read by token id (``return_tokens_as_token_ids``): the Completions API keys its
top_logprobs by token text, and on this model about half of the steps have two candidates of the
same text (byte tokens all decode to U+FFFD), where a text-keyed lead is not the lead.
"""

from __future__ import annotations

import threading
from typing import Any

TOKENS = 16
TOP = 5  # logprobs asked for while picking the prompt
MARGIN = 0.2
# other prompts to decode beside a candidate: (token, length) each, two batches of shapes
FILLERS = ([(33, 8), (101, 3), (7, 21)], [(250, 13), (5, 30)])
# where the search found one for the built-in model (tried first: a few requests instead of
# ~30; the search still runs if the model or its numerics change)
KNOWN_GOOD = 28
SEARCH = 400  # prompts [s, s + 1, s + 2, s + 3] for s below it (the model has 416 tokens)


class GreedyProbe:
    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.prompt: list[int] = []
        self.alone = self._pick()

    def run(self, logprobs: int | None = None, prompt: list[int] | None = None) -> dict[str, Any]:
        """The probe's one choice (200 or an AssertionError)."""
        body = {
            "model": self.daemon.model,
            "prompt": prompt or self.prompt,
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": logprobs,
            "return_tokens_as_token_ids": True,
        }
        status, answer = self.daemon.post("/v1/completions", body)
        assert status == 200, answer
        return dict(answer["choices"][0])

    def text(self) -> str:
        return str(self.run()["text"])

    def _pick(self) -> str:
        for start in [KNOWN_GOOD, *range(SEARCH)]:
            self.prompt = [start + i for i in range(4)]
            choice = self.run(logprobs=TOP)
            if margin(choice) > MARGIN and all(self._beside(f) == choice["text"] for f in FILLERS):
                return str(choice["text"])
        raise AssertionError(
            f"no prompt of the built-in model wins every step by {MARGIN} and keeps its tokens "
            "beside other prompts"
        )

    def _beside(self, fillers: list[tuple[int, int]]) -> str:
        """The probe's text while ``fillers`` decode in the same batches."""
        others = [
            threading.Thread(target=self.run, kwargs={"prompt": [tok] * n}) for tok, n in fillers
        ]
        for t in others:
            t.start()
        text = str(self.run()["text"])
        for t in others:
            t.join()
        return text


def margin(choice: dict[str, Any]) -> float:
    """The smallest lead of the chosen token over the runner-up, over all steps; the tokens are
    named by id, so each candidate has its own entry."""
    lp = choice["logprobs"]
    leads = []
    for chosen, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert len(top) == TOP and top[chosen] == value, (chosen, value, top)
        leads.append(value - max(v for k, v in top.items() if k != chosen))
    return min(leads)
