"""The ``pagedkv`` command: ``memory``, ``compute``, ``up``, ``down``, ``generate``, ``stats``.

Each subcommand's flags live beside the code it runs; this module only
dispatches, importing lazily so ``pagedkv memory`` never loads the model code.
"""

from __future__ import annotations

import sys

_COMMANDS = {
    "memory": ("memory_service.main", "run the KV-cache memory service"),
    "compute": ("compute_service.main", "run a compute worker"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``pagedkv <command> ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        lines = [f"  {name:<10} {help}" for name, (_, help) in _COMMANDS.items()]
        print("usage: pagedkv <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(_COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
