"""The tenant table (`--tenants FILE`, TOML): each tenant's weight, quotas and latency defaults, and
which API keys are bound to which tenant (docs/deploy.md#tenants).

A file is read whole or refused whole: a bad file names the field (`tenants.alice.token_rate: ...`),
so a start fails with one line and a reload (SIGHUP) keeps the table it had.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# SchedulerConfig.tenant_slos' key for the tenants the file does not list (control_plane/config.py
# imports this module only inside a function, so no cycle).
from control_plane.config import ANY_TENANT

# The table's own name for a request that names no tenant and has no key (keys are off).
DEFAULT_TENANT = "default"
# Quota fields: 0 means no limit.
_LIMITS = ("max_concurrent_requests", "max_queued_requests", "token_rate", "token_burst")
_ENTRY_FIELDS = frozenset(("weight", *_LIMITS, "ttft_slo_ms", "tpot_slo_ms", "keys", "may_name"))
_TOP_FIELDS = frozenset(("defaults", "tenants", "prompt_weight", "output_weight", "max_metric_tenants"))
# A key's id as the frontend knows it: "key:" and the first 12 hex digits of its SHA-256.
_KEY_ID_HEX = 12
# A tenant file with one of these suffixes is YAML; any other is TOML.
YAML_SUFFIXES = frozenset((".yaml", ".yml"))
# Tenants reported one by one in GetServerInfo and /metrics; the rest are summed as "other".
DEFAULT_METRIC_TENANTS = 32


class TenantFileError(ValueError):
    """A tenant file that cannot be used; the message names the field."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant's entry (or the default entry, for tenants the file does not list)."""

    name: str
    weight: float = 1.0
    # Requests admitted and not finished; 0: no limit.
    max_concurrent_requests: int = 0
    # Requests admitted and not yet in their first prefill; 0: no limit.
    max_queued_requests: int = 0
    # Weighted tokens per second the bucket refills (0: no token quota), and its size.
    token_rate: float = 0.0
    token_burst: float = 0.0
    # Latency objectives for its requests that give none (0: none).
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0
    # API key ids bound to this tenant, and the other tenants those keys may name ("*": any).
    keys: frozenset[str] = frozenset()
    may_name: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class TenantTable:
    """The tenants an operator declared, the entry for every other one, and the token weights."""

    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    default: Tenant = Tenant(DEFAULT_TENANT)
    # Weighted tokens: VTC's weights (a prompt token costs 1, an output token 2).
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    max_metric_tenants: int = DEFAULT_METRIC_TENANTS
    # Key id -> the tenant it is bound to.
    bound: Mapping[str, str] = field(default_factory=dict)

    def entry(self, name: str) -> Tenant:
        """The tenant's entry: its own, or the default one under its name."""
        found = self.tenants.get(name)
        if found is not None:
            return found
        return dataclasses.replace(self.default, name=name)

    def weights(self) -> dict[str, float]:
        """Each listed tenant's share of tokens, as the scheduler's fairness takes it
        (SchedulerConfig.tenant_weights), and every other one's under ANY_TENANT when the [defaults]
        entry sets one (else an unlisted tenant weighs 1)."""
        weights = {name: t.weight for name, t in self.tenants.items()}
        if self.default.weight != 1.0:
            weights[ANY_TENANT] = self.default.weight
        return weights

    def slo_defaults(self) -> dict[str, tuple[float, float]]:
        """(ttft_slo_ms, tpot_slo_ms) of each listed tenant, and of every other one under ANY_TENANT
        (the [defaults] entry); empty when none sets any (SchedulerConfig.tenant_slos)."""
        entries = [*self.tenants.values(), dataclasses.replace(self.default, name=ANY_TENANT)]
        if not any(t.ttft_slo_ms or t.tpot_slo_ms for t in entries):
            return {}
        return {t.name: (t.ttft_slo_ms, t.tpot_slo_ms) for t in entries}

    def resolve(self, owner: str, authenticated: bool, requested: str) -> str:
        """The request's tenant: its key's, or the one it names where the key may name it.

        Without keys (`authenticated` false) every caller may name any tenant, and one that names
        none is DEFAULT_TENANT. A key bound to a tenant (`keys`) is that tenant and may name those
        in its `may_name`; an unbound key is a tenant of its own, named by its id, and may name no
        other. TenantRefused names the field otherwise."""
        if not authenticated:
            return requested or DEFAULT_TENANT
        base = self.bound.get(owner, owner)
        if not requested or requested == base:
            return base
        allowed = self.tenants[base].may_name if base in self.tenants else frozenset()
        if "*" in allowed or requested in allowed:
            return requested
        raise TenantRefused(f"tenant: this API key may not name tenant {requested!r} (it is {base!r})")


def check_objectives(table: TenantTable, slo_cost: Sequence[float]) -> None:
    """Under a step cost model (--slo-cost a,b,c,d) every step takes at least `a`, and a first token
    or a token after it takes a step: an objective below that no request can meet, and would refuse
    every request of its tenant, so the file is refused (TenantFileError naming the field)."""
    if not slo_cost or not slo_cost[0]:
        return
    floor_ms = 1000.0 * slo_cost[0]
    entries = [("defaults", table.default), *((f"tenants.{n}", t) for n, t in table.tenants.items())]
    for where, entry in entries:
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(entry, name)
            if value and value < floor_ms:
                raise TenantFileError(
                    f"{where}.{name}: {value:g} ms is infeasible: every step takes at least "
                    f"{floor_ms:g} ms under --slo-cost (its a), so no request could meet it"
                )


class TenantRefused(Exception):
    """A request naming a tenant its key may not name (PERMISSION_DENIED)."""


def load(path: Path) -> TenantTable:
    """Read and check a tenant file, TOML (YAML when named *.yaml or *.yml); TenantFileError naming
    the field (or the file) otherwise."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TenantFileError(f"--tenants: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TenantFileError(f"--tenants: {path} is not text: {exc}") from None
    if path.suffix in YAML_SUFFIXES:
        return parse(_yaml(path, text))
    try:
        return parse(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise TenantFileError(f"--tenants: {path} is not TOML: {exc}") from None


def _yaml(path: Path, text: str) -> Mapping[str, Any]:
    """The YAML file's mapping (safe_load: plain values only); an empty file is an empty table."""
    import yaml  # transformers' dependency too; imported only for a YAML file

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # PyYAML's messages span lines (the context and a caret): one line, as every refusal here.
        raise TenantFileError(f"--tenants: {path} is not YAML: {' '.join(str(exc).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise TenantFileError(
            f"--tenants: {path}: want a mapping of fields at the top, got {type(raw).__name__}"
        )
    return raw


def parse(raw: Mapping[str, Any]) -> TenantTable:
    """A table from a parsed file's values (checked here, every field named in a refusal)."""
    _no_unknown(raw, _TOP_FIELDS, "")
    prompt_weight = _number(raw, "prompt_weight", "", 1.0, positive=True)
    output_weight = _number(raw, "output_weight", "", 2.0, positive=True)
    metric_tenants = _count(raw, "max_metric_tenants", "", DEFAULT_METRIC_TENANTS)
    if metric_tenants < 1:
        raise TenantFileError("max_metric_tenants: must be at least 1")
    defaults = _table(raw, "defaults", "")
    for name in ("keys", "may_name"):
        if name in defaults:
            raise TenantFileError(f"defaults.{name}: only a named tenant binds keys")
    default = _entry(DEFAULT_TENANT, defaults, "defaults.")
    tenants: dict[str, Tenant] = {}
    bound: dict[str, str] = {}
    for name, body in _table(raw, "tenants", "").items():
        where = f"tenants.{name}."
        if not isinstance(body, Mapping):
            raise TenantFileError(f"tenants.{name}: must be a table")
        if not name or len(name) > 256:
            raise TenantFileError(f"tenants.{name}: a name of 1 to 256 characters")
        if name == ANY_TENANT:
            raise TenantFileError(f"tenants.{name}: a reserved name (the [defaults] entry's)")
        tenant = _entry(name, body, where)
        for key in tenant.keys:
            if key in bound:
                raise TenantFileError(f"{where}keys: {key} is bound to tenant {bound[key]!r} already")
            bound[key] = name
        tenants[name] = tenant
    return TenantTable(tenants, default, prompt_weight, output_weight, metric_tenants, bound)


def _entry(name: str, body: Mapping[str, Any], where: str) -> Tenant:
    _no_unknown(body, _ENTRY_FIELDS, where)
    rate = _number(body, "token_rate", where, 0.0)
    burst = _number(body, "token_burst", where, 0.0)
    if burst and not rate:
        raise TenantFileError(f"{where}token_burst: needs token_rate (the bucket refills at that rate)")
    # A bucket smaller than one second of its rate refuses requests a slower client would pass.
    burst = burst or rate
    if rate and burst < rate / 1000:
        raise TenantFileError(f"{where}token_burst: {burst} is infeasible: under a millisecond of token_rate")
    return Tenant(
        name=name,
        weight=_number(body, "weight", where, 1.0, positive=True),
        max_concurrent_requests=_count(body, "max_concurrent_requests", where, 0),
        max_queued_requests=_count(body, "max_queued_requests", where, 0),
        token_rate=rate,
        token_burst=burst,
        ttft_slo_ms=_number(body, "ttft_slo_ms", where, 0.0),
        tpot_slo_ms=_number(body, "tpot_slo_ms", where, 0.0),
        keys=frozenset(_key_ids(body, where)),
        may_name=frozenset(_names(body, "may_name", where)),
    )


def _no_unknown(body: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise TenantFileError(f"{where}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")


def _table(body: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    value = body.get(name, {})
    if not isinstance(value, Mapping):
        raise TenantFileError(f"{where}{name}: must be a table")
    return value


def _number(body: Mapping[str, Any], name: str, where: str, default: float, positive: bool = False) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TenantFileError(f"{where}{name}: must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise TenantFileError(f"{where}{name}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _count(body: Mapping[str, Any], name: str, where: str, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TenantFileError(f"{where}{name}: must be a whole number >= 0, got {value!r}")
    return value


def _names(body: Mapping[str, Any], name: str, where: str) -> list[str]:
    value = body.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TenantFileError(f"{where}{name}: must be a list of names")
    return value


def _key_ids(body: Mapping[str, Any], where: str) -> list[str]:
    ids = _names(body, "keys", where)
    for key in ids:
        hex_part = key.removeprefix("key:")
        if not key.startswith("key:") or len(hex_part) != _KEY_ID_HEX or not _is_hex(hex_part):
            raise TenantFileError(
                f"{where}keys: {key!r} is not a key id (key: and the first 12 hex digits of the key's "
                "SHA-256; never the key itself)"
            )
    return ids


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
