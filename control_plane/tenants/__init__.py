"""Tenants: the tenant table, per-tenant quotas and usage (docs/deploy.md#tenants)."""
