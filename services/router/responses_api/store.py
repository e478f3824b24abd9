"""Stored responses (`store: true`, the Responses API's default): what lets a later request continue a
conversation by `previous_response_id` on any router replica, and GET / DELETE /v1/responses/{id} find it.

One JSON record per response, under `pdserve:response:<id>` with a TTL (default one day):

    {"tenant": <the API key's tenant, or null>,
     "response": <the Response object, as returned>,
     "conversation": [<canonical input items: the previous conversation's, then this request's input>]}

The conversation that continues from response X is X's conversation followed by X's output, so one read
continues a conversation of any length (each record repeats its history; the TTL bounds what piles up).
A record of another tenant reads as absent: tenants never see, continue or delete each other's responses.
Unlike the rest of pdserve's Redis state, nothing rebuilds these: a Redis restart forgets them, and a
`previous_response_id` then answers 404. A router built without Redis (in-process, on a stand-in routing)
keeps them in its own memory (`MemoryResponseStore`), for its lifetime only.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict

from redis.exceptions import RedisError

DEFAULT_TTL_S = 24 * 3600.0
KEY_PREFIX = "pdserve:response:"
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")  # what new_id("resp") makes, with room


class StoreUnavailable(RuntimeError):
    """Redis did not answer: the client is told 503 (retry), never that the response does not exist."""


class ResponseStore:
    """Records by response id, checked against the tenant; subclasses keep the raw JSON text."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S):
        if ttl_s <= 0:
            raise ValueError(f"the stored responses' TTL must be > 0 s, got {ttl_s}")
        self.ttl_s = ttl_s

    async def save(self, resp: dict, conversation: list[dict], tenant: str | None) -> None:
        record = {"tenant": tenant, "response": resp, "conversation": conversation}
        await self._set(resp["id"], json.dumps(record, ensure_ascii=False))

    async def load(self, resp_id: str, tenant: str | None) -> dict | None:
        """The record, or None when there is none for this tenant (or the id is not one of ours)."""
        if not RESPONSE_ID.match(resp_id):
            return None
        text = await self._get(resp_id)
        record = json.loads(text) if text else None
        return record if record is not None and record.get("tenant") == tenant else None

    async def delete(self, resp_id: str, tenant: str | None) -> bool:
        if await self.load(resp_id, tenant) is None:
            return False
        await self._delete(resp_id)
        return True

    async def _set(self, resp_id: str, text: str) -> None:
        raise NotImplementedError

    async def _get(self, resp_id: str) -> str | None:
        raise NotImplementedError

    async def _delete(self, resp_id: str) -> None:
        raise NotImplementedError


class RedisResponseStore(ResponseStore):
    """Shared by every router replica on the same Redis (the RedisState's client)."""

    def __init__(self, redis, ttl_s: float = DEFAULT_TTL_S):
        super().__init__(ttl_s)
        self.redis = redis

    async def _call(self, coro):
        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"the response store (Redis) is unavailable: {exc}") from exc

    async def _set(self, resp_id: str, text: str) -> None:
        await self._call(self.redis.set(KEY_PREFIX + resp_id, text, ex=max(1, round(self.ttl_s))))

    async def _get(self, resp_id: str) -> str | None:
        return await self._call(self.redis.get(KEY_PREFIX + resp_id))

    async def _delete(self, resp_id: str) -> None:
        await self._call(self.redis.delete(KEY_PREFIX + resp_id))


class MemoryResponseStore(ResponseStore):
    """One process's records, the oldest dropped past `max_records`."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_records: int = 10_000):
        super().__init__(ttl_s)
        self.max_records = max_records
        self._records: OrderedDict[str, tuple[float, str]] = OrderedDict()

    async def _set(self, resp_id: str, text: str) -> None:
        self._records[resp_id] = (time.monotonic() + self.ttl_s, text)
        self._records.move_to_end(resp_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    async def _get(self, resp_id: str) -> str | None:
        expires, text = self._records.get(resp_id, (0.0, None))
        if text is not None and expires < time.monotonic():
            del self._records[resp_id]
            return None
        return text

    async def _delete(self, resp_id: str) -> None:
        self._records.pop(resp_id, None)


def store_for(routing, ttl_s: float = DEFAULT_TTL_S) -> ResponseStore:
    """Redis when the router's routing reads Redis (its RedisState), else the process's memory."""
    state = getattr(routing, "state", None)
    redis = getattr(state, "redis", None)
    return RedisResponseStore(redis, ttl_s) if redis is not None else MemoryResponseStore(ttl_s)
