"""The per-key rate limits (gateway/state/ratelimit.py) as a request hook (gateway/request/hooks.py `Tickets`): a request's
ticket opens when it arrives (a key that may not use the model, or is over its limits, refuses it there) and
closes when it finishes, with the tokens it used. They join the caller (gateway/tenancy/auth.py `Tenant`) to the state
store that charges the ticket, so the limits themselves depend on neither."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gateway.request.hooks import RequestHook
from gateway.state.ratelimit import Ticket
from gateway.wire import errors

if TYPE_CHECKING:
    from engine_adapters.base import Usage
    from gateway.request.context import Outcome, RequestContext
    from gateway.state.base import StateStore
    from gateway.tenancy.auth import Tenant
    from policies.types import RequestFeatures


def open_ticket(store: StateStore, tenant: Tenant, feats: RequestFeatures,
                client_headers: list[tuple[bytes, bytes]], requested: str | None = None) -> Ticket | None:
    """Check the key may use the model; for a limited key register the request's ticket with the store (no
    I/O: its first reservation charges it). None for keys without limits. A refusal names the model as the
    client asked for it (`requested`), never the alias's or adapter's target the key may not see."""
    if not tenant.may_use(feats.model):
        raise errors.model_not_found(requested or feats.model, sorted(tenant.models))
    lim = tenant.limits
    if lim is None:
        return None
    cost = 0
    if lim.tpm is not None:
        out = feats.max_tokens if feats.max_tokens is not None else feats.predicted_output_tokens
        cost = feats.prompt_tokens + math.ceil(out)
    t = Ticket(feats.request_id, tenant.id, lim, cost, client_headers)
    store.open_ticket(t)
    return t


def close_ticket(store: StateStore, ticket: Ticket | None, usage: Usage | None, prompt_tokens: int,
                 streamed_tokens: int) -> None:
    """The request ended: settle its tokens (the usage it reported, else the prompt and the tokens relayed)."""
    if ticket is None:
        return
    used = usage.prompt_tokens + usage.completion_tokens if usage is not None else prompt_tokens + streamed_tokens
    store.close_ticket(ticket, used)


class Tickets(RequestHook):
    """The request's ticket (`ctx.ticket`) from arrival to finish."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def arrived(self, ctx: RequestContext) -> None:
        ctx.ticket = open_ticket(self.store, ctx.tenant, ctx.feats, ctx.client_headers, ctx.req.model)

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        if ctx.ticket is not None and outcome.feats is not None:
            result = outcome.result
            close_ticket(self.store, ctx.ticket, result.usage if result is not None else None,
                         outcome.feats.prompt_tokens, ctx.state.tokens)
