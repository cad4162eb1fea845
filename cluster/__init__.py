"""Ray placement of the drafter and the verifier (arrives with the distributed-service issue)."""
