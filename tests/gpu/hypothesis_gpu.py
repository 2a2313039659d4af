"""A pytest plugin for tests/gpu/check.sh: the Hypothesis profile ``gpu``, the CI profile's fixed
examples (tests/conftest.py) but at most 8 of each property test. On a GPU every drawn shape is
a Triton compile (0.5-1.3 s each for the kernel tests), and the check's broad tests get seconds.

    python -m pytest -p hypothesis_gpu --hypothesis-profile=gpu ...   (tests/gpu on PYTHONPATH)
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "gpu",
    derandomize=True,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    max_examples=8,
)
