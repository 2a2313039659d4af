"""``python -m freetokend.store STATE_DIR``: open (migrating) a state store and summarise it.

Exit status 0, or 2 with a one-line reason on stderr when the file is foreign or damaged.
"""

from __future__ import annotations

import sys

from . import Store, StoreError


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m freetokend.store STATE_DIR", file=sys.stderr)
        return 2
    try:
        with Store(argv[0]) as store:
            print(f"{store.path}: schema version {store.version}")
            print(f"  models: {len(store.models())}")
            print(f"  recent requests: {len(store.recent_requests(store.request_log_rows))}")
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
