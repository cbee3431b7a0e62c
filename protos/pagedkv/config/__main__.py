"""``python -m pagedkv.config --markdown``: print docs/configuration.md (the environment registry)."""

from __future__ import annotations

import argparse
import sys

from pagedkv.config.envs import markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.config", description=__doc__)
    p.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    p.parse_args(argv)
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
