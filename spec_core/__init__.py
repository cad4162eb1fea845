"""Shared core of the speculation service: config, model loading, the model runner, sampling and rejection.

Only torch, transformers, tokenizers, safetensors and numpy are imported here: never Ray or gRPC.
"""
