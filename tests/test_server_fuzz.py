"""The fuzz tier of ``make test`` (issue 15, item 9): a bounded schemathesis run over the
daemon's OpenAPI document (a few schema-valid and schema-violating requests per operation,
drawn the same way on every run: the "ci" hypothesis profile) while a well-formed greedy
request decodes beside it again and again. No answer is a 5xx, the daemon stays up, and the
greedy request's output never changes. (tests/test_schemathesis_slow.py is the long run;
tests/test_server_hostile.py the hand-written corpus.)"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator

import pytest
from server_support.daemon import Daemon, start_daemon
from server_support.fuzz import DOC, MAX_MODEL_LEN, OPERATIONS, fuzz_operation
from server_support.greedy import GreedyProbe

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = int(os.environ.get("FT_FUZZ_EXAMPLES", "3"))  # per operation and mode


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    # a small context: a request that leaves out its token limit generates "the rest of the
    # context", and fuzzed prompts longer than this are a cheap 400
    d = start_daemon("--max-model-len", str(MAX_MODEL_LEN))
    yield d
    d.stop()


def test_bounded_schemathesis_with_a_greedy_request_beside(daemon):
    status, raw = daemon.get(DOC)
    assert status == 200
    document = json.loads(raw)
    probe = GreedyProbe(daemon)
    outputs: list[str] = []
    done = threading.Event()

    def beside() -> None:
        while not done.is_set():
            outputs.append(probe.text())
            done.wait(0.2)  # mostly decoding beside the fuzzed requests, not only

    thread = threading.Thread(target=beside)
    thread.start()
    failures: list[str] = []
    calls = 0
    try:
        for method, path in OPERATIONS:
            modes = [GenerationMode.POSITIVE]
            if method == "POST":  # negative requests need a body to break
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                bad, n = fuzz_operation(daemon, document, method, path, mode, EXAMPLES)
                failures += bad
                calls += n
    finally:
        done.set()
        thread.join()
    assert calls >= len(OPERATIONS) * EXAMPLES // 2
    assert daemon.proc.poll() is None, "the daemon died:\n" + "".join(daemon.log[-40:])
    assert not failures, f"{len(failures)} of {calls} requests got a 5xx:\n" + "\n".join(
        failures[:10]
    )
    assert outputs and all(o == probe.alone for o in outputs), "the greedy request changed"
