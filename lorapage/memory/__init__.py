"""Memory: the one page pool of KV blocks and adapter weights, block tables, the prefix cache and pool sizing."""
