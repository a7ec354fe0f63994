"""shardpoint conformance suite: round trips across world sizes, fault cases, adapters."""
