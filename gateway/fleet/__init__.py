"""The fleet as the gateway sees it: the worker registry, DNS discovery, KV-cache events, LoRA adapters on
workers.
"""
