"""The adapter registry: the SQLite store of ids, versions, aliases, channels, audit and
migration state, the in-memory version index over it, and the catalog that owns both per engine."""
