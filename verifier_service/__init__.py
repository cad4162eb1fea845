"""The verifier engine: batching, tree verification and KV reconciliation (arrives with the verifier issue)."""
