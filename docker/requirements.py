"""Print the requirements of pyproject.toml, one a line, for `pip install -r`.

    python docker/requirements.py pyproject.toml [EXTRA[,EXTRA...]]

The image installs these before it copies the source, so the slow layer (every dependency)
stays cached while the source changes. Prints the build-system requirements, the project's
dependencies and those of the named extras (comma-separated; empty for none).
"""

from __future__ import annotations

import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (e.g. an Ubuntu 22.04 base image)
    import tomli as tomllib


def requirements(pyproject: str, extras: str = "") -> list[str]:
    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    project = data["project"]
    optional = project.get("optional-dependencies", {})
    out = list(data.get("build-system", {}).get("requires", []))
    out += project.get("dependencies", [])
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; pyproject.toml has {sorted(optional)}")
        out += optional[extra]
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    print("\n".join(requirements(*sys.argv[1:])))
