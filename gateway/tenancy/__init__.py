"""Who is asking: API keys and tenants, rate-limit tickets, service order between tenants."""
