"""The SSD drafter: speculation cache, fan-out, Saguaro sampling, backups (arrives with the drafter issue)."""
