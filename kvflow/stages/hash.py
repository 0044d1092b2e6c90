"""hash: token ids -> chained block keys in the request's namespace (tenant + model + layout)."""

from __future__ import annotations

from typing import Any

from kvflow.kvdb import DEFAULT_TENANT, KVLayout, Namespace, block_keys
from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.errors import InvalidArgument
from kvflow.stages.state import GenerateState

__all__ = ["DEFAULT_TENANT", "HashStage", "namespace_for"]


def namespace_for(tenant: str, model_fingerprint: str, layout: KVLayout) -> Namespace:
    """The request's namespace (an empty tenant is the default one): the one place a serving
    path builds a Namespace. InvalidArgument names a malformed tenant."""
    try:
        return Namespace(tenant or DEFAULT_TENANT, model_fingerprint, layout)
    except ValueError as exc:
        raise InvalidArgument(str(exc).replace("Namespace.tenant", "tenant")) from exc


class HashStage(Stage):
    """Fills ``state.namespace`` and ``state.block_keys`` (one key per full block).

    Raises InvalidArgument for a malformed tenant."""

    name = "hash"

    def __init__(self, model_fingerprint: str, layout: KVLayout) -> None:
        self._fingerprint = model_fingerprint
        self._layout = layout

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        assert state.prompt_ids is not None, "tokenize runs before hash"
        state.namespace = namespace_for(state.tenant, self._fingerprint, self._layout)
        tenant = state.namespace.tenant
        state.block_keys = block_keys(state.namespace, state.prompt_ids)
        ctx.set_attrs(tenant=tenant, blocks=len(state.block_keys))
