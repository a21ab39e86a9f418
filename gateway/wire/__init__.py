"""Bytes on the wire: the OpenAI error shape, the HTTP client to workers, headers, SSE resumption, prompt
tokens, what one relay produced.
"""
