"""The request pipeline: dispatch, legs (plain and P/D), relay, moves, learning, SLO accounting, the hooks
that observe each request.
"""
