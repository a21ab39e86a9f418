"""One request as the pipeline carries it: the parsed body, its context, the hook protocol, the admission
queue.
"""
