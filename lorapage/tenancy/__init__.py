"""Tenants and what each may take: the tenants file (keys, adapters, weights, quotas, SLO
targets), token buckets for requests, tokens and concurrency, SLO burn rates, and worker threads
shared in turn. Pure and clock-injected: the front end applies them per request."""
