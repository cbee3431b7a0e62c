"""Who may call ``pagedkv serve``: API keys and their tenants, the operator's admin key, the
metrics key, and the tenants that share a prefix cache (``--api-key``, ``--api-keys-file``,
``--admin-api-key``, ``--metrics-api-key``, ``--cache-sharing-group``; parsed by
:mod:`client.serve.config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from client.serve.dashboard.auth import same_key


@dataclass(frozen=True, slots=True)
class Tenants:
    """API keys → tenant names; with no tenant keys the API routes need no key (every caller is
    tenant ""), and only the admin routes need the admin key. ``groups`` maps each tenant the
    operator put in a cache-sharing group to that group's name (client.serve.app.Server.cache_salt).
    ``metrics_key`` may read ``/metrics`` and nothing else."""

    keys: dict[str, str]
    admin_key: str | None = None
    groups: dict[str, str] = field(default_factory=dict)
    metrics_key: str | None = None

    @property
    def open(self) -> bool:
        return not self.keys

    @property
    def metrics_open(self) -> bool:
        """Whether ``/metrics`` needs no key: no API keys and no metrics key were given. Otherwise
        it needs the metrics key or the admin key (the pool-wide counters tell one tenant about
        another's requests, prefix-cache hits included)."""
        return self.open and self.metrics_key is None

    def tenant_of(self, key: str | None) -> str | None:
        """The caller's tenant, "admin" for the admin key, "" when no key is needed; None: refused."""
        if same_key(key, self.admin_key):  # constant time: the operator's key opens everything
            return "admin"
        if self.open:
            return ""
        return self.keys.get(key) if key is not None else None

    @classmethod
    def load(
        cls, api_keys: list[str], keys_file: str | None, admin_key: str | None, sharing_groups: list[str] = (),
        metrics_key: str | None = None,
    ) -> Tenants:
        """Keys from ``--api-key`` (tenant "default") and ``--api-keys-file``; cache-sharing groups
        from ``--cache-sharing-group`` values ``NAME=TENANT,TENANT``; ``--metrics-api-key``.

        Raises:
            ValueError: an unreadable or malformed keys file, an empty key, a malformed group, a
                group given twice, a group tenant no key maps to, a tenant in two groups, a metrics
                key that is also a tenant's key.
        """
        keys = {k: "default" for k in api_keys}
        if keys_file:
            text = Path(keys_file).read_text()
            try:
                entries = json.loads(text)
                if not isinstance(entries, dict):
                    raise ValueError(f"{keys_file}: the JSON must be an object {{key: tenant}}")
            except json.JSONDecodeError:
                entries = {}
                for n, line in enumerate(text.splitlines(), 1):
                    line = line.strip()
                    if not line or line.startswith("#"):
                        continue
                    parts = line.split()
                    if len(parts) != 2:
                        raise ValueError(f"{keys_file}:{n}: expected 'KEY TENANT'") from None
                    entries[parts[0]] = parts[1]
            keys.update({str(k): str(v) for k, v in entries.items()})
        if any(not k for k in keys) or admin_key == "" or metrics_key == "":
            raise ValueError("an API key must not be empty")
        if metrics_key is not None and metrics_key in keys:
            raise ValueError("--metrics-api-key is also a tenant's API key: give the metrics reader a key of its own")
        for tenant in set(keys.values()):
            if not tenant.strip() or tenant == "admin":  # "" is the open server's, "admin" the admin key's
                raise ValueError(f"tenant name {tenant!r} is reserved or empty; name tenants otherwise")
        known = set(keys.values()) | ({"admin"} if admin_key is not None else set())
        return cls(keys, admin_key, _sharing_groups(sharing_groups, known), metrics_key)


def _sharing_groups(values: list[str], known: set[str]) -> dict[str, str]:
    """``NAME=TENANT,TENANT`` values as {tenant: group name}.

    Raises:
        ValueError: naming the value that is malformed, repeats a group, names a tenant no key
            maps to, or puts a tenant in a second group.
    """
    groups: dict[str, str] = {}
    names: set[str] = set()
    for value in values:
        name, sep, members = value.partition("=")
        name = name.strip()
        tenants = [t.strip() for t in members.split(",")]
        if not sep or not name or not all(tenants):
            raise ValueError(
                f"--cache-sharing-group {value!r}: expected NAME=TENANT[,TENANT...], e.g. team=tenant-a,tenant-b"
            )
        if not known:
            raise ValueError(
                f"--cache-sharing-group {value!r}: groups need tenants; give API keys with --api-key or --api-keys-file"
            )
        if name in names:
            raise ValueError(f"--cache-sharing-group: group {name!r} is given twice; list all its tenants once")
        names.add(name)
        for tenant in tenants:
            if tenant not in known:
                raise ValueError(
                    f"--cache-sharing-group {value!r}: no API key maps to tenant {tenant!r}; name "
                    "tenants as --api-keys-file does ('default' for --api-key)"
                )
            if tenant in groups:
                other = groups[tenant]
                raise ValueError(
                    f"--cache-sharing-group: tenant {tenant!r} is in group {other!r} and in group "
                    f"{name!r}; a tenant may share its prefix cache with one group only"
                    if other != name
                    else f"--cache-sharing-group {value!r}: tenant {tenant!r} is listed twice"
                )
            groups[tenant] = name
    return groups
